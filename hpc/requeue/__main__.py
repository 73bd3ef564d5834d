"""Entry point of ``python -m hpc.requeue RUN_DIR SRUN_STATUS`` (the batch script's check after srun)."""

import sys

from hpc.schedulers.slurm.requeue import main  # the one kind whose script runs a check after its tasks

sys.exit(main(sys.argv[1:]))

"""Entry point of ``python -m hpc.requeue RUN_DIR SRUN_STATUS`` (the batch script's check after srun)."""

import sys

from hpc.core.requeue import main

sys.exit(main(sys.argv[1:]))

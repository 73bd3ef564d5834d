"""Slurm, all of it: the login side and the job side of ``kind = "slurm"`` sites.

- ``scheduler``: the sbatch script (``render_sbatch``), submit, state, cancel, signal
  (``SlurmScheduler``), and inside the job the id, restart count and requeue (``SlurmJobSide``).
- ``detect``: ``hpcx site detect`` (``scontrol show node``, ``nvidia-smi``) drafting a Slurm site.

Nothing outside this package names Slurm; the rest of hpcx asks ``hpc.schedulers`` by kind.
"""

"""``python -m hpc.requeue RUN_DIR SRUN_STATUS``: the name the batch script's check after srun runs.

The check itself lives with the scheduler whose script runs it (see ``__main__``); this package only
keeps the command line that rendered scripts (and their goldens) name.
"""

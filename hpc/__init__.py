"""hpcx login-node side: specs, site profiles, planning and Slurm submission.

Nothing in this package imports torch at import time; the trainer does.
"""

__version__ = "0.1.0"

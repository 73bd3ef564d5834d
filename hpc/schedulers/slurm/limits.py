"""Slurm's integer limits on what a spec or a site may ask, by the field they bound. No imports.

``hpc.schedulers.LIMITS`` gives the fields the strictest limit of every scheduler kind, so a value
that loads is one every scheduler takes (the spec and site fields in ``hpc.core`` read it there).
"""

SLURM_U16_MAX = 65_533  # ntasks-per-node, cpus-per-task, restart counts: uint16 in Slurm (65534/65535 = unset/infinite)
SLURM_SIGNAL_MAX = 65_535  # `--signal=SIG@N`: sbatch refuses N > 65535 (tried on Slurm 22.05)
SLURM_TIME_MAX_MIN = 35_791_393  # `--time`: larger minute counts come back wrapped (tried on Slurm 22.05)

# field -> the largest value Slurm takes there
LIMITS = {"tasks": SLURM_U16_MAX, "cpus": SLURM_U16_MAX, "gpus": SLURM_U16_MAX, "requeues": SLURM_U16_MAX,
          "signal_lead_s": SLURM_SIGNAL_MAX, "time_limit_min": SLURM_TIME_MAX_MIN}

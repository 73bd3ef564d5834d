"""submitit's Slurm executor with hpcx's task command (``hpc.schedulers.base.task_command``).

Imported only when a job is submitted: submitit and its dependencies are not needed before.
"""

from __future__ import annotations

import submitit

from hpc.schedulers.base import TaskCommand


class SlurmExecutor(TaskCommand, submitit.SlurmExecutor):
    """submitit's ``SlurmExecutor``; each task runs the submission's step (``hpcx_command``: in the site's
    container when it has one, ``hpc.schedulers.slurm.container``)."""

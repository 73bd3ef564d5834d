"""submitit's Slurm executor with hpcx's task command (``hpc.schedulers.base.task_command``).

Imported only when a job is submitted: submitit and its dependencies are not needed before.
"""

from __future__ import annotations

import submitit

from hpc.schedulers.base import TaskCommand


class SlurmExecutor(TaskCommand, submitit.SlurmExecutor):
    """submitit's ``SlurmExecutor``; each task runs ``task_command``, or ``hpcx_command`` when the site has
    a container (the step's command in the image: ``hpc.schedulers.slurm.container``)."""

    hpcx_command: str | None = None

    def task_command_text(self) -> str:
        return self.hpcx_command or super().task_command_text()

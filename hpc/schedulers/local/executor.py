"""submitit's local executor with hpcx's task command (``hpc.schedulers.base.task_command``).

Imported only when a job is submitted: submitit and its dependencies are not needed before.
"""

from __future__ import annotations

import contextlib
import os
import sys
import typing as tp
from pathlib import Path

import submitit

from hpc.schedulers.base import TaskCommand

CONTROLLER_LOG = "controller.log"  # in the submitit folder: what the controller itself prints


class LocalExecutor(TaskCommand, submitit.LocalExecutor):
    """submitit's ``LocalExecutor``; each task runs ``task_command``. The controller it starts gets
    /dev/null for stdin and the run's ``submitit/controller.log`` for stdout and stderr, never the
    caller's: it outlives ``hpcx submit``, and a pipe it held (``RUN=$(hpcx submit …)``) would stay
    open until the job ended."""

    def submitting(self) -> tp.ContextManager[None]:
        return detached_stdio(Path(self.folder) / CONTROLLER_LOG)


@contextlib.contextmanager
def detached_stdio(log: Path) -> tp.Iterator[None]:
    """File descriptors 0, 1 and 2 of this process on /dev/null and ``log`` while the block runs (what a
    child started there inherits), then back as they were."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = [os.dup(fd) for fd in (0, 1, 2)]
    log.parent.mkdir(parents=True, exist_ok=True)
    null, out = os.open(os.devnull, os.O_RDONLY), os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    try:
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        yield
    finally:
        for fd, copy in zip((0, 1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        os.close(null)
        os.close(out)

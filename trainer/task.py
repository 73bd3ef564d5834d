"""``TrainTask``: what the login node pickles and submitit runs once per rank.

This module must not import torch: ``hpcx submit`` pickles ``TrainTask(run_dir)``
on a login node. Torch and the trainer are imported inside ``__call__``.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import typing as tp

from trainer.preemption import PreemptionFlag  # no torch: installed before torch is imported


class TrainTask:
    """One rank of the run in ``run_dir``; returns the summary dict on rank 0, None on other ranks."""

    def __init__(self, run_dir: str):
        self.run_dir = str(run_dir)

    def __call__(self) -> dict[str, tp.Any] | None:
        # submitit has installed its USR2 handler by now; the flag handler replaces it (see preemption.py).
        preemption = PreemptionFlag().install()
        from trainer.train import run_rank  # lazy: torch

        result = run_rank(self.run_dir, preemption=preemption)
        atexit.register(exit_without_native_teardown)
        return result

    def checkpoint(self, *args: tp.Any, **kwargs: tp.Any) -> tp.Any:
        """submitit's requeue hook, reached only if the preemption signal arrives in the short window
        after submitit installed its handler and before ``__call__`` replaced it with the flag
        handler, i.e. before training started. Nothing is lost then: submitit may requeue this same
        task (it resumes from the newest committed checkpoint). Once the flag handler is installed,
        submitit's handler never runs, so the trainer's requeue is the only one."""
        import submitit  # lazy: submitit

        return submitit.helpers.DelayedSubmission(TrainTask(self.run_dir))

    def __repr__(self) -> str:
        return f"TrainTask({self.run_dir!r})"


def exit_without_native_teardown() -> None:
    """Registered after the rank finished its work (submitit then writes the result pickle).

    gloo occasionally aborts in native destructors at interpreter exit ("terminate called
    without an active exception", ~3 in 90 runs), turning a finished job into a failure.
    As the last Python-level exit step, flush and leave with ``os._exit``; an exception that
    reached the top level (``sys.last_value``) keeps exit status 1.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if getattr(sys, "last_value", None) is not None else 0)

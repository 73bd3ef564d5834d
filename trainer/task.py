"""``TrainTask``: what the login node pickles and submitit runs once per rank.

This module must not import torch: ``hpcx submit`` pickles ``TrainTask(run_dir)``
on a login node. Torch and the trainer are imported inside ``__call__``.
"""

from __future__ import annotations

import atexit
import os
import sys
import typing as tp


class TrainTask:
    """One rank of the run in ``run_dir``; returns the summary dict on rank 0, None on other ranks."""

    def __init__(self, run_dir: str):
        self.run_dir = str(run_dir)

    def __call__(self) -> dict[str, tp.Any] | None:
        from trainer.preemption import PreemptionFlag
        from trainer.train import run_rank

        # submitit has installed its USR2 handler by now; the flag handler replaces it (see preemption.py).
        preemption = PreemptionFlag().install()
        result = run_rank(self.run_dir, preemption=preemption)
        atexit.register(exit_without_native_teardown)
        return result

    def checkpoint(self, *args: tp.Any, **kwargs: tp.Any) -> None:
        """submitit's requeue hook. Unused: preemption is flag-driven (every rank saves at a step
        boundary, one rank requeues), and USR2 no longer reaches submitit's handler. Returns None."""
        return None

    def __repr__(self) -> str:
        return f"TrainTask({self.run_dir!r})"


def exit_without_native_teardown() -> None:
    """Registered after the rank finished its work (submitit then writes the result pickle).

    gloo occasionally aborts in native destructors at interpreter exit ("terminate called
    without an active exception", ~3 in 90 runs), turning a finished job into a failure.
    As the last Python-level exit step, flush and leave with ``os._exit``; an exception that
    reached the top level (``sys.last_value``) keeps exit status 1.
    """
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if getattr(sys, "last_value", None) is not None else 0)

"""Preemption as a flag: the signal handler only sets it; ranks agree on it at a step boundary.

Slurm sends ``--signal=USR2@LEAD`` before the time limit (and ``hpcx drill`` sends it on demand).
submitit installs its own USR2 handler before it calls the task; on rank 0 it would call
``TrainTask.checkpoint`` from inside the signal handler, in the middle of a step, while the other
ranks carry on — a collective (DCP) save cannot live there. ``install`` therefore replaces
submitit's handler with one that only sets this flag. ``trainer.resilience`` all-reduces the flag
(MAX) at each step boundary, so every rank sees the same answer and all save together.

SIGTERM is not a preemption: it is what ``scancel`` (and the end of a requeue or of the time
limit) sends. It stays with submitit (which ignores it), but ``install`` notes it in
``terminated`` so that nothing requeues a job that is being cancelled.

This module imports torch only inside ``agreed``: ``TrainTask`` installs the handler before
importing torch, which keeps the window in which submitit's handler is still active short.
"""

from __future__ import annotations

import logging
import os
import signal
import typing as tp

log = logging.getLogger("hpcx.trainer")


def preempt_signal() -> signal.Signals:
    """USR2 unless ``SUBMITIT_PREEMPT_SIGNAL`` names another (submitit's convention)."""
    return signal.Signals["SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")]


class PreemptionFlag:
    """Set by a signal, read at step boundaries."""

    def __init__(self) -> None:
        self.requested = False
        self.terminated = False

    def install(self) -> "PreemptionFlag":
        """Own the preemption signal from now on (replacing submitit's handler); note SIGTERM."""
        signal.signal(preempt_signal(), self._handle)
        previous = signal.getsignal(signal.SIGTERM)
        if callable(previous):  # submitit's logging bypass: keep it, only note the signal first
            signal.signal(signal.SIGTERM, lambda signum, frame: self._terminate(previous, signum, frame))
        return self

    def _handle(self, signum: int, frame: tp.Any) -> None:  # a handler only sets the flag
        self.requested = True

    def _terminate(self, previous: tp.Callable, signum: int, frame: tp.Any) -> None:
        self.terminated = True
        previous(signum, frame)

    def agreed(self, device: tp.Any) -> bool:
        """True on every rank if any rank got the signal (collective: call it on all ranks)."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(self.requested)], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        agreed = bool(flag.item())
        if agreed:
            log.warning("preemption requested (signal %s): stopping at this step boundary", preempt_signal().name)
        return agreed

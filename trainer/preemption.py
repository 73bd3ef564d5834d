"""Preemption as a flag: the signal handler only sets it; ranks agree on it at a step boundary.

Slurm sends ``--signal=USR2@LEAD`` before the time limit or on preemption.
submitit installs its own USR2 handler before it calls the task; on rank 0 it
would call ``TrainTask.checkpoint`` from inside the signal handler, in the middle
of a step, while the other ranks carry on — a collective (DCP) save cannot live
there. ``install`` therefore replaces submitit's handler with one that only sets
this flag (SIGTERM stays with submitit, which ignores it: a cancel is not a
preemption). The loop calls ``agreed`` at each step boundary: one all-reduce
(MAX) so that every rank sees the same answer and all save together.
"""

from __future__ import annotations

import logging
import os
import signal

import torch
import torch.distributed as dist

log = logging.getLogger("hpcx.trainer")


def preempt_signal() -> signal.Signals:
    """USR2 unless ``SUBMITIT_PREEMPT_SIGNAL`` names another (submitit's convention)."""
    return signal.Signals["SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")]


class PreemptionFlag:
    """Set by a signal, read at step boundaries."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> "PreemptionFlag":
        """Own the preemption signal from now on (replacing submitit's handler)."""
        signal.signal(preempt_signal(), self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:  # a handler only sets the flag
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        """True on every rank if any rank got the signal (collective: call it on all ranks)."""
        flag = torch.tensor([int(self.requested)], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        agreed = bool(flag.item())
        if agreed:
            log.warning("preemption requested (signal %s): stopping at this step boundary", preempt_signal().name)
        return agreed

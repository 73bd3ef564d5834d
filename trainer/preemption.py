"""Preemption and cancel as flags: the signal handlers only set them; ranks agree on them at a step boundary.

Slurm sends ``--signal=USR2@LEAD`` before the time limit (and ``hpcx drill`` sends it on demand).
submitit installs its own USR2 handler before it calls the task; on rank 0 it would call
``TrainTask.checkpoint`` from inside the signal handler, in the middle of a step, while the other
ranks carry on — a collective (DCP) save cannot live there. ``install`` therefore replaces
submitit's handler with one that only sets ``requested``.

SIGTERM is not a preemption: it is what ``scancel``/``hpcx cancel`` sends (and the end of a requeue, of
the time limit, or of a step whose task failed). ``install`` sets ``terminated``; at the next agreed
step boundary the ranks stop without saving (``trainer.resilience``), and nothing requeues.

Both signals are held (blocked) from the task's first line (``trainer.entry``) until ``install``, so one
that came early is acted on at the first step boundary instead of killing the task or being dropped.

``BoundaryVote`` is how the ranks agree without syncing the GPU: a MAX all-reduce of a few flags on a
gloo side group (CPU tensors), started at each boundary and read at the next one. This module imports
torch only inside functions: ``TrainTask`` installs the handlers before importing torch.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import typing as tp

from trainer.entry import release_signals

log = logging.getLogger("hpcx.trainer")


def preempt_signal() -> signal.Signals:
    """USR2 unless ``SUBMITIT_PREEMPT_SIGNAL`` names another (submitit's convention)."""
    return signal.Signals["SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")]


class PreemptionFlag:
    """The stop request of one task: set by a signal, read at step boundaries (the trainer's) or when the
    command ended (script mode's, ``trainer.script``). ``on_first_request`` runs once, at the first preemption
    signal (script mode creates the flag file ``hpc.job.preempted`` reads); ``forward`` gets every signal
    taken (script mode passes it on to the command)."""

    def __init__(self, clock: tp.Callable[[], float] = time.time,
                 on_first_request: tp.Callable[[], None] | None = None,
                 forward: tp.Callable[[int], None] | None = None) -> None:
        self.requested = False  # the preemption signal: save, stop, requeue
        self.requested_at: float | None = None  # when it first came (a time limit's warning, or not)
        self.terminated = False  # SIGTERM: stop without saving, never requeue
        self.clock, self.on_first_request, self.forward = clock, on_first_request, forward
        self._previous_term: tp.Callable | None = None
        self._vote: BoundaryVote | None = None

    def install(self) -> "PreemptionFlag":
        """Own the preemption signal and SIGTERM from now on (replacing submitit's handlers; its SIGTERM
        logger still runs), then release what ``trainer.entry`` held since the task started."""
        signal.signal(preempt_signal(), self._handle)
        previous = signal.getsignal(signal.SIGTERM)
        self._previous_term = previous if callable(previous) else None
        signal.signal(signal.SIGTERM, self._terminate)
        release_signals()
        return self

    def _handle(self, signum: int, frame: tp.Any) -> None:  # a handler only sets the flag (and its time)
        first = not self.requested
        if first:
            self.requested_at = self.clock()
        self.requested = True
        if first and self.on_first_request is not None:
            self.on_first_request()
        if self.forward is not None:
            self.forward(signum)

    def _terminate(self, signum: int, frame: tp.Any) -> None:
        self.terminated = True
        if self._previous_term is not None:
            self._previous_term(signum, frame)
        if self.forward is not None:
            self.forward(signum)

    def mine(self) -> list[int]:
        """This rank's flags as a vote: [preemption requested, SIGTERM seen]."""
        return [int(self.requested), int(self.terminated)]

    def agreed(self, device: tp.Any = None) -> bool:
        """True on every rank, at the same boundary, once any rank got either signal (collective: call it
        on all ranks at every step boundary). Used by loops without ``trainer.resilience``."""
        if self._vote is None:
            self._vote = BoundaryVote()
        preempt, term = self._vote.exchange(self.mine())
        if preempt or term:
            self._vote.close()
            log.warning("%s agreed: stopping at this step boundary", "SIGTERM" if term else "preemption")
        return bool(preempt or term)


class BoundaryVote:
    """Ranks agree on a few integer flags (MAX over ranks) at each step boundary with no device sync.

    ``exchange`` returns the answer of the vote sent at the previous boundary (zeros at the first) and
    sends this boundary's flags in the background: an all-reduce of a CPU tensor on a gloo side group
    (``trainer.dist.side_group``), which has long arrived when the next boundary reads it. Every rank
    calls ``exchange`` once per boundary, so all ranks read the same answer at the same boundary: a flag
    raised during step k is acted on at boundary k+1 (one step later than a blocking vote would), and no
    ``.item()`` of a GPU tensor is ever taken. At one rank the answer is the flags themselves, at once.
    """

    def __init__(self) -> None:
        self._work: tp.Any = None
        self._sent: tp.Any = None

    def exchange(self, flags: list[int], last: bool = False) -> list[int]:
        """The agreed flags of the previous boundary; sends ``flags`` for the next (``last``: no next)."""
        import torch  # lazy: torch
        import torch.distributed as dist  # lazy: torch

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return list(flags)
        agreed = self._collect() or [0] * len(flags)
        if not last:
            from trainer.dist import side_group  # lazy: torch

            self._sent = torch.tensor(flags, dtype=torch.int32)
            self._work = dist.all_reduce(self._sent, op=dist.ReduceOp.MAX, group=side_group(), async_op=True)
        return agreed

    def close(self) -> None:
        """Wait for the vote in flight (every rank, at the same boundary, before the loop stops)."""
        self._collect()

    def _collect(self) -> list[int] | None:
        if self._work is None:
            return None
        self._work.wait()
        self._work = None
        return [int(v) for v in self._sent.tolist()]

"""The typed seam between the training loop and the work done at its step boundaries.

The loop (``trainer.loop``) knows nothing of checkpoints, preemption votes or cancels: after every
optimizer step it calls ``StepBoundary.boundary`` (``trainer.resilience.Resilience`` is the one
implementation), and before the first step ``StepBoundary.resume``. What that work may read of the
loop is ``LoopView`` (the ``Trainer``'s model, optimizer, scheduler, device, step count, layout) and
``Progress`` (the ``TrainState``: the step and what survives a requeue). Neither side reaches further.
"""

from __future__ import annotations

import typing as tp

if tp.TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

    from hpc.core.dims import ParallelDims
    from trainer.watch import MetricWatch


class Progress(tp.Protocol):
    """What survives a requeue (``trainer.loop.TrainState``): the step, and its state for a checkpoint."""

    step: int

    def state_dict(self) -> dict[str, tp.Any]: ...

    def load_state_dict(self, state: dict[str, tp.Any]) -> None: ...


class LoopView(tp.Protocol):
    """What step-boundary work reads of the loop (``trainer.loop.Trainer``)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    device: torch.device
    steps: int  # the run's last step
    dims: ParallelDims
    watch: MetricWatch | None  # the watched evaluation metric (best checkpoint, early stopping)


P = tp.TypeVar("P", bound=Progress)


class StepBoundary(tp.Protocol):
    """Work at step boundaries: the loop calls ``resume`` once, then ``boundary`` after every step."""

    restart: int  # this start's number among the ledger's starts (known once ``resume`` ran)

    def resume(self, t: LoopView, state: P) -> P:
        """Load the newest checkpoint into ``t`` and ``state`` (collective); ``state`` as it goes on."""
        ...

    def boundary(self, t: LoopView, state: Progress) -> bool:
        """Save when due; True when the loop must stop (preemption or a cancel agreed). Collective."""
        ...

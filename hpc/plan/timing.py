"""A step's time from its compute and its communication: what overlap can hide, and what it cannot.

Compute per micro-batch splits into forward (1/3 of the 6N FLOPs) and backward (2/3, plus the
recomputed forward under activation checkpointing). Each communication part runs in one phase
of a micro-batch (``Part.phase``) and either on every micro-batch or once per step, in the last
micro-batch's backward (``Part.repeat``): DDP's all-reduce (``no_sync`` before), HSDP's
cross-replica all-reduce, fsdp no_shard's all-reduce. Within a phase, communication hides under
that phase's compute, except one call of each collective (the first all-gather has nothing to
overlap with, the last reduce-scatter or bucket waits for the last gradients):

    exposed(phase) = max(one call of each part, communication − compute of the phase)

A CPU optimizer step (offload) runs after backward and hides under nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpc.plan.comm import Comm, Part

CPU_ADAM_PARAMS_PER_CORE_S = 1e8  # torch AdamW on the host, parameters per second per core (assumed)


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step of one rank."""

    compute_s: float
    comm_s: float  # every collective and host copy
    exposed_s: float  # the part of comm_s that compute does not hide
    host_s: float = 0.0  # the CPU optimizer step under offload

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_s + self.host_s



def phases(compute_s: float, grad_accum: int, checkpointing: bool) -> tuple[float, float]:
    """(forward, backward) compute seconds of one micro-batch."""
    base = compute_s / grad_accum / (4 / 3 if checkpointing else 1.0)
    return base / 3, 2 * base / 3 + (base / 3 if checkpointing else 0.0)


def _exposed(parts: list[Part], compute: float) -> float:
    """One micro-batch's parts in one phase: what its compute cannot hide."""
    if not parts:
        return 0.0
    runs = sum((p.seconds or 0.0) / p.repeat for p in parts)
    return max(sum(p.unhidden_s for p in parts), runs - compute)


def exposed_seconds(comm: Comm, compute_s: float, grad_accum: int, checkpointing: bool) -> float:
    """Communication seconds per step that overlap with compute cannot hide."""
    fwd, bwd = phases(compute_s, grad_accum, checkpointing)
    total = 0.0
    for phase, compute in (("forward", fwd), ("backward", bwd)):
        every = [p for p in comm.parts if p.phase == phase and p.repeat > 1]
        last = [p for p in comm.parts if p.phase == phase]  # the last micro-batch runs every part
        total += (grad_accum - 1) * _exposed(every, compute) + _exposed(last, compute)
    return total


def host_step_seconds(params_per_rank: float, cores_per_rank: int) -> float:
    """The CPU AdamW step on a rank's offloaded shard."""
    return params_per_rank / (CPU_ADAM_PARAMS_PER_CORE_S * max(1, cores_per_rank))


def step_time(comm: Comm | None, compute_s: float | None, grad_accum: int, checkpointing: bool,
              host_s: float = 0.0) -> StepTime | None:
    """The step's time, or None when compute or a communication time is unknown."""
    if comm is None or compute_s is None or comm.seconds is None:
        return None
    return StepTime(compute_s, comm.seconds, exposed_seconds(comm, compute_s, grad_accum, checkpointing), host_s)

"""The training loop: one ``train_step`` per optimizer step, and one step boundary.

Everything that survives a requeue is in ``TrainState``; everything the loop
uses is in ``Trainer`` (built by ``trainer.train.build_trainer``). The single
seam for checkpoints and preemption is ``step_boundary``.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
import typing as tp
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hpc.dims import ParallelDims
from trainer.data import GlobalSampler
from trainer.metrics import MetricsWriter, memory_gb, mfu, progress_line
from trainer.optim import clip_grad_norm
from trainer.parallelize import set_gradient_sync
from trainer.preemption import PreemptionFlag

log = logging.getLogger("hpcx.trainer")


@dataclass
class TrainState:
    """What a checkpoint restores besides model, optimizer and scheduler: plain numbers only.

    RNG states are per rank and saved by ``trainer.checkpoint`` itself (``rng.rank<R>``).
    """

    step: int = 0
    tokens_seen: int = 0
    sampler: dict[str, int] = field(default_factory=lambda: {"consumed_samples": 0, "epoch": 0})

    def state_dict(self) -> dict[str, tp.Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "sampler": dict(self.sampler)}

    def load_state_dict(self, state: dict[str, tp.Any]) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.sampler = {k: int(v) for k, v in state["sampler"].items()}


@dataclass
class Trainer:
    """The pieces of one rank's training, already built and parallelized."""

    run_dir: Path
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: GlobalSampler
    loader: tp.Iterable
    device: torch.device
    steps: int
    grad_clip: float
    log_every: int
    tokens_per_step: int
    world_size: int
    dims: ParallelDims
    metrics: MetricsWriter
    flops_per_token: float | None = None
    peak_tflops: float = 0.0
    amp_dtype: torch.dtype | None = None
    scaler: tp.Any = None  # a GradScaler for fp16
    preemption: PreemptionFlag | None = None
    warmup_metrics_steps: int = 2
    resilience: tp.Any = None  # a trainer.resilience.Resilience (checkpoints, preemption, ledger), set by run_rank

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def micro_step_context(model: nn.Module, sync: bool) -> tp.ContextManager:
    """Inner micro-steps: DDP skips its all-reduce (``no_sync``); FSDP2 keeps reduce-scattering and
    HSDP skips only the all-reduce across replicas (see ``set_gradient_sync``)."""
    set_gradient_sync(model, sync)
    if not sync and isinstance(model, nn.parallel.DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


def forward_backward(t: Trainer, tokens: torch.Tensor, scale: float) -> torch.Tensor:
    """Loss of one micro-batch (mean over its tokens × ``scale``), back-propagated; returns it detached."""
    tokens = tokens.to(t.device, non_blocking=True)
    autocast = (torch.autocast(t.device.type, dtype=t.amp_dtype) if t.amp_dtype is not None
                else contextlib.nullcontext())
    with autocast:
        logits = t.model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()) * scale
    (t.scaler.scale(loss) if t.scaler is not None else loss).backward()
    return loss.detach()


def train_step(t: Trainer, micro_batches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over this rank's micro-batches; returns (local mean loss, grad norm)."""
    n = len(micro_batches)
    total = torch.zeros((), device=t.device)
    for i, tokens in enumerate(micro_batches):
        with micro_step_context(t.model, sync=i == n - 1):
            total += forward_backward(t, tokens, 1.0 / n)
    if t.scaler is not None:
        t.scaler.unscale_(t.optimizer)
    norm = clip_grad_norm(t.params, t.grad_clip)
    if t.scaler is not None:
        t.scaler.step(t.optimizer)
        t.scaler.update()
    else:
        t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)
    t.scheduler.step()
    return total, norm


def global_mean(value: torch.Tensor, world_size: int) -> float:
    """Mean over ranks (gloo has no AVG): every rank holds the mean over its share of the global batch."""
    if world_size > 1 and dist.is_initialized():
        value = value.clone()
        dist.all_reduce(value)
        value /= world_size
    return float(value)


def step_record(t: Trainer, state: TrainState, loss: float, norm: torch.Tensor, lr: float, seconds: float,
                data_seconds: float) -> dict:
    """One metrics.jsonl line; ``data_s`` is rank 0's wait for its micro-batches (the scaling report's
    data share of the step)."""
    tokens_per_s = t.tokens_per_step / seconds
    return {"step": state.step, "loss": loss, "lr": lr, "tokens_per_s": tokens_per_s, "step_time_s": seconds,
            "data_s": data_seconds, "mfu": mfu(t.flops_per_token, tokens_per_s, t.world_size, t.peak_tflops),
            "mem_gb": memory_gb(t.device), "grad_norm": float(norm)}


def step_boundary(t: Trainer, state: TrainState) -> bool:
    """Called once after every optimizer step, on every rank; True stops the loop.

    With a ``Resilience`` (``run_rank`` attaches one): interval, final and preemption saves, and the
    stop after a preemption save (``trainer.resilience``). Without one, only the agreed preemption flag.
    """
    if t.resilience is not None:
        return t.resilience.boundary(t, state)
    return t.preemption is not None and t.preemption.agreed(t.device)


def train(t: Trainer, state: TrainState) -> dict[str, tp.Any]:
    """Run from ``state.step`` to ``t.steps``; returns a summary (loss of the last logged step, …)."""
    t.sampler.load_state_dict(state.sampler)
    batches = iter(t.loader)
    accum = t.sampler.grad_accum
    history: list[dict] = []
    stopped = False
    tic, last_logged, data_s = time.perf_counter(), state.step, 0.0
    while state.step < t.steps and not stopped:
        lr = t.optimizer.param_groups[0]["lr"]
        fetch = time.perf_counter()
        micro_batches = [next(batches) for _ in range(accum)]
        data_s += time.perf_counter() - fetch
        loss, norm = train_step(t, micro_batches)
        t.sampler.advance()
        state.step += 1
        state.tokens_seen += t.tokens_per_step
        state.sampler = t.sampler.state_dict()
        if state.step % t.log_every == 0 or state.step == t.steps:
            mean_loss = global_mean(loss, t.world_size)  # also waits for the step's work
            toc, steps = time.perf_counter(), state.step - last_logged
            history.append(step_record(t, state, mean_loss, norm, lr, (toc - tic) / steps, data_s / steps))
            t.metrics.write(history[-1])
            log.info(progress_line(history[-1], t.steps))
            tic, last_logged, data_s = time.perf_counter(), state.step, 0.0
        stopped = step_boundary(t, state)
    t.metrics.close()
    return summary(t, state, history, stopped)


def summary(t: Trainer, state: TrainState, history: list[dict], stopped: bool) -> dict[str, tp.Any]:
    """The result returned on rank 0: final loss, steps, median tokens/s after warm-up, world, strategy."""
    steady = [r for r in history if r["step"] > t.warmup_metrics_steps] or history
    return {"final_loss": history[-1]["loss"] if history else None, "steps": state.step,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady) if steady else None,
            "step_time_s": statistics.median(r["step_time_s"] for r in steady) if steady else None,
            "world_size": t.world_size, "strategy": t.dims.strategy, "preempted": stopped,
            "losses": [r["loss"] for r in history], "run_dir": str(t.run_dir)}

"""The training loop: one ``train_step`` per optimizer step, and one step boundary.

Everything that survives a requeue is in ``TrainState``; everything the loop
uses is in ``Trainer`` (built by ``trainer.train.build_trainer``). The single
seam for checkpoints and preemption is ``step_boundary``, typed by ``trainer.boundary``.

Host syncs: a step reads no device value except at its boundary (the preemption vote,
``trainer.resilience``) and, every ``train.log_every`` steps, one transfer of the mean loss and
the gradient norm for the metrics line; with a loss mask too (the count of targets stays on the
device: ``trainer.objective``). ``Trainer.clock`` charges the loop's seconds to its
phases (data, forward, backward, optimizer, log, boundary); each metrics line carries their
split (``phases_s``), so a slower phase names itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import typing as tp
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from hpc.core.dims import ParallelDims
from trainer.boundary import StepBoundary
from trainer.data import GlobalSampler, StreamSampler
from trainer.garbage import GarbageCollection
from trainer.evaluate import Evaluator, eval_step
from trainer.metrics import MetricsWriter, PhaseClock, memory_gb, mfu, progress_line
from trainer.objective import Batch, autocast_of, tp_loss_context
from trainer.optim import clip_grad_norm
from trainer.parallelize import set_gradient_sync, set_reshard_after_backward
from trainer.preemption import PreemptionFlag
from trainer.straggler import StepSplit
from trainer.tasks import LoopTask
from trainer.watch import MetricWatch
from trainer.watchdog import Watchdog, paused

log = logging.getLogger("hpcx.trainer")


@dataclass
class TrainState:
    """What a checkpoint restores besides model, optimizer and scheduler: plain numbers only.

    RNG states are per rank and saved by ``trainer.checkpoint`` itself (``rng.rank<R>``).
    """

    step: int = 0
    tokens_seen: int = 0
    sampler: dict[str, int] = field(default_factory=lambda: {"consumed_samples": 0, "epoch": 0})
    task: dict[str, tp.Any] = field(default_factory=dict)  # the task's own (``LoopTask.state_dict``), plain data
    watch: dict[str, tp.Any] = field(default_factory=dict)  # the watched metric's (``MetricWatch.state_dict``)
    data: dict[str, tp.Any] = field(default_factory=dict)  # an iterable dataset's own state (``StreamSampler``)

    def state_dict(self) -> dict[str, tp.Any]:
        out: dict[str, tp.Any] = {"step": self.step, "tokens_seen": self.tokens_seen, "sampler": dict(self.sampler)}
        out.update({k: dict(v) for k, v in (("task", self.task), ("watch", self.watch), ("data", self.data)) if v})
        return out

    def load_state_dict(self, state: dict[str, tp.Any]) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.sampler = {k: int(v) for k, v in state["sampler"].items()}
        self.task = dict(state.get("task", {}))
        self.watch = dict(state.get("watch", {}))
        self.data = dict(state.get("data", {}))


@dataclass
class Trainer:
    """The pieces of one rank's training, already built and parallelized."""

    run_dir: Path
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: GlobalSampler | StreamSampler  # a map-style dataset's indices, or an iterable dataset's stream
    loader: tp.Iterable
    device: torch.device
    steps: int
    grad_clip: float
    log_every: int
    tokens_per_step: int
    world_size: int
    dims: ParallelDims
    metrics: MetricsWriter
    task: LoopTask  # what is trained: its model's units, data, loss and evaluation (``trainer.tasks``)
    flops_per_token: float | None = None
    peak_tflops: float = 0.0
    amp_dtype: torch.dtype | None = None
    scaler: torch.amp.GradScaler | None = None  # fp16 only (ShardedGradScaler under FSDP)
    preemption: PreemptionFlag | None = None
    warmup_metrics_steps: int = 2
    keep_gathered: bool = False  # parallel.reshard_after_forward = false under FSDP: no reshard between micro-batches
    resilience: StepBoundary | None = None  # trainer.resilience.Resilience (checkpoints, preemption, ledger), set by run_rank
    clock: PhaseClock = field(default_factory=PhaseClock)
    gc_every: int = 0  # train.gc_every: collect every N steps on all ranks, automatic GC off (0: Python's own)
    evaluator: Evaluator | None = None  # when train.eval_every is set
    last_eval: dict | None = None
    init_report: dict | None = None  # what checkpoint.init_from read (trainer.init_from.start_weights)
    counted: torch.Tensor | None = None  # a masked loss: the last step's counted targets, whole batch (on the device)
    watch: MetricWatch | None = None  # checkpoint.keep_best / train.early_stop_patience (``trainer.watch``)
    watchdog: Watchdog | None = None  # the hang watchdog (trainer.watchdog), set by run_rank: told of each boundary
    straggler: StepSplit | None = None  # per-rank compute vs wait, every health.straggler_every steps (trainer.straggler)
    padded: torch.Tensor | int | None = None  # a language model's: the last step's pad tokens, whole batch (None: a task's)

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def micro_step_context(model: nn.Module, sync: bool, keep_gathered: bool = False) -> tp.ContextManager:
    """Inner micro-steps: DDP skips its all-reduce (``no_sync``); FSDP2 keeps reduce-scattering and
    HSDP skips only the all-reduce across replicas (see ``set_gradient_sync``). ``keep_gathered``
    (``parallel.reshard_after_forward`` = false): FSDP2 keeps the gathered units after every backward
    but the last micro-batch's, so later micro-batches gather nothing (``set_reshard_after_backward``)."""
    set_gradient_sync(model, sync)
    if keep_gathered:
        set_reshard_after_backward(model, sync)
    if not sync and isinstance(model, nn.parallel.DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


def forward_backward(t: Trainer, batch: Batch, scale: float | torch.Tensor) -> torch.Tensor:
    """Loss of one micro-batch (the task's, ``LoopTask.micro_loss``), back-propagated; returns it detached."""
    batch = t.task.to_device(batch, t.device)  # ``train_step`` moved it already: a no-op there
    with tp_loss_context(t.dims.tp_enabled):  # loss_parallel under tp: the loss and its backward
        loss = t.task.micro_loss(t.model, batch, scale, autocast_of(t.device, t.amp_dtype))
        t.clock.lap("forward")
        (t.scaler.scale(loss) if t.scaler is not None else loss).backward()
    t.clock.lap("backward")
    if t.straggler is not None:  # backward returned: waiting for the others' gradients ends
        t.straggler.synced()
    return loss.detach()


def train_step(t: Trainer, micro_batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over this rank's micro-batches; returns (local mean loss, grad norm)."""
    n = len(micro_batches)
    micro_batches = [t.task.to_device(b, t.device) for b in micro_batches]
    scale = t.task.step_scale(micro_batches, t.world_size)
    t.counted = getattr(t.task, "counted", None)  # a masked loss's counted targets (the language models')
    t.padded = getattr(t.task, "padded", None)  # and their pad tokens (0 where the data has none)
    total = torch.zeros((), device=t.device)
    for i, tokens in enumerate(micro_batches):
        with micro_step_context(t.model, sync=i == n - 1, keep_gathered=t.keep_gathered):
            total += forward_backward(t, tokens, scale)
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
    t.clock.lap("optimizer")
    return total, norm


def logged_values(loss: torch.Tensor, norm: torch.Tensor, world_size: int,
                  scalars: dict[str, torch.Tensor] | None = None) -> tuple[float, float, dict[str, float]]:
    """(mean loss over ranks, gradient norm, the task's scalars as means over ranks), copied from the device
    together: one all-reduce, one host sync.

    Every rank holds the mean over its share of the global batch; gloo has no AVG, so sum and divide.
    """
    names = sorted(scalars or {})
    means = torch.stack([loss, *((scalars or {})[n].to(loss.device, loss.dtype) for n in names)])
    if world_size > 1 and dist.is_initialized():
        dist.all_reduce(means)
        means /= world_size
    host = [float(v) for v in torch.cat([means.double(), norm.to(loss.device, torch.float64).reshape(1)]).cpu()]
    return host[0], host[-1], {f"train_{n}": v for n, v in zip(names, host[1:-1])}


def step_record(t: Trainer, state: TrainState, loss: float, norm: float, lr: float,
                phases: dict[str, float]) -> dict:
    """One metrics.jsonl line, over the steps since the previous one: ``step_time_s`` is the sum of
    the phases (``phases_s``, seconds per step); ``data_s`` is rank 0's wait for its micro-batches
    (the scaling report's data share of the step). With a loss mask, ``counted_fraction``: the share of
    the last step's targets the loss counted (the rest: prompts, padding, document boundaries); a language
    model's, packed or not, ``padding_fraction`` (the last step's pad tokens among its inputs: a windowed
    folder's, 0 for other data) and ``real_tokens_per_s`` (tokens/s less that share); read after
    ``logged_values`` waited for the step, so no extra wait."""
    seconds = sum(phases.values())
    tokens_per_s = t.tokens_per_step / seconds
    counted = {} if t.counted is None else {"counted_fraction": int(t.counted) / t.tokens_per_step}
    if t.padded is not None:  # a language model's, packed or not: what of tokens/s is not padding
        padding = int(t.padded) / t.tokens_per_step
        counted.update(padding_fraction=padding, real_tokens_per_s=tokens_per_s * (1 - padding))
    return {"step": state.step, "loss": loss, "lr": lr, "tokens_per_s": tokens_per_s, "step_time_s": seconds,
            "data_s": phases["data"], "mfu": mfu(t.flops_per_token, tokens_per_s, t.world_size, t.peak_tflops),
            "mem_gb": memory_gb(t.device), "grad_norm": norm, "phases_s": phases, **counted}


def step_boundary(t: Trainer, state: TrainState) -> bool:
    """Called once after every optimizer step, on every rank; True stops the loop.

    With a ``Resilience`` (``run_rank`` attaches one): interval, final and preemption saves, and the
    stop after a preemption save (``trainer.resilience``). Without one, only the agreed preemption flag.
    """
    if t.resilience is not None:
        stop = t.resilience.boundary(t, state)
    else:
        stop = t.preemption is not None and t.preemption.agreed(t.device)
        stop = stop or (t.watch is not None and t.watch.stopped)
    if t.watchdog is not None:
        t.watchdog.beat(state.step)
    if t.straggler is not None:
        t.straggler.boundary(state.step)
    return stop


def set_float_math(device: torch.device) -> None:
    """Process-wide float settings for training on ``device``.

    Subnormal floats are flushed to zero on the CPU, wherever the device: on x86 each operation
    on a subnormal takes a slow microcode path, and once attention sharpens the softmax backward
    yields them by the hundred thousand (a CPU step then costs 1.5× and more: bench/float_math;
    the CPU-offloaded AdamW meets them in squared small gradients). Nothing below 1.2e-38 matters
    to a float32 run: AdamW's eps alone is 1e-8. On CUDA, fp32 matmuls may use TF32 tensor cores
    (``float32_matmul_precision("high")``; bf16/fp16 compute is unchanged by it).
    """
    torch.set_flush_denormal(True)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")


CUBLAS_WORKSPACE = ":4096:8"  # a fixed cuBLAS workspace: its split-K reductions in one order


def set_determinism(deterministic: bool) -> None:
    """Process-wide kernel choice (``train.deterministic``): on, every op must use a deterministic
    kernel (``torch.use_deterministic_algorithms``; one without raises, naming itself), cuDNN too, and
    cuBLAS a fixed workspace (``CUBLAS_WORKSPACE_CONFIG``, read when its handle is made: call this before
    any CUDA work; a value already exported wins). Off, torch's defaults (fastest; on a GPU the same
    inputs may differ in the last bits between runs). Seeds are ``train.seed``'s business, not this."""
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = False


def train(t: Trainer, state: TrainState) -> dict[str, tp.Any]:
    """Run from ``state.step`` to ``t.steps``; returns a summary (loss of the last logged step, …)."""
    set_float_math(t.device)
    t.sampler.load_state_dict(state.sampler)
    t.sampler.load_data_state(state.data)
    t.task.load_state_dict(state.task)
    if t.watch is not None:
        t.watch.load_state_dict(state.watch)
    batches = iter(t.loader)
    accum = t.sampler.grad_accum
    history: list[dict] = []
    stopped = t.watch is not None and t.watch.stopped  # a run that stopped early and was started again
    last_logged = state.step
    collector = GarbageCollection(t.gc_every)  # closed after the loop (a failure ends the process)
    t.clock.restart()
    while state.step < t.steps and not stopped:
        lr = t.optimizer.param_groups[0]["lr"]
        micro_batches = [next(batches) for _ in range(accum)]
        t.clock.lap("data")
        loss, norm = train_step(t, micro_batches)
        if t.straggler is not None:  # this rank's own step ends (the log, an evaluation, a save are not its)
            t.straggler.worked()
        scalars = t.task.step_scalars() if hasattr(t.task, "step_scalars") else {}  # the task's own, on the device
        t.sampler.advance()
        state.step += 1
        state.tokens_seen += t.tokens_per_step
        state.sampler = t.sampler.state_dict()
        state.data = t.sampler.data_state()
        state.task = t.task.state_dict()
        if logs_at(t, state.step):
            history.append(log_step(t, state, loss, norm, lr, state.step - last_logged, scalars))
            last_logged = state.step
        if t.evaluator is not None and t.evaluator.due(state.step, t.steps):
            with paused(t.watchdog):  # an evaluation is not a hang
                t.last_eval = eval_step(t, state.step)
            watch_eval(t, state)
        stopped = step_boundary(t, state)
        collector.step(state.step)
        t.clock.lap("boundary")
    collector.close()
    t.metrics.close()
    return summary(t, state, history, stopped)


def watch_eval(t: Trainer, state: TrainState) -> None:
    """Hand the evaluation of this step to the watched metric (``trainer.watch``); its state is the train
    state's, saved with the step boundary's checkpoint."""
    if t.watch is None or t.last_eval is None:
        return
    t.watch.observe(t.last_eval, state.step)
    state.watch = t.watch.state_dict()


def logs_at(t: Trainer, step: int) -> bool:
    """Every ``log_every`` steps, the last step, and the last warm-up step: each line averages the steps
    since the previous one, so no line after warm-up mixes warm-up steps into its throughput."""
    return step % t.log_every == 0 or step in (t.steps, t.warmup_metrics_steps)


def log_step(t: Trainer, state: TrainState, loss: torch.Tensor, norm: torch.Tensor, lr: float,
             steps: int, scalars: dict[str, torch.Tensor] | None = None) -> dict:
    """The metrics line of the ``steps`` steps up to this one (every rank reduces the loss and the task's
    scalars of this step, ``train_<name>``; rank 0 writes). Writing it is charged to the next line's ``log``
    phase."""
    mean_loss, grad_norm, own = logged_values(loss, norm, t.world_size, scalars)  # also waits for the step
    t.clock.lap("log")
    record = {**step_record(t, state, mean_loss, grad_norm, lr, t.clock.take(steps)), **own}
    t.metrics.write(record)
    log.info(progress_line(record, t.steps))
    t.clock.lap("log")
    return record


def summary(t: Trainer, state: TrainState, history: list[dict], stopped: bool) -> dict[str, tp.Any]:
    """The result returned on rank 0: final loss, steps, median tokens/s after warm-up, world, strategy."""
    steady = [r for r in history if r["step"] > t.warmup_metrics_steps] or history
    return {"final_loss": history[-1]["loss"] if history else None, "steps": state.step,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady) if steady else None,
            "step_time_s": statistics.median(r["step_time_s"] for r in steady) if steady else None,
            "world_size": t.world_size, "strategy": t.dims.strategy, **stopped_how(t, stopped),
            "losses": [r["loss"] for r in history], "run_dir": str(t.run_dir), **watch_summary(t),
            **{k: v for k, v in (t.last_eval or {}).items() if k.startswith("eval_") and k not in SUMMARY_LEFT_OUT}}


def stopped_how(t: Trainer, stopped: bool) -> dict[str, bool]:
    """``preempted`` (stopped at an agreed preemption, saved) or ``cancelled`` (SIGTERM agreed: ``hpcx
    cancel``, no save), as the resilience's stop reason says; an early stop (``watch``) is neither; without
    a reason, every other early stop is a preemption."""
    reason = getattr(t.resilience, "reason", None) if stopped else None
    early = t.watch is not None and t.watch.stopped
    return {"preempted": stopped and reason != "terminated" and not early, "cancelled": reason == "terminated"}


def watch_summary(t: Trainer) -> dict[str, tp.Any]:
    """The best evaluation and an early stop, for the summary (nothing without a watched metric)."""
    if t.watch is None:
        return {}
    best = {"best": {"step": t.watch.best_step, t.watch.metric: t.watch.best}}
    return {**best, "early_stopped_at": t.watch.stopped_at} if t.watch.stopped else best


SUMMARY_LEFT_OUT = ("eval_tokens", "eval_samples", "eval_s")  # of the last eval record: its values only

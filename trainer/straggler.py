"""The straggler report of one rank: its compute and its wait in collectives, gathered every N steps.

What a rank measures, per step (the loop tells it three moments; on the CPU each is the host's clock,
``time.perf_counter``; on a GPU a CUDA event recorded on the current stream, so that the spans are the
device's: the host runs ahead of the kernels and NCCL waits on the stream, not on the host. The events are
read once per interval, after one synchronize, ``DeviceMarks``):

- the step's work: from the end of the previous step boundary to the return of ``train_step`` (data,
  forward, backward, optimizer; the metrics line's all-reduce, evaluations and checkpoint saves are left
  out: they are not this rank's own step and a save is rank 0's more than the others');
- its wait in the gradient sync: from the moment its own backward produced its last gradient (a
  post-accumulate-grad hook on every trained parameter) to the return of ``backward()``, which under DDP
  waits there for every rank's gradients. A fast rank waits there for a slow one; the slow one does not.

compute = work − wait. Every ``health.straggler_every`` steps all ranks all-gather [compute, wait] of the
interval (one tensor of two floats per rank on the gloo side group: no device sync), and rank 0 writes
the interval's metrics line (``kind = "ranks"``), judges it (``hpc.core.straggler.Judge``), names a
straggler in its log and the run folder (``RUN/health/stragglers.json``: ``hpcx status`` shows it; the
ledger's stop line carries it).

Limits: under FSDP the sharded parameters get their gradients from FSDP's reduce-scatter, not from
autograd's accumulation, so no hook fires and the wait inside forward and backward (FSDP's all-gathers)
counts as compute. On a GPU the wait is the device's from the last gradient's kernel to the end of
backward on the compute stream, which DDP makes wait for NCCL's all-reduce.
"""

from __future__ import annotations

import logging
import os
import time
import typing as tp
from dataclasses import dataclass, field
from pathlib import Path

from hpc.core import straggler as verdicts

if tp.TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from trainer.metrics import MetricsWriter
    from trainer.resilience import Resilience
    from trainer.run import Run

log = logging.getLogger("hpcx.trainer")


@dataclass(frozen=True)
class HostMarks:
    """The CPU's moments: the host's clock; a span is a difference, known at once."""

    clock: tp.Callable[[], float] = time.perf_counter

    def mark(self) -> tp.Any:
        return self.clock()

    def settle(self) -> None:
        """Nothing to wait for."""

    def seconds(self, start: tp.Any, end: tp.Any) -> float:
        return float(end) - float(start)


@dataclass(frozen=True)
class DeviceMarks:
    """A GPU's moments: a CUDA event recorded on the current stream (``new_event``: ``torch.cuda.Event`` with
    timing); a span is known once the device has passed both, so the interval settles them first (one
    synchronize every ``health.straggler_every`` steps)."""

    new_event: tp.Callable[[], tp.Any]
    synchronize: tp.Callable[[], None]

    def mark(self) -> tp.Any:
        event = self.new_event()
        event.record()
        return event

    def settle(self) -> None:
        self.synchronize()

    def seconds(self, start: tp.Any, end: tp.Any) -> float:
        return float(start.elapsed_time(end)) / 1000.0  # milliseconds


def marks_for(device: tp.Any) -> HostMarks | DeviceMarks:
    """Device events on CUDA, the host's clock elsewhere."""
    if getattr(device, "type", "cpu") != "cuda":
        return HostMarks()
    import torch  # lazy: torch

    return DeviceMarks(lambda: torch.cuda.Event(enable_timing=True), torch.cuda.synchronize)


def gather_times(pair: list[float], world: int) -> list[list[float]]:
    """Every rank's [compute, wait] (all-gather on the gloo side group; collective)."""
    import torch  # lazy: torch
    import torch.distributed as dist  # lazy: torch

    from trainer.dist import side_group  # lazy: torch

    if world == 1 or not dist.is_initialized():
        return [list(pair)]
    mine = torch.tensor(pair, dtype=torch.float64)
    out = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(out, mine, group=side_group())
    return [[float(v) for v in t.tolist()] for t in out]


def gather_hosts(host: str, world: int) -> list[str]:
    """Every rank's host name, once (collective)."""
    import torch.distributed as dist  # lazy: torch

    if world == 1 or not dist.is_initialized():
        return [host]
    from trainer.dist import side_group  # lazy: torch

    out: list[tp.Any] = [None] * world
    dist.all_gather_object(out, host, group=side_group())
    return [str(h) for h in out]


@dataclass
class StepSplit:
    run_dir: Path
    rank: int
    world: int
    incarnation: str
    every: int  # health.straggler_every
    judge: verdicts.Judge
    metrics: MetricsWriter | None = None  # rank 0's writer (others: None)
    host: str = field(default_factory=lambda: os.uname().nodename)
    clock: tp.Callable[[], float] = time.perf_counter  # the host's (``marks`` None)
    marks: HostMarks | DeviceMarks | None = None  # how moments are taken (None: ``HostMarks(clock)``)
    gather: tp.Callable[[list[float], int], list[list[float]]] = gather_times
    gather_hosts: tp.Callable[[str, int], list[str]] = gather_hosts
    hosts: list[str] | None = None  # every rank's, gathered at the first interval
    began: tp.Any = None  # the end of the previous boundary (None: before the first)
    grads_done: tp.Any = None  # when this rank's backward produced its last gradient
    work_spans: list[tuple[tp.Any, tp.Any]] = field(default_factory=list)  # this interval's, read at its end
    wait_spans: list[tuple[tp.Any, tp.Any]] = field(default_factory=list)
    steps: int = 0
    named: list[dict] = field(default_factory=list)  # every rank named during this start (rank 0)
    now: list[dict] = field(default_factory=list)  # the ranks named at the last interval (rank 0)
    warm: bool = False  # an interval of this start was gathered already (rank 0)
    written: bool = False  # this start's verdict is in the run folder (an earlier start's is replaced)

    # ------------------------------------------------------------ the loop's side

    def __post_init__(self) -> None:
        if self.marks is None:
            self.marks = HostMarks(self.clock)

    def _mark(self) -> tp.Any:
        assert self.marks is not None
        return self.marks.mark()

    def attach(self, model: nn.Module) -> StepSplit:
        """Note the moment each trained parameter's gradient is accumulated (the last one: backward done)."""
        for param in model.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._grad_ready)
        return self

    def _grad_ready(self, _: tp.Any) -> None:
        self.grads_done = self._mark()

    def synced(self) -> None:
        """``backward()`` returned: the time since the last gradient was waiting for the others."""
        if self.grads_done is not None:
            self.wait_spans.append((self.grads_done, self._mark()))
        self.grads_done = None

    def worked(self) -> None:
        """``train_step`` returned: the step's work ends here."""
        if self.began is not None:
            self.work_spans.append((self.began, self._mark()))
            self.steps += 1
        self.began = None

    def boundary(self, step: int) -> None:
        """After the step boundary (every rank, every step): every ``every`` steps the interval is gathered
        and judged; the next step's work begins now."""
        if self.every and step > 0 and step % self.every == 0:
            self.interval(step)
        self.began = self._mark()

    # ------------------------------------------------------------ one interval

    def interval(self, step: int) -> None:
        """Gather [compute, wait] of every rank (collective); rank 0 writes and judges them."""
        work, wait = self.settled()
        times = self.gather([max(0.0, work - wait), wait], self.world)
        if self.hosts is None:
            self.hosts = self.gather_hosts(self.host, self.world)
        steps, self.steps = self.steps, 0
        if self.rank == 0 and steps:
            self.judged(step, steps, [t[0] for t in times], [t[1] for t in times])

    def settled(self) -> tuple[float, float]:
        """The interval's work and wait in seconds (its spans read, once the device passed them); reset."""
        marks = self.marks
        assert marks is not None
        if self.work_spans or self.wait_spans:
            marks.settle()
        work = sum(marks.seconds(a, b) for a, b in self.work_spans)
        wait = sum(max(0.0, marks.seconds(a, b)) for a, b in self.wait_spans)
        self.work_spans, self.wait_spans = [], []
        return work, wait

    def judged(self, step: int, steps: int, compute: list[float], wait: list[float]) -> None:
        """Rank 0: the interval's metrics line; a verdict that changed reaches the log and the run folder."""
        found = self.judge.observe(compute) if self.warm else verdicts.ratios(compute)
        self.warm = True  # a start's first interval holds its warm-up (DDP rebuilds its buckets): not judged
        if self.metrics is not None:
            self.metrics.write(verdicts.interval_record(step, steps, compute, wait, found))
        now = verdicts.stragglers(self.judge, found, self.hosts or [])
        if not now and not self.now and self.written:
            return  # nothing named, and this start's (empty) verdict is in the run folder already
        before = {s["rank"] for s in self.now}
        for named in now:
            if named["rank"] not in before:
                log.warning("%s (at step %d)", verdicts.words(named), step)
        for rank in before - {s["rank"] for s in now}:
            log.warning("straggler report: rank %d is no longer slower than the others (at step %d)", rank, step)
        self.named, self.now = verdicts.merged(self.named, now), now
        try:
            verdicts.write(self.run_dir, {"step": step, "time": time.time(), "incarnation": self.incarnation,
                                          "stragglers": now, "named": self.named})
            self.written = True
        except OSError as exc:  # a report is a help; training goes on without it
            log.warning("straggler report: could not write %s: %s", verdicts.path_of(self.run_dir), exc)


def straggler_for(run: Run, world: int, guard: Resilience, model: nn.Module,
                  metrics: MetricsWriter) -> StepSplit | None:
    """This rank's step split (``health.straggler_every`` > 0, more than one rank: one has no others to be
    slower than), its hooks on ``model``."""
    settings = run.spec.health
    if not settings.straggler_every or world < 2:
        return None
    judge = verdicts.Judge(settings.straggler_factor, settings.straggler_intervals)
    device = next((p.device for p in model.parameters()), None)
    return StepSplit(run.run_dir, guard.rank, world, guard.incarnation, settings.straggler_every, judge,
                     metrics=metrics if guard.rank == 0 else None, marks=marks_for(device)).attach(model)

"""Per-step numbers: throughput, MFU, memory; ``metrics.jsonl`` and logging setup."""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
import typing as tp
from pathlib import Path

import torch

from hpc.core.runs import RunDir

if tp.TYPE_CHECKING:  # pragma: no cover
    from torch.utils.tensorboard import SummaryWriter  # optional: imported when a writer is opened

log = logging.getLogger("hpcx.trainer")


def setup_logging(logs_dir: Path, rank: int) -> None:
    """Every rank logs to ``logs/rank-R.log``; rank 0 also to stderr."""
    logs_dir.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    handlers: list[logging.Handler] = [logging.FileHandler(logs_dir / f"rank-{rank}.log")]
    if rank == 0:
        handlers.append(logging.StreamHandler(sys.stderr))
    for h in log.handlers[:]:  # logging's registry is process-wide by nature: this process's rank owns it
        log.removeHandler(h)
        h.close()
    for h in handlers:
        h.setFormatter(fmt)
        log.addHandler(h)
    log.setLevel(logging.INFO)
    log.propagate = False


def flush_logging() -> None:
    for h in log.handlers:
        h.flush()
    sys.stdout.flush()
    sys.stderr.flush()


def memory_gb(device: torch.device) -> float:
    """GPU: max allocated since start; CPU: the current resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # peak, KiB on Linux


def mfu(flops_per_token: float | None, tokens_per_s: float, world_size: int, peak_tflops: float) -> float | None:
    """Model FLOP utilisation: achieved FLOP/s over the ranks' bf16 peak (None when unknown)."""
    if not flops_per_token or not peak_tflops:
        return None
    return flops_per_token * tokens_per_s / (world_size * peak_tflops * 1e12)


PHASES = ("data", "forward", "backward", "optimizer", "log", "boundary")


class PhaseClock:
    """Seconds of each phase of the steps since the last metrics line.

    ``lap(phase)`` charges the time since the previous lap to ``phase``, so every second of the
    loop is counted once and the phases add up to the step time. On the CPU these are host
    seconds. On CUDA (``PhaseClock(device)``) each lap records an event on the current stream and
    ``take`` reads the GPU's time between consecutive events: host seconds there would charge the
    kernels queued by forward and backward to whichever phase next waits for the GPU (``log``,
    ``boundary``). Recording an event never waits; ``take`` waits for the last one, which the
    metrics line's one read of the loss has already passed.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.cuda = device is not None and device.type == "cuda"
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.last = time.perf_counter()
        self.events: list[tuple[str, tp.Any]] = [("", self._event())] if self.cuda else []

    def restart(self) -> None:
        """Forget what was charged so far (the loop starts, after building and resuming)."""
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.last = time.perf_counter()
        self.events = [("", self._event())] if self.cuda else []

    def lap(self, phase: str) -> None:
        if self.cuda:
            self.events.append((phase, self._event()))
            return
        now = time.perf_counter()
        self.totals[phase] += now - self.last
        self.last = now

    def skip(self) -> None:
        """Charge the time since the last lap to no phase (an evaluation, which has its own record).
        On CUDA an event marks the skip: the GPU time up to it (the evaluation's kernels) goes nowhere."""
        if self.cuda:
            self.events.append(("", self._event()))
            return
        self.last = time.perf_counter()

    def take(self, steps: int) -> dict[str, float]:
        """Seconds per step of each phase since the last ``take``; starts a new window."""
        if self.cuda:
            self._charge_events()
        window = {name: seconds / steps for name, seconds in self.totals.items()}
        self.totals = dict.fromkeys(PHASES, 0.0)
        return window

    def _event(self) -> tp.Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _charge_events(self) -> None:
        """Charge the GPU time between consecutive events to the later one's phase (a skip's event,
        phase "", to none); keep the last."""
        self.events[-1][1].synchronize()
        for (_, before), (phase, after) in zip(self.events, self.events[1:]):
            if phase:
                self.totals[phase] += before.elapsed_time(after) / 1000.0
        self.events = self.events[-1:]


class MetricsWriter:
    """Rank 0's ``metrics.jsonl`` (one JSON object per line, flushed), and TensorBoard when installed.
    Once ``start`` is set (the ledger's number of this start), every line carries it: the steps a
    restart recomputes appear once per start, and a reader keeps each step's last line."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.enabled = enabled
        self.start: int | None = None
        self.file = open(RunDir(run_dir).metrics, "a") if enabled else None
        self.tb = _tensorboard(run_dir) if enabled else None

    def write(self, record: dict) -> None:
        if self.file is None:  # not enabled
            return
        if self.start is not None:
            record = {**record, "start": self.start}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for key, value in record.items():
                if key not in ("step", "start") and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


def _tensorboard(run_dir: Path) -> SummaryWriter | None:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional: say so once (only rank 0 opens a writer)
        log.info("TensorBoard is not installed: no event files are written (metrics.jsonl has every value; "
                 "`hpcx plot RUN` draws them; pip install 'hpcx[tensorboard]' for event files)")
        return None
    return SummaryWriter(str(run_dir / "tensorboard"))


def progress_line(record: dict, total_steps: int) -> str:
    """The human line in the rank-0 log."""
    parts = [f"step {record['step']}/{total_steps}", f"loss {record['loss']:.4f}", f"lr {record['lr']:.3g}",
             f"gnorm {record['grad_norm']:.3f}", f"{record['tokens_per_s']:.0f} tok/s",
             f"{record['step_time_s'] * 1000:.0f} ms", f"mem {record['mem_gb']:.2f} GB"]
    if record.get("mfu") is not None:
        parts.append(f"mfu {100 * record['mfu']:.1f}%")
    return " | ".join(parts)

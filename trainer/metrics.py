"""Per-step numbers: throughput, MFU, memory; ``metrics.jsonl`` and logging setup."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from hpc.core.runs import RunDir

log = logging.getLogger("hpcx.trainer")


def setup_logging(logs_dir: Path, rank: int) -> None:
    """Every rank logs to ``logs/rank-R.log``; rank 0 also to stderr."""
    logs_dir.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    handlers: list[logging.Handler] = [logging.FileHandler(logs_dir / f"rank-{rank}.log")]
    if rank == 0:
        handlers.append(logging.StreamHandler(sys.stderr))
    for h in log.handlers[:]:
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
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # peak, KiB on Linux


def mfu(flops_per_token: float | None, tokens_per_s: float, world_size: int, peak_tflops: float) -> float | None:
    """Model FLOP utilisation: achieved FLOP/s over the ranks' bf16 peak (None when unknown)."""
    if not flops_per_token or not peak_tflops:
        return None
    return flops_per_token * tokens_per_s / (world_size * peak_tflops * 1e12)


PHASES = ("data", "forward", "backward", "optimizer", "log", "boundary")


class PhaseClock:
    """Host seconds of each phase of the steps since the last metrics line.

    ``lap(phase)`` charges the time since the previous lap to ``phase``, so every second of the
    loop is counted once and the phases add up to the step time. On a GPU these are host
    seconds: a phase that reads a device value (``log``, ``boundary``) also holds the wait for
    the kernels queued before it.
    """

    def __init__(self) -> None:
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.last = time.perf_counter()

    def restart(self) -> None:
        """Forget what was charged so far (the loop starts, after building and resuming)."""
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.totals[phase] += now - self.last
        self.last = now

    def take(self, steps: int) -> dict[str, float]:
        """Seconds per step of each phase since the last ``take``; starts a new window."""
        window = {name: seconds / steps for name, seconds in self.totals.items()}
        self.totals = dict.fromkeys(PHASES, 0.0)
        return window


class MetricsWriter:
    """Rank 0's ``metrics.jsonl`` (one JSON object per line, flushed), and TensorBoard when installed."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.enabled = enabled
        self.file = open(RunDir(run_dir).metrics, "a") if enabled else None
        self.tb = _tensorboard(run_dir) if enabled else None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


def _tensorboard(run_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
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

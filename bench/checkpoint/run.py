"""Checkpoint save/load throughput against `dd` on the same disk, and the async-save pause.

    python bench/checkpoint/run.py [--size-mb 256] [--dir DIR] [--repeat 3] [--no-stock]

Single process (strategy none): a module of ``--size-mb`` MB of fp32 parameters is saved with
``Checkpointer.save`` (DCP, fsync'ed, retention included) and loaded with ``load_checkpoint``, in
the same folder and the same run as ``dd``:

- dd write: ``dd if=SRC of=OUT bs=1M conv=fdatasync`` where SRC is a file of the same number of
  random bytes already in the page cache (a checkpoint is random data; ``if=/dev/zero`` is printed
  too: a virtual disk may write zeros faster). The ratio uses the random source.
- dd read, two ways, the same on both sides: *warm* (right after the write, from the page cache)
  and *cold* (each side's files first dropped from the page cache with
  ``posix_fadvise(DONTNEED)`` after ``fdatasync``; no root needed).
- ``stock``: the same calls with DCP's own ``FileSystemWriter`` (CRC32 on) and ``FileSystemReader``
  read path (``torch.load`` per item, then a copy), i.e. hpcx before its fast paths, for a
  before/after ratio within one run (``--no-stock`` skips it).

The async pause is what a training loop loses: the ``Checkpointer.save`` call, plus what the
next optimizer step waits for staging after one forward and backward (staging runs in the
background meanwhile). Goals: save and load >= 0.5x dd; async pause <= 0.25x the sync save. Best of ``--repeat`` runs each
(the median is printed too).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import typing as tp
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from trainer import checkpoint as ckpt
from trainer.checkpoint import Checkpointer, load_checkpoint

MB = 2**20


def big_module(size_mb: int) -> nn.Module:
    """Linear layers of 16 MB each adding up to ``size_mb`` MB of fp32 parameters."""
    layers = max(1, size_mb // 16)
    return nn.Sequential(*(nn.Linear(2048, 2048, bias=False) for _ in range(layers)))


def timed(fn) -> float:
    """Seconds ``fn()`` took."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def drop_cache(path: Path) -> None:
    """Evict ``path`` (a file, or every file of a folder) from the page cache."""
    for f in [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()]:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def dd(size_mb: int, src: Path, path: Path) -> dict[str, float]:
    """Seconds: write from /dev/zero and from ``src`` (fdatasync), read warm, read cold."""
    def run(*args: str) -> None:
        subprocess.run(["dd", *args, "bs=1M"], check=True, capture_output=True)

    out = {"write_zero": timed(lambda: run("if=/dev/zero", f"of={path}", f"count={size_mb}", "conv=fdatasync"))}
    path.unlink()
    out["write"] = timed(lambda: run(f"if={src}", f"of={path}", f"count={size_mb}", "conv=fdatasync"))
    out["read_warm"] = timed(lambda: run(f"if={path}", "of=/dev/null"))
    drop_cache(path)
    out["read_cold"] = timed(lambda: run(f"if={path}", "of=/dev/null"))
    path.unlink()
    return out


@contextmanager
def stock_dcp():
    """hpcx as it was before its fast paths: DCP's writer (CRC32 on) and DCP's read_data."""
    class StockWriter(dcp.FileSystemWriter):  # CRC32 on, no digests
        def __init__(self, *args, digests_inline: bool = True, **kwargs):
            super().__init__(*args, **kwargs)
            self.written: list[str] = []

    writer, read_data = ckpt.HpcxFileSystemWriter, ckpt.SafeFileSystemReader.read_data
    ckpt.HpcxFileSystemWriter = StockWriter
    ckpt.SafeFileSystemReader.read_data = dcp.FileSystemReader.read_data
    try:
        yield
    finally:
        ckpt.HpcxFileSystemWriter, ckpt.SafeFileSystemReader.read_data = writer, read_data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=256, help="state size in MB (default 256)")
    ap.add_argument("--dir", type=Path, default=None, help="folder on the disk to measure (default: a temp folder)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64, help="rows of the forward/backward that runs while an "
                    "async save stages (default 64)")
    ap.add_argument("--no-stock", action="store_true", help="skip the stock-DCP (before) variant")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    root = Path(tempfile.mkdtemp(prefix="hpcx-bench-ckpt-", dir=args.dir))
    try:
        run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(args: argparse.Namespace, root: Path) -> None:
    """Every measurement, ``--repeat`` times, then the report."""
    torch.manual_seed(0)
    model = big_module(args.size_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)  # lr 0: the weights stay
    model(torch.randn(args.batch, 2048)).sum().backward()
    optimizer.step()  # the momentum buffers exist from here on, as in training
    optimizer.zero_grad(set_to_none=True)
    size_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / MB
    src = root / "random.src"
    src.write_bytes(os.urandom(round(size_mb) * MB))
    variants = ["hpcx"] if args.no_stock else ["stock", "hpcx"]
    res: dict[str, list[float]] = {}
    steps = iter(range(1, 1 << 30))
    sync_saves, async_saves = Checkpointer(root), Checkpointer(root, async_save=True)  # never in flight together
    for _ in range(args.repeat):
        for k, v in dd(round(size_mb), src, root / "dd.bin").items():
            res.setdefault(f"dd_{k}", []).append(v)
        for variant in variants:
            with stock_dcp() if variant == "stock" else nullcontext():
                sync_and_load(sync_saves, next(steps), model, variant, res)
        async_round(sync_saves, async_saves, steps, model, optimizer, args.batch, res)
    report(size_mb, res, variants, root, args)


def sync_and_load(saves: Checkpointer, step: int, model: nn.Module, variant: str, res: dict) -> None:
    """One sync save (model only), its digests, a warm and a cold load."""
    add = lambda k, v: res.setdefault(f"{variant}_{k}", []).append(v)  # noqa: E731
    add("save", timed(lambda: saves.save(step, model, None, None, {"step": step})))
    add("digests", timed(saves.wait))  # hpcx: shard digests, in the background
    path = ckpt.step_dir(saves.run_dir, step)
    add("load_warm", timed(lambda: load_checkpoint(path, model)))
    drop_cache(path)
    add("load_cold", timed(lambda: load_checkpoint(path, model)))


def async_round(sync_saves: Checkpointer, async_saves: Checkpointer, steps: tp.Iterator[int], model: nn.Module,
                optimizer: torch.optim.Optimizer, batch: int, res: dict) -> None:
    """A sync save of weights + momentum (the reference), then an async save of the same state."""
    add = lambda k, v: res.setdefault(k, []).append(v)  # noqa: E731
    step = next(steps)
    add("sync_full", timed(lambda: sync_saves.save(step, model, optimizer, None, {"step": step})))
    sync_saves.wait()
    pause, waited, fwd_bwd = async_pause(async_saves, next(steps), model, optimizer, batch)
    add("pause", pause)
    add("waited", waited)
    add("fwd_bwd", fwd_bwd)
    add("async_rest", timed(async_saves.wait))


def async_pause(saves: Checkpointer, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                batch: int) -> tuple[float, float, float]:
    """(seconds a training loop is blocked by an async save: the call plus what the next optimizer
    step waits for staging, of which the wait; the forward and backward that ran meanwhile)."""
    t = time.perf_counter()
    saves.save(step, model, optimizer, None, {"step": step})
    blocked = time.perf_counter() - t
    t = time.perf_counter()
    model(torch.randn(batch, 2048)).sum().backward()  # the next step, while staging runs
    fwd_bwd = time.perf_counter() - t
    t = time.perf_counter()
    saves.wait_staged()  # what optimizer.step's hook waits for
    waited = time.perf_counter() - t
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return blocked + waited, waited, fwd_bwd


def nullcontext():
    from contextlib import nullcontext as nc

    return nc()


def report(size_mb: float, res: dict[str, list[float]], variants: list[str], root: Path,
           args: argparse.Namespace) -> None:
    best = {k: min(v) for k, v in res.items()}
    med = {k: statistics.median(v) for k, v in res.items()}
    rate = lambda s: size_mb / s  # noqa: E731
    print(f"state {size_mb:.0f} MB in {root}; best (median) of {len(res['pause'])} runs, ratio = dd time / our time")
    print(f"dd write fdatasync, random src {rate(best['dd_write']):6.0f} MB/s ({rate(med['dd_write']):.0f}); "
          f"from /dev/zero {rate(best['dd_write_zero']):.0f} ({rate(med['dd_write_zero']):.0f})")
    print(f"dd read warm {rate(best['dd_read_warm']):6.0f} MB/s ({rate(med['dd_read_warm']):.0f}); "
          f"cold {rate(best['dd_read_cold']):.0f} ({rate(med['dd_read_cold']):.0f})")
    for v in variants:
        for what, ddk in (("save", "dd_write"), ("load_warm", "dd_read_warm"), ("load_cold", "dd_read_cold")):
            k = f"{v}_{what}"
            print(f"{v:5} {what:10} {rate(best[k]):6.0f} MB/s ({rate(med[k]):5.0f})  ratio to dd "
                  f"{best[ddk] / best[k]:5.2f} (median {med[ddk] / med[k]:4.2f})  (goal >= 0.5)")
    print(f"sync save returns after {best['hpcx_save']:.3f} s; its shard digests take {best['hpcx_digests']:.3f} s "
          "more in a background thread (joined by the next save)")
    save = best["sync_full"]
    print(f"async pause {best['pause']:.3f} s vs sync save of the same state (weights + momentum) {save:.3f} s: ratio "
          f"{best['pause'] / save:5.2f} (median {med['pause'] / med['sync_full']:.2f}; goal <= 0.25); the write then "
          f"takes {best['async_rest']:.3f} s more in the background, digests included")
    print(f"  of the pause, {best['waited']:.3f} s (median {med['waited']:.3f}) is the next optimizer step waiting "
          f"for staging after a {best['fwd_bwd']:.3f} s forward+backward (--batch {args.batch})")


if __name__ == "__main__":
    main()

"""Checkpoint save/load throughput against `dd` on the same disk, and the async-save pause.

    python bench/checkpoint/run.py [--size-mb 256] [--dir DIR] [--repeat 3]

Single process (strategy none): a module of ``--size-mb`` MB of fp32 parameters is saved with
``save_checkpoint`` (DCP, fsync'ed) and loaded with ``load_checkpoint``; ``dd`` writes the same
number of bytes with ``conv=fdatasync`` and reads them back, in the same folder, in the same run.
Loads and the dd read both come from the page cache right after the write (nothing here drops
caches), so the read ratio compares like with like. Goals: save and load >= 0.5x dd; async pause
<= 0.25x the sync save. Best of ``--repeat`` runs each.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from trainer.checkpoint import load_checkpoint, save_checkpoint, wait_pending

MB = 2**20


def big_module(size_mb: int) -> nn.Module:
    """Linear layers of 16 MB each adding up to ``size_mb`` MB of fp32 parameters."""
    layers = max(1, size_mb // 16)
    return nn.Sequential(*(nn.Linear(2048, 2048, bias=False) for _ in range(layers)))


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def dd(size_mb: int, path: Path) -> tuple[float, float]:
    """(write seconds with fdatasync, read seconds) for ``size_mb`` MB at ``path``."""
    w = timed(lambda: subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={size_mb}",
                                      "conv=fdatasync"], check=True, capture_output=True))
    r = timed(lambda: subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M"], check=True, capture_output=True))
    path.unlink()
    return w, r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=256, help="state size in MB (default 256)")
    ap.add_argument("--dir", type=Path, default=None, help="folder on the disk to measure (default: a temp folder)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hpcx-bench-ckpt-", dir=args.dir))
    try:
        run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(args: argparse.Namespace, root: Path) -> None:
    torch.manual_seed(0)
    model = big_module(args.size_mb)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    size_mb = nbytes / MB
    saves, loads, pauses, async_totals, dd_w, dd_r = [], [], [], [], [], []
    step = 0
    for _ in range(args.repeat):
        w, r = dd(round(size_mb), root / "dd.bin")
        dd_w.append(w), dd_r.append(r)
        step += 1
        saves.append(timed(lambda: save_checkpoint(root, step, model, None, None, {"step": step}, keep=2)))
        path = root / "checkpoints" / f"step-{step:07d}"
        loads.append(timed(lambda: load_checkpoint(path, model)))
        step += 1
        t = time.perf_counter()
        save_checkpoint(root, step, model, None, None, {"step": step}, keep=2, async_save=True)
        pauses.append(time.perf_counter() - t)
        wait_pending()
        async_totals.append(time.perf_counter() - t)
    report(size_mb, min(saves), min(loads), min(pauses), min(async_totals), min(dd_w), min(dd_r), root)


def report(size_mb: float, save: float, load: float, pause: float, async_total: float, dd_w: float, dd_r: float,
           root: Path) -> None:
    rate = lambda s: size_mb / s  # noqa: E731
    print(f"state {size_mb:.0f} MB in {root} (best of runs)")
    print(f"dd write (fdatasync) {rate(dd_w):8.0f} MB/s   dd read {rate(dd_r):8.0f} MB/s")
    print(f"DCP save             {rate(save):8.0f} MB/s   ratio to dd write {dd_w / save:5.2f}  (goal >= 0.5)")
    print(f"DCP load             {rate(load):8.0f} MB/s   ratio to dd read  {dd_r / load:5.2f}  (goal >= 0.5)")
    print(f"async pause {pause:.3f} s vs sync save {save:.3f} s: ratio {pause / save:5.2f}  (goal <= 0.25); "
          f"async total {async_total:.3f} s")


if __name__ == "__main__":
    main()

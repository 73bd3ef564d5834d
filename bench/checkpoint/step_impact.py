"""Step time while an async checkpoint is written: in a thread (hpcx) or in a process (DCP's option).

    python bench/checkpoint/step_impact.py [--size-mb 64] [--repeat 8]

An async save writes in the background while training goes on. This measures what that costs
the training loop: the median step time while a save of ``--size-mb`` MB is being written,
divided by the median step time right before it (the baseline, measured in the same
repetition), for two kinds of step:

- ``compute``: an MLP forward + backward (bound by the CPU cores, like a CPU run);
- ``launch``: 50 tiny in-place ops (bound by Python and the GIL, like a GPU loop launching kernels).

``thread`` is hpcx's async save (``Checkpointer(async_save=True).save``: DCP's thread executor, hpcx's
writer, digests included); ``process`` is the same writer under ``dcp.async_save`` with
``AsyncCheckpointerType.PROCESS`` (a checkpoint daemon process; needs a process group, so a
one-rank gloo group is created). A process only removes GIL contention: where the ratio is the
same for both, the cost is CPU cores, not the GIL. Goal (issue 12): <= 1.05 for the thread.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from trainer import checkpoint as ckpt


def workloads() -> dict:
    """The two kinds of training step, as functions."""
    mlp, x = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512)), torch.randn(64, 512)
    small = [torch.randn(8) for _ in range(50)]

    def compute() -> None:
        mlp(x).sum().backward()

    def launch() -> None:
        for t in small:
            t.mul_(1.0001).add_(0.0001)

    return {"compute": compute, "launch": launch}


def step_times(work, until=None, n: int = 30, limit: int = 2000) -> list[float]:
    """Times of ``n`` steps, or of every step until ``until()`` is true (at most ``limit``)."""
    times: list[float] = []
    while (len(times) < n) if until is None else (not until() and len(times) < limit):
        t = time.perf_counter()
        work()
        times.append(time.perf_counter() - t)
    return times


def save_in_thread(saves: ckpt.Checkpointer, root: Path, step: int, model: nn.Module):
    """hpcx's async save; the future of its write."""
    saves.save(step, model, None, None, {"step": step})
    return saves._pending.future


def save_in_process(saves: ckpt.Checkpointer, root: Path, step: int, model: nn.Module):
    """The same writer under DCP's process executor (shared-memory staging); the future of its write."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = save_in_process.__dict__.setdefault("stager", DefaultStager(StagingOptions(False, True, False, False)))
    writer = ckpt.HpcxFileSystemWriter(root / f"p{step}", overwrite=False)
    response = dcp.async_save({"model": model.state_dict()}, storage_writer=writer, async_stager=stager,
                              async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    return response if hasattr(response, "result") else response.upload_completion


def measure(args: argparse.Namespace, root: Path) -> dict:
    """{(thread|process, workload): [step time during a save / before it, per repetition]}."""
    model = nn.Sequential(*(nn.Linear(2048, 2048, bias=False) for _ in range(max(1, args.size_mb // 16))))
    savers = {"thread": save_in_thread, "process": save_in_process}
    saves = ckpt.Checkpointer(root, keep=2, async_save=True)
    res: dict = {}
    step = 0
    for _ in range(args.repeat + 1):  # the first repetition warms staging buffers and the daemon up
        for kind, save in savers.items():
            for name, work in workloads().items():
                base = statistics.median(step_times(work))
                step += 1
                future = save(saves, root, step, model)
                during = step_times(work, until=future.done)
                future.result()
                saves.wait()
                if step > 4 and during:
                    res.setdefault((kind, name), []).append(statistics.median(during) / base)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=64, help="state size in MB (default 64)")
    ap.add_argument("--repeat", type=int, default=8)
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    root = Path(tempfile.mkdtemp(prefix="hpcx-bench-steps-", dir=args.dir))
    dist.init_process_group("gloo", store=dist.FileStore(str(root / "store"), 1), rank=0, world_size=1)
    try:
        print(f"{os.cpu_count()} CPUs, load {os.getloadavg()}; state {args.size_mb} MB; step time during a save "
              "/ before it (median of steps, then of repetitions)")
        for (kind, name), ratios in sorted(measure(args, root).items()):
            print(f"{kind:8} {name:8} {statistics.median(ratios):6.2f}  (each: {' '.join(f'{r:.2f}' for r in ratios)})")
        print(f"load after {os.getloadavg()}; goal: thread <= 1.05")
    finally:
        dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

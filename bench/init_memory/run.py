"""Host memory per rank while the trainer builds and initialises the model, against the model's size.

    python bench/init_memory/run.py [--sizes 350m,1.3b] [--ranks 2,4] [--old 350m]

For each preset and rank count, that many CPU processes (gloo) build the model the trainer's way
(``trainer.train.build_parallel_model``: meta device → ``fully_shard`` → ``WeightInit``) under fsdp
full_shard. Each rank records its RSS after joining the group (the baseline: Python, torch, gloo)
and its peak RSS (VmHWM, reset just before the build) after initialisation, and prints, beside
them, in the same run:

- ``full``: the whole model in fp32 (what every rank held before meta init);
- ``shard``: this rank's fp32 parameters;
- ``module``: the largest module's full fp32 tensors (what ``WeightInit`` computes at once).

Ratios: (peak − baseline) / full and (peak − baseline) / (shard + module). The goal is the second
near 1: a rank holds its shard plus one module, not the model. For the presets in ``--old`` the
previous way (the whole model built and initialised on the host, then ``fully_shard``) is measured
in the same run, as a before/after. The defaults took 9 minutes on 2 shared cores at load average 12.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
GB = 1e9


def status_bytes(field: str) -> int:
    """A /proc/self/status field (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def reset_peak() -> None:
    """Make VmHWM start again from the current RSS (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def worker(rank: int, world: int, port: int, size: str, old: bool, out: str) -> None:
    import torch
    import torch.distributed as dist

    from hpc.cli import load_job
    from hpc.core.resolve import launch_parallel
    from trainer.model import build_model, local_numel, model_blocks
    from trainer.parallelize import build_mesh, parallelize
    from trainer.train import build_parallel_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    spec, _, launch = load_job(str(REPO / "jobs" / "tiny-ddp.toml"), "local", [
        f"model.size={size!r}", "parallel.strategy='fsdp'", f"job.tasks_per_node={world}",
        f"train.global_batch={2 * world}"])
    dist.barrier()
    baseline = status_bytes("VmRSS")
    reset_peak()
    started = time.perf_counter()
    if old:  # the previous trainer: the whole model on the host, initialised, then sharded
        torch.manual_seed(spec.train.seed)
        model = build_model(spec.model, "cpu")
        model = parallelize(model, model_blocks(model), launch_parallel(spec, launch), launch.dims,
                            build_mesh(launch.dims, "cpu"), torch.device("cpu"))
    else:
        model, _ = build_parallel_model(spec, launch, torch.device("cpu"))
    seconds = time.perf_counter() - started
    peak = status_bytes("VmHWM")
    local, total = local_numel(model)
    dist.barrier()
    Path(out, f"{rank}.json").write_text(json.dumps({"baseline": baseline, "peak": peak, "local": local,
                                                     "total": total, "seconds": seconds}))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(size: str, world: int, old: bool) -> list[dict]:
    """Run ``world`` ranks in fresh processes; their records, by rank."""
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(world), str(port), size,
                                   str(int(old)), out], env={**os.environ, "OMP_NUM_THREADS": "1"})
                 for r in range(world)]
        for p in procs:
            if p.wait(timeout=1800) != 0:
                raise SystemExit(f"{size} on {world} ranks: a rank exited {p.returncode}")
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]


def report(size: str, world: int, records: list[dict], label: str) -> None:
    from hpc.core.models.gpt import GPT_PRESETS

    module = 4 * GPT_PRESETS[size].largest_module_params
    for rank, r in enumerate(records):
        full, shard, delta = 4 * r["total"], 4 * r["local"], r["peak"] - r["baseline"]
        print(f"{size:>5} {world} ranks {label:<5} rank {rank}: baseline {r['baseline'] / GB:5.2f} GB, peak "
              f"{r['peak'] / GB:5.2f} GB, init +{delta / GB:5.2f} GB | full {full / GB:5.2f} GB, shard "
              f"{shard / GB:5.2f} GB, module {module / GB:4.2f} GB | init/full {delta / full:4.2f}, "
              f"init/(shard+module) {delta / (shard + module):4.2f} | {r['seconds']:5.1f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="350m,1.3b")
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--old", default="350m", help="presets also measured the previous way (comma-separated)")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    started = time.perf_counter()
    old_sizes = [s for s in args.old.split(",") if s]
    for size in args.sizes.split(","):
        for world in map(int, args.ranks.split(",")):
            new = measure(size, world, old=False)
            report(size, world, new, "meta")
            if size in old_sizes:
                before = measure(size, world, old=True)
                report(size, world, before, "old")
                ratio = max(r["peak"] for r in new) / max(r["peak"] for r in before)
                print(f"{size:>5} {world} ranks: peak RSS meta / old = {ratio:.2f}", flush=True)
    print(f"took {time.perf_counter() - started:.0f} s; load average at end: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank, world, port, size, old, out = sys.argv[2:8]
        worker(int(rank), int(world), int(port), size, old == "1", out)
    else:
        main()

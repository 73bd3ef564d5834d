"""One rank of a torchrun launch that trains several run folders in a row on one process group.

    torchrun --nproc_per_node=N tests/trainer/strategy_worker.py OUT.json RUN_DIR...

Starting one launch per configuration would cost ~5 s of process start-up each on
two shared cores; the configurations here share one. Rank 0 writes
``{run_dir: {"losses": [...], "hsdp": {...}}}`` to OUT.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from trainer.dist import detect_rank_env, init_distributed, shutdown
from trainer.loop import train
from trainer.run import load_run
from trainer.train import build_trainer


def placements_report(model: torch.nn.Module) -> dict:
    """Every parameter is (Replicate(), Shard(0)), and local shards are bitwise equal across dp_replicate."""
    report = {"all_replicate_shard0": True, "equal_across_replicate": True, "local_fraction": 0.0}
    local = total = 0
    for p in model.parameters():
        if not isinstance(p, DTensor) or tuple(p.placements) != (Replicate(), Shard(0)):
            report["all_replicate_shard0"] = False
            continue
        mesh = p.device_mesh
        shard = p.to_local().detach().contiguous()
        gathered = [torch.empty_like(shard) for _ in range(mesh["dp_replicate"].size())]
        dist.all_gather(gathered, shard, group=mesh.get_group("dp_replicate"))
        report["equal_across_replicate"] &= all(torch.equal(g, shard) for g in gathered)
        local, total = local + shard.numel(), total + p.numel()
    report["local_fraction"] = local / max(1, total)
    report["mesh"] = list(model.parameters().__next__().device_mesh.shape) if report["all_replicate_shard0"] else []
    return report


def main(out: str, run_dirs: list[str]) -> None:
    torch.set_num_threads(1)
    env = detect_rank_env()
    init_distributed(env, "gloo", timeout_s=120)
    results = {}
    for run_dir in run_dirs:
        run = load_run(run_dir)
        trainer, state = build_trainer(run, env.rank, torch.device("cpu"))
        summary = train(trainer, state)
        entry = {"losses": summary["losses"]}
        if run.launch.dims.mesh_shape is not None and len(run.launch.dims.mesh_shape) == 2:
            entry["placements"] = placements_report(trainer.model)
        results[run_dir] = entry
    if env.rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    shutdown(60)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    sys.stdout.flush()
    os._exit(0)

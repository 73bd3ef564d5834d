"""One rank of ``checkpoint.init_from`` alone: what it reads and how much memory it takes.

    torchrun --nproc_per_node=N tests/hf/init_worker.py OUT.json RUN_DIR [digests]

The model is built on the meta device and sharded as the trainer does, then allocated without
being touched (``to_empty``: the pages are not resident yet), so the peak RSS growth measured
around ``initial_weights`` is what loading costs: this rank's shard plus the read buffer. Rank 0
writes every rank's ``{bytes_read, source_bytes, rss_growth, shard_bytes}`` to OUT.json; with
``digests``, rank 0's report also holds the SHA-256 of every loaded parameter, gathered whole after
the measurement (``{name: hex}``).
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import sys

import torch
import torch.distributed as dist

from trainer.dist import detect_rank_env, init_distributed, shutdown
from trainer.init_from import initial_weights
from trainer.model import kept_ties, local_numel
from trainer.run import load_run
from trainer.train import build_parallel_model, fit_launch


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def digests(model: torch.nn.Module) -> dict[str, str]:
    """SHA-256 of each parameter's bytes, gathered whole (collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    from trainer.init_from import named_params

    out = {}
    for name, p in named_params(model):
        full = (p.full_tensor() if isinstance(p, DTensor) else p).detach().contiguous()
        out[name] = hashlib.sha256(full.reshape(-1).view(torch.uint8).numpy()).hexdigest()
    return out


def main(out: str, run_dir: str, *flags: str) -> None:
    torch.set_num_threads(1)
    env = detect_rank_env()
    init_distributed(env, "gloo", timeout_s=120)
    run = load_run(run_dir)
    launch = fit_launch(run, env.world_size, env.local_world_size)
    model, _ = build_parallel_model(run.spec, launch, torch.device("cpu"), materialize=False)
    with kept_ties(model):
        model.to_empty(device="cpu")
    before = peak_rss()
    report = initial_weights(model, run.spec)
    report.update(rss_growth=peak_rss() - before, shard_bytes=local_numel(model)[0] * 4, rank=env.rank)
    if "digests" in flags:
        report["digests"] = digests(model)
    reports = [None] * env.world_size
    dist.all_gather_object(reports, report)
    if env.rank == 0:
        with open(out, "w") as f:
            json.dump(reports, f)
    shutdown(60)


if __name__ == "__main__":
    main(*sys.argv[1:])
    sys.stdout.flush()
    os._exit(0)

"""One rank of bench/hf's ``init_from`` measurement (torchrun, gloo): the load alone, timed.

    torchrun --nproc_per_node=N bench/hf/worker.py OUT.json RUN_DIR

The model is built on meta, sharded (FSDP2) and allocated untouched; then ``initial_weights`` loads
it. Rank 0 writes each rank's seconds, VmHWM, bytes read and rchar to OUT.json.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from trainer.dist import detect_rank_env, init_distributed, shutdown
from trainer.init_from import initial_weights
from trainer.model import kept_ties
from trainer.run import load_run
from trainer.train import build_parallel_model, fit_launch


def proc(name: str, key: str) -> int:
    for line in open(f"/proc/self/{name}"):
        if line.startswith(key):
            return int(line.split()[1])
    return 0


def main(out: str, run_dir: str) -> None:
    torch.set_num_threads(1)
    env = detect_rank_env()
    init_distributed(env, "gloo", timeout_s=300)
    run = load_run(run_dir)
    model, _ = build_parallel_model(run.spec, fit_launch(run, env.world_size, env.local_world_size),
                                    torch.device("cpu"), materialize=False)
    with kept_ties(model):
        model.to_empty(device="cpu")
    dist.barrier()
    rchar, tic = proc("io", "rchar"), time.perf_counter()
    report = initial_weights(model, run.spec)
    report.update(seconds=time.perf_counter() - tic, rchar=proc("io", "rchar") - rchar, rank=env.rank,
                  peak_rss=proc("status", "VmHWM") * 1024)
    reports = [None] * env.world_size
    dist.all_gather_object(reports, report)
    if env.rank == 0:
        with open(out, "w") as f:
            json.dump(reports, f)
    shutdown(60)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    os._exit(0)

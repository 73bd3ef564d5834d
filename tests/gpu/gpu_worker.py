"""One rank of a torchrun launch for the GPU tests.

    torchrun --nproc_per_node=N tests/gpu/gpu_worker.py MODE OUT_DIR

``vote``: gloo ranks sharing cuda:0 run a step on the GPU, then the step-boundary vote under
``torch.cuda.set_sync_debug_mode("error")``: any host sync raises. ``timeout``: NCCL ranks on their own
GPUs; after the timeouts are shortened rank 1 stops taking part, rank 0's all-reduce times out and the
flight recorder dumps into OUT_DIR/nccl-trace/.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.dist import CollectiveTimeouts, apply_nccl_trace, detect_rank_env, device_for, init_distributed
from trainer.preemption import BoundaryVote


def vote(out: Path) -> None:
    env = detect_rank_env()
    init_distributed(env, "gloo", 60)
    x = torch.randn(512, 512, device="cuda")
    vote_, agreed = BoundaryVote(), []
    torch.cuda.set_sync_debug_mode("error")
    for boundary in range(6):
        x = x @ x / 512  # the step, queued on the GPU
        agreed.append(vote_.exchange([int(env.rank == 1 and boundary == 2), 0]))
    vote_.close()
    torch.cuda.set_sync_debug_mode("default")
    (out / f"rank-{env.rank}.json").write_text(json.dumps({"agreed": agreed}))


def timeout(out: Path) -> None:
    env = detect_rank_env()
    apply_nccl_trace(out)
    device = device_for("nccl", env.local_rank, env.local_world_size)
    init_distributed(env, "nccl", 60)
    one = torch.ones(1, device=device)
    dist.all_reduce(one)
    timeouts = CollectiveTimeouts(60, 5)
    timeouts.shorten(torch.nn.Linear(2, 2))
    if env.rank == 1:
        time.sleep(120)  # gone quiet: rank 0's next collective must time out in ~5 s, not 60
    dist.all_reduce(one)
    torch.cuda.synchronize()


if __name__ == "__main__":
    {"vote": vote, "timeout": timeout}[sys.argv[1]](Path(sys.argv[2]))
    sys.stdout.flush()
    os._exit(0)

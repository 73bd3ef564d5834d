"""One rank of a torchrun launch that builds several run folders' models the trainer's way and
gathers each full state right after initialisation.

    torchrun --nproc_per_node=N tests/trainer/init_worker.py OUT_DIR RUN_DIR...

Rank 0 writes ``OUT_DIR/<run folder name>.pt``: the full model state dict (CPU tensors, FQN keys),
gathered from the shards with ``get_model_state_dict(full_state_dict=True)``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from trainer.dist import detect_rank_env, init_distributed, shutdown
from trainer.run import load_run
from trainer.train import build_parallel_model


def main(out: str, run_dirs: list[str]) -> None:
    torch.set_num_threads(1)
    env = detect_rank_env()
    init_distributed(env, "gloo", timeout_s=120)
    for run_dir in run_dirs:
        run = load_run(run_dir)
        model, _ = build_parallel_model(run.spec, run.launch, torch.device("cpu"))
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if env.rank == 0:
            torch.save(state, Path(out) / f"{Path(run_dir).name}.pt")
    shutdown(60)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    sys.stdout.flush()
    os._exit(0)

"""One rank of a torchrun launch that trains several run folders in a row, for the tensor-parallel tests.

    torchrun --nproc_per_node=N tests/trainer/tp_worker.py OUT.json RUN_DIR...

Rank 0 writes ``{run_dir: {"losses": [...], "placements": {name: [mesh dims, placements]},
"local_numel": n, "numel": n}}``; every parameter's placements are read off the trained model.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch.distributed.tensor import DTensor

from trainer.dist import detect_rank_env, init_distributed, shutdown
from trainer.loop import train
from trainer.model import local_numel
from trainer.run import load_run
from trainer.train import build_trainer


def placements(model: torch.nn.Module) -> dict[str, list]:
    out = {}
    for name, p in model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")
        out[name] = [list(p.device_mesh.mesh_dim_names), [str(x) for x in p.placements]] \
            if isinstance(p, DTensor) else None
    return out


def main(out: str, run_dirs: list[str]) -> None:
    torch.set_num_threads(1)
    env = detect_rank_env()
    init_distributed(env, "gloo", timeout_s=120)
    results = {}
    for run_dir in run_dirs:
        trainer, state = build_trainer(load_run(run_dir), env.rank, torch.device("cpu"))
        summary = train(trainer, state)
        local, total = local_numel(trainer.model)
        results[run_dir] = {"losses": summary["losses"], "placements": placements(trainer.model),
                            "local_numel": local, "numel": total}
    if env.rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    shutdown(60)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    sys.stdout.flush()
    os._exit(0)

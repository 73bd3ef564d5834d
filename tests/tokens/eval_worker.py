"""One rank of a torchrun launch that evaluates one fixed model on a prepared folder's val split.

    torchrun --nproc_per_node=N tests/tokens/eval_worker.py DATA_DIR OUT_JSON [EVAL_STEPS]

The model is the tiny GPT (vocabulary 640) built with the same seed on every rank; rank 0 writes the
eval record. At any N the record must be the same (``trainer.evaluate``).
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from hpc.core.spec import Model
from trainer.dist import detect_rank_env, init_distributed
from trainer.evaluate import build_evaluator, evaluate
from trainer.model import build_model
from trainer.tasks.lm import token_task
from trainer.tokens import ManifestTokens


def main(data_dir: str, out: str, steps: str = "3") -> None:
    torch.set_num_threads(1)
    env = detect_rank_env()
    if env.world_size > 1:
        init_distributed(env, "gloo", timeout_s=120)
    torch.manual_seed(0)
    model = build_model(Model(size="tiny", vocab_size=640), "cpu")
    dataset = ManifestTokens(data_dir, "val", 64)
    ev = build_evaluator(dataset, 4, 1, env.rank, env.world_size, every=1, steps=int(steps))
    ev.task = token_task()
    t = SimpleNamespace(model=model, device=torch.device("cpu"), amp_dtype=None, world_size=env.world_size,
                        dims=SimpleNamespace(tp=1))
    record = evaluate(t, ev, 0)
    if env.rank == 0:
        with open(out, "w") as f:
            json.dump(record, f)
    if env.world_size > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip native teardown, where gloo sometimes aborts (as trainer/__main__.py does)

"""One rank of a checkpoint test (launched by ckpt_helpers.launch).

    dist_worker.py save RUN_DIR ASYNC_RUN_DIR OUT.json   # fsdp: 2 steps, sync + async save of step 2, 2 more steps
    dist_worker.py load STRATEGY CHECKPOINT OUT.json     # any strategy: load, the same 2 steps
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_helpers import build, init_from_env, train_step  # noqa: E402

from trainer.checkpoint import Checkpointer, load_checkpoint  # noqa: E402


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save(run_dir: str, async_dir: str, out: str) -> None:
    model, optimizer, scheduler = build("fsdp")
    losses = [train_step(model, optimizer, scheduler, s) for s in range(2)]
    train_state = {"step": 2, "tokens_seen": 2 * 64, "sampler": {"consumed_samples": 8, "epoch": 0}}
    sync_saves, async_saves = Checkpointer(run_dir), Checkpointer(async_dir, async_save=True)
    sync_saves.save(2, model, optimizer, scheduler, train_state)
    async_saves.save(2, model, optimizer, scheduler, train_state)
    losses.append(train_step(model, optimizer, scheduler, 2))  # mutates parameters while the async save runs
    sync_saves.wait()
    async_saves.wait()
    losses.append(train_step(model, optimizer, scheduler, 3))
    if rank() == 0:
        Path(out).write_text(json.dumps({"losses": losses}))


def load(strategy: str, checkpoint: str, out: str) -> None:
    model, optimizer, scheduler = build(strategy, seed=1)  # another init: everything must come from the file
    state = load_checkpoint(checkpoint, model, optimizer, scheduler)
    losses = [train_step(model, optimizer, scheduler, s) for s in (2, 3)]
    if rank() == 0:
        Path(out).write_text(json.dumps({"losses": losses, "step": state["step"], "sampler": state["sampler"],
                                         "meta": state["meta"], "rng_restored": state["rng_restored"]}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    init_from_env()
    {"save": save, "load": load}[sys.argv[1]](*sys.argv[2:])
    if dist.is_initialized():
        dist.barrier()  # no rank tears down while a peer still has gloo work in flight
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Work done and flushed: skip native teardown, where gloo sometimes aborts ("terminate called without
    # an active exception", exit -6), as the trainer does (trainer/__main__.py, trainer.task).
    os._exit(0)

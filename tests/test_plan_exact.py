"""The planner's model-state bytes equal what the trainer really holds per rank after one step.

For the tiny and the small built-in GPT, under ddp, fsdp (each sharding) and hsdp, on 2 and 4
CPU ranks (gloo): the sum of each rank's local parameter, gradient and AdamW moment tensors
after one optimizer step is within 1% of ``hpc.plan.memory.model_states``. Uses the trainer's own
``build_model``, ``parallelize`` and ``build_optimizer``. One process group per world size
runs every case, to stay well under a minute on two cores.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpc.plan.memory import Config, model_states
from hpc.core.models.gpt import gpt_shape
from hpc.core.dims import ParallelDims, parallel_dims
from hpc.core.resolve import decide_parallel
from hpc.core.spec import spec_from_dict

pytestmark = pytest.mark.slow

# (strategy, sharding, mixed precision)
CASES = [("ddp", "full_shard", "none"), ("fsdp", "full_shard", "bf16"), ("fsdp", "shard_grad_op", "none"),
         ("fsdp", "no_shard", "none"), ("hsdp", "full_shard", "bf16")]
SIZES = ("tiny", "small")


def _dims(strategy: str, sharding: str, world: int) -> ParallelDims:
    return parallel_dims(strategy, sharding, world, tasks_per_node=world // 2 if strategy == "hsdp" else world)


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def _measure(size: str, strategy: str, sharding: str, precision: str, world: int) -> tuple[int, int, int]:
    from trainer.model import WeightInit, build_model, model_blocks
    from trainer.optim import build_optimizer
    from trainer.parallelize import build_mesh, parallelize

    spec = spec_from_dict({"model": {"size": size}, "parallel": {"strategy": strategy, "sharding": sharding,
                                                                 "mixed_precision": precision}})
    model = build_model(spec.model, "meta")
    dims = _dims(strategy, sharding, world)
    parallel = decide_parallel(spec.parallel, False)  # `auto` on a CPU site: fp32
    model = parallelize(model, model_blocks(model), parallel, dims, build_mesh(dims, "cpu"), torch.device("cpu"),
                        WeightInit.of(model, 0))
    optimizer = build_optimizer(model, spec.train)
    shape = gpt_shape(size)
    tokens = torch.randint(0, shape.vocab_size, (1, shape.seq_len))
    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
    optimizer.step()
    params = list(model.parameters())
    moments = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    return _local_bytes(params), _local_bytes(p.grad for p in params if p.grad is not None), _local_bytes(moments)


def _worker(rank: int, world: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for size in SIZES:
            for strategy, sharding, precision in CASES:
                measured = _measure(size, strategy, sharding, precision, world)
                queue.put((rank, size, strategy, sharding, precision, measured))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 4])
def test_model_states_match_the_trainer(world):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=180) for _ in range(world * len(SIZES) * len(CASES))]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank, size, strategy, sharding, precision, measured in results:
        cfg = Config(_dims(strategy, sharding, world), False, precision, False, 1)
        predicted = model_states(gpt_shape(size).n_params, cfg)
        for what, want, got in zip(("params", "grads", "optimizer"), predicted, measured):
            assert got == pytest.approx(want, rel=0.01), \
                f"{size} {strategy} {sharding} {precision} rank {rank}/{world}: {what} predicted {want} B, measured {got} B"


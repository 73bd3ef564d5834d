"""`parallel.reshard_after_forward` (issue 45): the trainer applies it and the planner charges it.

Two real gloo ranks build the tiny Llama with the trainer's own ``parallelize`` (fsdp full_shard) and run
three gradient-accumulation micro-batches through ``trainer.loop.micro_step_context``, as ``train_step``
does. With the key false every block's parameters are plain (unsharded) tensors after the first forward and
stay so across the micro-batches, until the last backward reshards them (DTensors again); the all-gathers
then run once per step (the first forward) where full_shard runs them in every forward and backward. The
measured all-gather bytes equal the plan's, both ways. The planner's side: memory up by the whole compute copy,
all-gathers down by the accumulation, on 8B over 8 H100s; and the key is refused where nothing is sharded.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpc.core.dims import parallel_dims
from hpc.core.models import model_facts
from hpc.core.resolve import cross_check, decide_parallel
from hpc.core.site import load_site
from hpc.core.spec import spec_from_dict
from hpc.plan.comm import step_comm
from hpc.plan.memory import GB, Config, estimate
from tests.test_plan_comm_exact import Counted
from tests.test_plan_exact import _free_port

WORLD, MICRO = 2, 3
MODEL = {"arch": "llama", "size": "tiny"}


def _spec(keep: bool, strategy: str = "fsdp", sharding: str = "full_shard"):
    return spec_from_dict({"model": MODEL, "parallel": {"strategy": strategy, "sharding": sharding,
                                                        "mixed_precision": "none", "reshard_after_forward": not keep}})


def _sharded(model: torch.nn.Module) -> list[bool]:
    from torch.distributed.tensor import DTensor
    from trainer.model import model_blocks

    return [isinstance(next(block.parameters()), DTensor) for block in model_blocks(model)]


def _run(keep: bool) -> dict:
    from trainer.loop import micro_step_context
    from trainer.model import WeightInit, build_model, model_blocks
    from trainer.parallelize import build_mesh, parallelize

    spec = _spec(keep)
    model = build_model(spec.model, "meta")
    dims = parallel_dims("fsdp", "full_shard", WORLD)
    model = parallelize(model, model_blocks(model), decide_parallel(spec.parallel, False), dims,
                        build_mesh(dims, "cpu"), torch.device("cpu"), WeightInit.of(model, 0))
    seen: dict = {"after_forward": [], "after_backward": []}
    counted = Counted()
    with counted:
        for i in range(MICRO):
            tokens = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(i))
            with micro_step_context(model, sync=i == MICRO - 1, keep_gathered=keep):
                logits = model(tokens)
                seen["after_forward"].append(_sharded(model))
                torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
                seen["after_backward"].append(_sharded(model))
    seen["all_gather"] = counted.bytes["all_gather"]
    return seen


def _worker(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        queue.put((rank, {keep: _run(keep) for keep in (True, False)}))
    except Exception as exc:  # noqa: BLE001  (said in the test at once, not after the queue's timeout)
        queue.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def measured() -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=300) for _ in range(WORLD)]
    assert all(isinstance(r, dict) for _, r in results), results
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0][1] == results[1][1]
    return results[0][1]


def test_kept_gathered_blocks_stay_unsharded_across_micro_batches(measured):
    kept = measured[True]
    assert all(not any(s) for s in kept["after_forward"])  # every block gathered after each forward
    assert all(not any(s) for s in kept["after_backward"][:-1])  # and still after the inner backwards
    assert all(kept["after_backward"][-1])  # the last backward reshards


def test_full_shard_reshards_after_every_forward_and_backward(measured):
    plain = measured[False]
    assert all(all(s) for s in plain["after_forward"]) and all(all(s) for s in plain["after_backward"])


def _planned_all_gather(keep: bool) -> float:
    spec = _spec(keep)
    cfg = Config(parallel_dims("fsdp", "full_shard", WORLD), False, "none", False, 1, grad_accum=MICRO,
                 reshard_after_forward=not keep)
    comm = step_comm(model_facts(spec.model), cfg, load_site("dgx-h100"), 1, WORLD, MICRO)
    # an all-gather's message is its full (gathered) size; the trainer's all_gather_into_tensor output is the same
    return sum(p.message_gb * GB * p.repeat for p in comm.parts if p.kind == "all_gather")


@pytest.mark.parametrize("keep", [True, False])
def test_the_measured_all_gathers_are_the_plans(measured, keep):
    assert measured[keep]["all_gather"] == pytest.approx(_planned_all_gather(keep), rel=0.01)


def test_keeping_them_gathers_once_per_step_instead_of_in_every_micro_batch(measured):
    # full_shard: every micro-batch's forward gathers all units and its backward all but norm + head; kept: the
    # first forward only. So more than MICRO times the bytes.
    assert measured[False]["all_gather"] > MICRO * measured[True]["all_gather"] > 0


# ---------------------------------------------------------------- the planner at scale, by hand

def _facts_8b():
    return model_facts(spec_from_dict({"model": {"arch": "llama", "size": "llama3-8b", "seq_len": 4096}}).model)


def test_the_plan_charges_memory_up_and_all_gathers_down_with_accumulation():
    """Llama 3 8B (8.03e9 parameters) over fsdp full_shard on 8 H100s, 16 micro-batches per step, bf16.
    Kept gathered: the whole bf16 compute copy, 8.03e9 × 2 B = 16.1 GB, sits in the buffers instead of the root and
    two blocks; the forward all-gather runs once per step instead of 16 times, and the backward one never:
    bytes sent = 7/8 × 16.1 GB once, against 16 × (7/8 × 16.1 + 7/8 × (16.1 − the kept norm + head)) GB."""
    f, site, accum = _facts_8b(), load_site("dgx-h100"), 16
    dims = parallel_dims("fsdp", "full_shard", 8)
    plain = Config(dims, False, "bf16", True, 1, grad_accum=accum)
    kept = Config(dims, False, "bf16", True, 1, grad_accum=accum, reshard_after_forward=False)
    m_plain, m_kept = estimate(f, plain, 8), estimate(f, kept, 8)
    n = f.n_params
    assert m_kept.buffers - m_plain.buffers > 0.8 * n * 2 / GB  # memory up, by most of the 16.1 GB compute copy
    assert m_kept.buffers == pytest.approx(n * 2 / GB + (m_plain.buffers - (f.root_params * 2 + 2 * f.unit_params * 2) / GB),
                                           rel=1e-6)
    c_plain, c_kept = step_comm(f, plain, site, 1, 8, accum), step_comm(f, kept, site, 1, 8, accum)
    gather = {c: sum(p.gb for p in comm.parts if p.kind == "all_gather") for c, comm in (("plain", c_plain), ("kept", c_kept))}
    assert gather["kept"] == pytest.approx(7 / 8 * n * 2 / GB, rel=0.01)  # one forward all-gather per step
    assert gather["plain"] > accum * gather["kept"]  # 16 forward ones, and 16 backward ones on top
    reduce = {c: sum(p.gb for p in comm.parts if p.kind == "reduce_scatter") for c, comm in (("p", c_plain), ("k", c_kept))}
    assert reduce["p"] == pytest.approx(reduce["k"])  # the gradients still reduce-scatter every micro-batch


@pytest.mark.parametrize("strategy,sharding", [("ddp", "full_shard"), ("none", "full_shard"), ("fsdp", "no_shard")])
def test_the_key_is_refused_where_nothing_is_sharded(strategy, sharding):
    spec = spec_from_dict({"model": MODEL, "parallel": {"strategy": strategy, "sharding": sharding,
                                                        "reshard_after_forward": False}})
    errors = cross_check(spec, load_site("local"))
    assert any("`parallel.reshard_after_forward` = false" in e for e in errors), errors

"""The planner's gradient and parameter collectives equal, byte for byte of message, what the trainer's
DDP and FSDP2 really call, with and without LoRA.

Classes of defect:

- the plan all-reduces (DDP) or reduce-scatters (FSDP, HSDP) gradients of frozen weights: under LoRA
  only the trained share (adapters and ``lora.trainable``) has gradients, and DDP's buckets and
  FSDP2's reduces carry only those;
- the plan's all-gathers miss the frozen weights (FSDP2 gathers every parameter, trained or not);
- the full fine-tune's figures move (the same counts without ``[lora]``).

Four CPU ranks (gloo) build the tiny Llama (and the tiny GPT) with the trainer's own ``build_model``,
``apply_lora`` and ``parallelize``, run one forward and backward, and count the messages of every
collective: DDP through a comm hook (the buckets it all-reduces), FSDP2 by wrapping
``torch.distributed``'s collectives it calls. One process group runs every case.
"""

from __future__ import annotations

import collections
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpc.core.dims import parallel_dims
from hpc.core.lora import with_lora
from hpc.core.models import model_facts
from hpc.core.resolve import decide_parallel
from hpc.core.site import load_site
from hpc.core.spec import spec_from_dict
from hpc.plan.comm import step_comm
from hpc.plan.memory import GB, Config
from tests.test_plan_exact import _free_port

pytestmark = pytest.mark.slow

WORLD = 4
LORA = {"rank": 4, "alpha": 8.0, "targets": ["wq", "wv", "w2"]}
# (model, lora, strategy, sharding)
CASES = [
    ({"arch": "llama", "size": "tiny"}, LORA, "ddp", "full_shard"),
    ({"arch": "llama", "size": "tiny"}, LORA, "fsdp", "full_shard"),
    ({"arch": "llama", "size": "tiny"}, LORA, "fsdp", "shard_grad_op"),
    ({"arch": "llama", "size": "tiny"}, LORA, "hsdp", "full_shard"),
    ({"arch": "llama", "size": "tiny"}, {**LORA, "trainable": ["*norm*"]}, "fsdp", "full_shard"),
    ({"arch": "llama", "size": "tiny"}, {**LORA, "targets": []}, "ddp", "full_shard"),  # every projection
    ({"arch": "gpt", "size": "tiny"}, {"rank": 2, "targets": ["qkv", "fc"]}, "fsdp", "full_shard"),
    ({"arch": "gpt", "size": "tiny"}, {"rank": 2, "targets": ["qkv", "fc"]}, "ddp", "full_shard"),
    ({"arch": "llama", "size": "tiny"}, {}, "ddp", "full_shard"),  # the full fine-tune, as before
    ({"arch": "llama", "size": "tiny"}, {}, "fsdp", "full_shard"),
    ({"arch": "llama", "size": "tiny"}, {}, "hsdp", "full_shard"),
]


def _spec(model: dict, lora: dict, strategy: str, sharding: str):
    parallel = {"strategy": strategy, "sharding": sharding, "mixed_precision": "none"}
    if strategy == "hsdp":
        parallel["shard_size"] = 2
    return spec_from_dict({"model": model, "parallel": parallel, **({"lora": lora} if lora else {})})


def _dims(strategy: str, sharding: str):
    return parallel_dims(strategy, sharding, WORLD, tasks_per_node=WORLD, shard_size=2 if strategy == "hsdp" else 0)


class Counted:
    """Message bytes by collective kind: a reduce-scatter's input, an all-gather's output, an all-reduce's tensor."""

    def __init__(self) -> None:
        self.bytes: collections.Counter[str] = collections.Counter()
        self.saved: dict[str, object] = {}

    def __enter__(self) -> "Counted":
        def wrap(name: str, kind: str, pick):
            real = getattr(dist, name)
            self.saved[name] = real

            def counted(*args, **kwargs):
                t = pick(args, kwargs)
                self.bytes[kind] += sum(x.numel() * x.element_size() for x in (t if isinstance(t, list) else [t]))
                return real(*args, **kwargs)

            setattr(dist, name, counted)

        for name in ("reduce_scatter_tensor", "reduce_scatter_single"):  # torch < 2.12, and since
            if hasattr(dist, name):
                wrap(name, "reduce_scatter", lambda a, k: k.get("input", a[1] if len(a) > 1 else None))
        for name in ("all_gather_into_tensor", "all_gather_single"):
            if hasattr(dist, name):
                wrap(name, "all_gather", lambda a, k: k.get("output_tensor", a[0] if a else None))
        wrap("all_reduce", "all_reduce", lambda a, k: k.get("tensor", a[0] if a else None))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, real in self.saved.items():
            setattr(dist, name, real)


def _measure(model_: dict, lora: dict, strategy: str, sharding: str) -> dict[str, int]:
    from trainer.lora import apply_lora
    from trainer.model import WeightInit, build_model, model_blocks
    from trainer.parallelize import build_mesh, parallelize

    spec = _spec(model_, lora, strategy, sharding)
    model = apply_lora(build_model(spec.model, "meta"), spec)
    dims = _dims(strategy, sharding)
    model = parallelize(model, model_blocks(model), decide_parallel(spec.parallel, False), dims,
                        build_mesh(dims, "cpu"), torch.device("cpu"), WeightInit.of(model, 0))
    counted = Counted()
    if strategy == "ddp":  # its buckets go through dist.all_reduce, counted (the C++ reducer's own call is not)
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        model.register_comm_hook(None, allreduce_hook)
    tokens = torch.randint(0, 64, (1, 16))
    with counted:
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
    return dict(counted.bytes)


def _worker(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        for i, case in enumerate(CASES):
            queue.put((rank, i, _measure(*case)))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def measured() -> dict[int, dict[str, int]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=300) for _ in range(WORLD * len(CASES))]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    by_case: dict[int, dict[str, int]] = {}
    for rank, i, got in results:
        assert by_case.setdefault(i, got) == got, f"case {i}: rank {rank} differs"
    return by_case


def planned(model_: dict, lora: dict, strategy: str, sharding: str) -> dict[str, float]:
    """Message bytes by kind of one micro-batch's collectives (full, unsharded sizes), as the plan has them."""
    spec = _spec(model_, lora, strategy, sharding)
    facts = with_lora(model_facts(spec.model), spec)
    comm = step_comm(facts, Config(_dims(strategy, sharding), False, "none", False, 1), load_site("dgx-h100"),
                     1, WORLD, grad_accum=1)
    assert comm is not None
    out: collections.Counter[str] = collections.Counter()
    for part in comm.parts:
        out[part.kind] += part.message_gb * GB  # HSDP's replica all-reduce: of the gradient shard
    return dict(out)


@pytest.mark.parametrize("case", range(len(CASES)), ids=lambda i: "-".join(
    [CASES[i][0]["arch"], "lora" if CASES[i][1] else "full", CASES[i][2], CASES[i][3]]))
def test_the_plans_collective_messages_are_the_trainers(measured, case):
    model_, lora, strategy, sharding = CASES[case]
    want, got = planned(*CASES[case]), measured[case]
    assert set(want) == set(got), (want, got)
    for kind in got:
        assert got[kind] == pytest.approx(want[kind], rel=0.01), f"{kind}: planned {want[kind]:.0f} B, measured {got[kind]} B"
    if lora:
        spec = _spec(model_, lora, strategy, sharding)
        facts = with_lora(model_facts(spec.model), spec)
        assert facts.trainable_params < facts.n_params / 2  # the case is one where the shares differ

"""Why nothing fits (issue 34 item 6): the per-rank floor against the GPU and each lever with its
number, and the advice trying every micro batch that keeps the global batch."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from hpc.core.models import model_facts
from hpc.plan import plan_job
from hpc.plan.advice import search, smaller_micro_batches
from hpc.plan.floor import floor_of
from hpc.plan.rows import setup_of
from tests.test_plan import site, spec
from tests.test_plan_tp import DGX, llama

GPU24 = dict(gpus=8, mem=24, link="nvswitch", intra=450)


def why(plan) -> str:
    return next(a for a in plan.advice if a.startswith("Why: the per-rank floor"))


def levers(plan) -> dict[str, float]:
    line = next((a for a in plan.advice if a.startswith("Levers on the floor: ")), "")
    return {k: float(v) for k, v in re.findall(r"([a-z_.]+ = \w+): ([\d.]+) GB", line)}


@pytest.mark.parametrize("args,expected", [
    (dict(size="llama3.1-405b", nodes=128, seq=8192, micro=4, global_batch=4096, strategy="fsdp"),
     {"parallel.tp = 4", "parallel.tp = 8"}),
    (dict(size="llama3-8b", nodes=1, seq=8192, micro=4, global_batch=64, ac=False, strategy="fsdp"),
     {"parallel.tp = 8", "train.micro_batch = 1", "parallel.activation_checkpointing = true"}),
    (dict(size="llama3.1-70b", nodes=16, seq=65536, micro=1, global_batch=128, strategy="hsdp"), set()),
])
def test_the_floor_is_said_with_its_terms_and_each_lever(args, expected):
    plan = plan_job(llama(**args), DGX)
    assert plan.choice is None
    s = llama(**args)
    floor = floor_of(model_facts(s.model), setup_of(s, DGX, None), DGX)
    line = why(plan)
    assert f"gathered units {floor.buffers:.1f} GB" in line and f"micro-batch {floor.activations:.1f} GB" in line
    assert f"is {floor.need:.1f} GB against 80.0 GB per GPU; more nodes cannot lower it" in line
    moves = levers(plan)
    fits = {k for k, v in moves.items() if v <= 80}
    assert expected <= fits, moves
    assert all(v < floor.need for v in moves.values())  # every lever named lowers the floor
    assert "model.seq_len = " + str(s.model.seq_len // 2) in moves


@pytest.mark.parametrize("nodes", [16, 128, 1024])
def test_the_floor_does_not_shrink_with_more_ranks(nodes):
    s = llama("llama3.1-405b", 128, 8192, 1, 1024)
    f = model_facts(s.model)
    base = floor_of(f, setup_of(s, DGX, None), DGX)
    more = floor_of(f, replace(setup_of(s, DGX, None), nodes=nodes), DGX)
    assert more.need == pytest.approx(base.need, rel=1e-3)


def test_model_states_not_the_floor_are_said_when_the_floor_fits():
    plan = plan_job(spec("70b", nodes=4, global_batch=64), site(gpus=4, mem=24, link="pcie", intra=25,
                                                                   fabric="ethernet", net=3, host=256))
    assert "below it, so the model states are what does not fit" in why(plan)
    assert not levers(plan)


def test_gpt_without_checkpointing_names_checkpointing_and_a_shorter_sequence():
    plan = plan_job(spec("13b", global_batch=64, ac=False, micro=2), site(**GPU24))
    moves = levers(plan)
    assert {"parallel.activation_checkpointing = true", "train.micro_batch = 1", "model.seq_len = 1024"} <= set(moves)
    assert "parallel.tp" not in " ".join(moves)  # the GPT family has no TP plan


# ---------------------------------------------------------------- the micro batches that keep the global batch


@pytest.mark.parametrize("micro,batch,nodes,expected", [(8, 64, 1, [4, 2, 1]), (8, 128, 2, [4, 2, 1]),
                                                        (6, 48, 1, [3, 2, 1]), (4, 32, 2, [2, 1]),
                                                        (8, 8 * 8 * 3, 1, [6, 4, 3, 2, 1]), (3, 24, 1, [1])])
def test_smaller_micro_batches_keep_the_global_batch(micro, batch, nodes, expected):
    s = setup_of(spec("tiny", nodes=nodes, global_batch=batch, micro=micro), site(**GPU24), None)
    got = smaller_micro_batches(s, nodes)
    assert got == expected
    for m in got[:-1]:
        assert batch % (nodes * 8 * m) == 0


def test_the_advice_tries_them_and_names_the_one_that_fits():
    """Llama 3 8B at micro batch 8 without checkpointing: micro batch 4 and 2 are tried, with accumulation."""
    s = llama("llama3-8b", 1, 2048, 8, 64, ac=False, strategy="fsdp")
    tried = search(model_facts(s.model), setup_of(s, DGX, None), DGX, False)
    knobs = {c.knobs for c in tried}
    assert ("train.micro_batch = 4",) in knobs and ("train.micro_batch = 2",) in knobs
    plan = plan_job(s, DGX)
    text = "\n".join(plan.advice)
    assert "with train.micro_batch = 2" in text and "with train.micro_batch = 4" in text
    fitting = [c for c in tried if c.row is not None and len(c.knobs) == 1 and "micro_batch" in c.knobs[0]]
    assert fitting and max(c.setup.micro_batch for c in fitting) == 2, text  # micro batch 2 fits, not only 1
    assert re.search(r"with train.micro_batch = 2: \S+ \S+ fits", text), text

"""Tensor parallelism in the planner (issue 34 item 5) and the memory margin of the tie rule (item 6).

Classes: each rank's TP slice of every tensor, FSDP-sharded (by hand, several models and degrees);
activations split as sequence parallelism splits them; the TP collectives per block inside the node;
the tp degrees a site and a model allow; `auto` taking the smallest tp that fits with margin (405B and
70B at several micro batches, node counts and sequence lengths) and no tp where tp 1 fits; an explicit
tp kept; the margin first in the tie-break (13B on 2x8 A100-40GB and others).
"""

from __future__ import annotations

import math

import pytest

from hpc.core.dims import parallel_dims
from hpc.core.models import model_facts
from hpc.core.models.llama import LLAMA_PRESETS, llama_activations
from hpc.core.site import load_site
from hpc.core.spec import spec_from_dict
from hpc.plan import choose, format_plan, plan_job
from hpc.plan.comm import step_comm, tp_calls
from hpc.plan.memory import Config, estimate, rank_numel, tp_shapes
from hpc.plan.rows import MARGIN, roomy, tp_degrees
from tests.test_plan import site, spec

DGX = load_site("dgx-h100")


def llama(size: str, nodes: int = 1, seq: int = 0, micro: int = 1, global_batch: int = 0, ac: bool = True,
          strategy: str = "auto", **model):
    world = nodes * 8
    return spec_from_dict({"job": {"nodes": nodes},
                           "model": {"arch": "llama", "size": size, **({"seq_len": seq} if seq else {}), **model},
                           "train": {"global_batch": global_batch or world * micro, "micro_batch": micro},
                           "parallel": {"strategy": strategy, "activation_checkpointing": ac}})


def facts(size: str, **model):
    return model_facts(llama(size, **model).model)


# ---------------------------------------------------------------- model states per rank


@pytest.mark.parametrize("size,tp,shard", [("llama3-8b", 2, 4), ("llama3.1-70b", 8, 32), ("llama3.1-405b", 8, 128),
                                           ("small", 2, 2), ("tiny", 2, 3)])
def test_each_rank_stores_its_tp_slice_of_every_tensor_fsdp_sharded(size, tp, shard):
    s, f = LLAMA_PRESETS[size], facts(size)
    d, kv, ff, v = s.d_model, s.kv_dim, s.ffn_dim, s.vocab_size
    c = math.ceil
    block = (c(d / shard) + c(d / tp / shard) * d + 2 * c(kv / tp / shard) * d + c(d / shard) * (d // tp)
             + c(d / shard) + 2 * c(ff / tp / shard) * d + c(d / shard) * c(ff / tp))
    by_hand = c(v / tp / shard) * d + s.n_layers * block + c(d / shard) + (0 if s.tied else c(v / tp / shard) * d)
    assert rank_numel(f, parallel_dims("fsdp", "full_shard", shard * tp, 8, tp=tp)) == by_hand
    cfg = Config(parallel_dims("fsdp", "full_shard", shard * tp, 8, tp=tp), False, "bf16", True, 1, grad_accum=2)
    m = estimate(f, cfg, 8)
    assert m.params * 1e9 == pytest.approx(4 * by_hand) and m.optimizer * 1e9 == pytest.approx(8 * by_hand)


def test_tp_1_is_the_plain_fsdp_shard():
    f = facts("llama3-8b")
    assert rank_numel(f, parallel_dims("fsdp", "full_shard", 16)) == sum(
        math.ceil(sh[0] / 16) * math.prod(sh[1:]) for sh in f.param_shapes)


def test_tp_splits_rows_and_columns_and_replicates_norms():
    assert tp_shapes([(10, 4), (4, 10), (4,)], [0, 1, -1], 4) == [(3, 4), (4, 3), (4,)]
    assert tp_shapes([(10, 4)], [0], 1) == [(10, 4)]


def test_gathered_buffers_shrink_by_tp():
    f = facts("llama3.1-70b")
    one = estimate(f, Config(parallel_dims("fsdp", "full_shard", 256), False, "bf16", True, 1), 8)
    eight = estimate(f, Config(parallel_dims("fsdp", "full_shard", 256, 8, tp=8), False, "bf16", True, 1), 8)
    assert eight.buffers == pytest.approx(one.buffers / 8)


# ---------------------------------------------------------------- activations (sequence parallelism)


@pytest.mark.parametrize("size,seq,micro", [("llama3.1-405b", 8192, 1), ("llama3.1-70b", 32768, 1),
                                            ("llama3-8b", 8192, 4)])
def test_checkpointed_block_inputs_and_logits_split_by_tp(size, seq, micro):
    from dataclasses import replace

    s = replace(LLAMA_PRESETS[size], seq_len=seq)
    tokens = micro * seq
    one = llama_activations(s, micro, True, "bf16")
    for t in (2, 4, 8):
        at = llama_activations(s, micro, True, "bf16", tp=t)
        # everything but the gathered inputs of the column-wise layers (q/k/v, gate/up, head) divides by tp
        whole = tokens * (2 * s.d_model * 2) + tokens * s.d_model * 2 + tokens * 16 + 2 * seq * s.head_dim * 2
        log_probs = tokens * s.vocab_size * 4 / t  # loss parallel keeps the rank's fp32 log-softmax share
        assert at.held < one.held / t + whole + log_probs + 1
        assert at.held > one.held / t
        kept = s.n_layers * tokens * s.d_model * 2 / t
        assert at.held >= kept


def test_tp_1_activations_are_unchanged():
    s = LLAMA_PRESETS["llama3-8b"]
    assert llama_activations(s, 2, True, "bf16", tp=1) == llama_activations(s, 2, True, "bf16")


# ---------------------------------------------------------------- the TP collectives


@pytest.mark.parametrize("size,tp,ac", [("llama3.1-405b", 8, True), ("llama3.1-70b", 4, False),
                                        ("llama3-8b", 2, True)])
def test_tp_collectives_per_block_inside_one_node_never_hidden(size, tp, ac):
    f = facts(size)
    cfg = Config(parallel_dims("fsdp", "full_shard", 64, 8, tp=tp), False, "bf16", ac, 1)
    comm = step_comm(f, cfg, DGX, 8, 8, 3)
    parts = [p for p in comm.parts if p.what.startswith("tp ")]
    calls = tp_calls(f, ac)
    assert calls[("forward", "all_gather")] == 2 * f.n_units + 1
    assert calls[("backward", "all_gather")] == 2 * f.n_units + 1 + (2 * f.n_units if ac else 0)
    assert len(parts) == 4 and all(p.group == tp and p.nodes == 1 and p.link == "nvswitch" for p in parts)
    message = f.seq_len * f.shape.d_model * 2
    for p in parts:
        phase, kind = p.phase, p.kind
        assert p.calls == calls[(phase, kind)] and p.repeat == 3
        assert p.gb == pytest.approx(3 * p.calls * message * (tp - 1) / tp / 1e9)
        assert p.unhidden_s == pytest.approx(p.seconds / 3)  # on the critical path
    fsdp = [p for p in comm.parts if p.kind == "all_gather" and not p.what.startswith("tp ")]
    assert all(p.group == 64 // tp for p in fsdp)
    assert fsdp[0].message_gb == pytest.approx(f.n_params * 2 / tp / 1e9)


def test_no_tp_collectives_at_tp_1():
    comm = step_comm(facts("llama3-8b"), Config(parallel_dims("fsdp", "full_shard", 8), False, "bf16", True, 1),
                     DGX, 1, 8, 1)
    assert not [p for p in comm.parts if p.what.startswith("tp ")]


# ---------------------------------------------------------------- which degrees


def test_tp_degrees_divide_the_nvlink_domain_and_the_heads():
    assert tp_degrees(facts("llama3.1-405b"), DGX, 8) == [1, 2, 4, 8]
    assert tp_degrees(facts("llama3-8b", n_heads=12, n_kv_heads=6, dim=768), DGX, 8) == [1, 2]
    assert tp_degrees(facts("llama3-8b", n_heads=24, n_kv_heads=3, dim=3072), DGX, 8) == [1]
    assert tp_degrees(facts("llama3.1-405b"), load_site("pcie-4gpu"), 4) == [1]  # no NVLink domain
    assert tp_degrees(facts("llama3.1-405b"), site(gpus=4, mem=80, link="nvlink", intra=100), 4) == [1, 2, 4]
    gpt = model_facts(spec("13b").model)
    assert tp_degrees(gpt, DGX, 8) == [1]  # a family without a TP plan


# ---------------------------------------------------------------- auto picks tp


@pytest.mark.parametrize("size,nodes,seq,micro,batch,expected", [
    ("llama3.1-405b", 128, 8192, 4, 4096, 8),  # the issue's: 405B, seq 8192, AC, 128 DGX-H100 nodes
    ("llama3.1-405b", 128, 8192, 2, 2048, 4),  # tp 8 fits too, but 5.2 % slower (13.0 s of tp collectives)
    ("llama3.1-405b", 128, 8192, 1, 1024, 2),  # 73.6 s; tp 4 (36 GB) is 2.8 % slower: beyond the 1 % tie
    ("llama3.1-405b", 256, 8192, 4, 8192, 8),
    ("llama3.1-70b", 32, 32768, 1, 256, 4),
    ("llama3.1-70b", 32, 8192, 4, 1024, 4),
])
def test_auto_takes_the_fastest_tp_that_fits_with_margin(size, nodes, seq, micro, batch, expected):
    """Every allowed degree is planned; the fastest pick that fits with the margin wins, a tie (1 %) to less memory."""
    plan = plan_job(llama(size, nodes, seq, micro, batch), DGX)
    text = format_plan(plan)
    assert plan.choice is not None and plan.choice.dims.tp == expected, text
    assert plan.tp == expected and f"(tp {expected})" in text.splitlines()[0]
    assert plan.choice.fits and roomy(plan.choice)
    assert [r.dims.tp for r in plan.tp_rows] == [1, 2, 4, 8]  # the chosen family at every degree
    line = next(r for r in plan.recommendation if r.startswith("Tensor parallelism:"))
    assert line.startswith(f"Tensor parallelism: tp {expected} ({plan.choice.label}) beats tp "), line
    fitting = [r for r in plan.tp_rows if r.fits and roomy(r)]
    fastest = min(r.step_s for r in fitting)
    tied = [r for r in fitting if r.step_s <= fastest * 1.01]
    assert plan.choice.need_gb <= min(r.need_gb for r in tied) + 1e-9 or plan.choice not in plan.tp_rows
    assert "× tp" in plan.choice.label and plan.grad_accum == batch // (nodes * 8 // expected * micro)
    dims = choose(llama(size, nodes, seq, micro, batch), DGX, nodes).dims
    assert dims.tp == expected and dims.world_size == nodes * 8 and dims.mesh_dim_names[-1] == "tp"


def test_a_tight_tp_1_loses_to_a_tp_with_margin():
    """70B on 4 × 8 H100, seq 8192: fsdp at tp 1 needs 69.2 GB of 80 (86 %, above the 85 % margin); tp 2 needs
    64.5 GB (81 %) at 13.7 s against tp 1's 13.3 s: the margin comes first, then tp 2 is the fastest left."""
    plan = plan_job(llama("llama3.1-70b", 4, 8192), DGX)
    one = plan.tp_rows[0]
    assert one.dims.tp == 1 and one.fits and not roomy(one)
    assert plan.choice.dims.tp == 2 and roomy(plan.choice) and plan.choice.step_s > one.step_s
    assert "tight (>85%)" in format_plan(plan)


@pytest.mark.parametrize("size,nodes,seq", [("llama3-8b", 1, 8192), ("llama3-8b", 2, 8192), ("llama3-8b", 4, 4096)])
def test_no_tp_where_tp_1_fits_and_is_fastest(size, nodes, seq):
    plan = plan_job(llama(size, nodes, seq), DGX)
    assert plan.choice is not None and plan.choice.dims.tp == 1 and plan.tp == 1
    line = next(r for r in plan.recommendation if r.startswith("Tensor parallelism"))
    assert line.startswith("Tensor parallelism: tp 1 (") and " beats tp " in line


def test_an_explicit_strategy_is_planned_at_tp_1_and_not_raised():
    plan = plan_job(llama("llama3.1-405b", 128, 8192, 4, 4096, strategy="fsdp"), DGX)
    assert plan.choice is None and plan.tp == 1


def test_the_tp_choice_compute_is_the_same_work_over_the_same_gpus():
    """Same global batch, same GPUs: the compute per step does not change with tp, the micro-steps do."""
    from hpc.plan.rows import compute_seconds, setup_of, mfu_of
    from dataclasses import replace

    s = llama("llama3.1-405b", 128, 8192, 4, 4096)
    f = model_facts(s.model)
    base = setup_of(s, DGX, None)
    one = compute_seconds(f, base, DGX, mfu_of(DGX)[0])
    eight = compute_seconds(f, replace(base, tp=8), DGX, mfu_of(DGX)[0])
    assert eight == pytest.approx(one) and replace(base, tp=8).grad_accum == 8 * base.grad_accum


# ---------------------------------------------------------------- the margin in the tie rule

A100_40 = dict(gpus=8, mem=40, link="nvswitch", intra=240, net=200, peak=312)


@pytest.mark.parametrize("batch", [64, 256, 16])
def test_13b_on_2x8_a100_40gb_takes_the_margin_in_a_tie(batch):
    """The issue's case: hsdp 8 at 39.2 of 40 GB was 0.1-0.3 % faster than fsdp at 24.7 GB and won."""
    plan = plan_job(spec("13b", nodes=2, global_batch=batch), site(**A100_40))
    tight = next(r for r in plan.rows if r.label == "hsdp 8 full_shard")
    assert tight.fits and not roomy(tight)
    assert plan.choice.label == "fsdp full_shard" and roomy(plan.choice)
    text = " ".join(plan.recommendation)
    assert "fsdp full_shard is the one that leaves a memory margin" in text
    assert f"{plan.choice.need_gb:.1f} GB of 40.0 GB per GPU" in text and f"{tight.need_gb:.1f} GB of 40.0 GB" in text


def test_a_tight_row_still_wins_outside_the_tie_and_when_nothing_has_margin():
    # 6.7B on 8 x 24 GB: the only layout that fits is at 97 %: it runs
    plan = plan_job(spec("6.7b", global_batch=64), site(**dict(A100_40, mem=24)))
    assert plan.choice is not None and not roomy(plan.choice)


@pytest.mark.parametrize("mem", [40, 48, 80])
def test_margin_is_a_share_of_the_gpu(mem):
    plan = plan_job(spec("13b", nodes=2, global_batch=64), site(**dict(A100_40, mem=mem)))
    for r in plan.rows:
        if r.need_gb is not None:
            assert roomy(r) == (r.need_gb <= MARGIN * mem)

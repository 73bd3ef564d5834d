"""``hpcx dryrun`` of Llama 3.1 405B at tp 8 on 1024 ranks (128 nodes × 8 GPUs, fsdp over 128): the real
sharded model on the fake process group, every parameter's DTensor placements, and this rank's bytes
equal to the exact arithmetic of the layout (TP's ``torch.chunk`` split, then FSDP2's padded dim-0
shard), in well under a minute and 1 GB."""

from __future__ import annotations

import math

import pytest

from hpc.cli import load_job
from hpc.core.models import model_facts
from hpc.dryrun import dryrun

from tests.conftest import REPO

SETS = ["model.size='llama3.1-405b'", "job.nodes=128", "job.tasks_per_node=8", "train.global_batch=1024",
        "train.micro_batch=1", "parallel.strategy='fsdp'", "parallel.tp=8", "parallel.mixed_precision='bf16'"]
COLUMN, ROW, REPLICATED = "dp_shard: _S(0, 8), tp: S(0)", "dp_shard: S(0), tp: S(1)", "dp_shard: S(0), tp: R"


def exact_param_bytes(shape, dp: int, tp: int, rank_dp: int = 0, rank_tp: int = 0, padded: bool = True) -> int:
    """fp32 bytes this rank stores: each matrix split by TP (``torch.chunk``: later ranks shorter), then
    FSDP2's dim-0 shard of that, padded to the first rank's chunk (``padded``; else the visible rows,
    which AdamW's state tensors are shaped like)."""
    def chunk(n: int, parts: int, i: int) -> int:
        size = -(-n // parts)
        return max(0, min(size, n - i * size))

    def fsdp(rows: int, rest: int) -> int:  # padded storage: every rank holds ceil(rows / dp) rows
        return (-(-rows // dp) if padded else chunk(rows, dp, rank_dp)) * rest

    d, kv, f, v = shape.d_model, shape.n_kv_heads * shape.head_dim, shape.ffn_dim, shape.vocab_size
    block = (fsdp(chunk(d, tp, rank_tp), d) + 2 * fsdp(chunk(kv, tp, rank_tp), d)  # wq, wk, wv: column-wise
             + fsdp(d, chunk(d, tp, rank_tp))  # wo: row-wise
             + 2 * fsdp(chunk(f, tp, rank_tp), d) + fsdp(d, chunk(f, tp, rank_tp))  # w1, w3; w2
             + 2 * fsdp(d, 1))  # the two norms, replicated over tp
    outer = 2 * fsdp(chunk(v, tp, rank_tp), d) + fsdp(d, 1)  # embedding, head, final norm
    return 4 * (shape.n_layers * block + outer)


@pytest.fixture(scope="module")
def result():
    spec, site, launch = load_job(str(REPO / "jobs" / "tiny-llama.toml"), "dgx-h100", SETS)
    return dryrun(spec, site, launch, rank=1023), model_facts(spec.model).shape


def test_every_parameter_is_a_dtensor_placed_by_the_plan(result):
    r, shape = result
    assert r.world_size == 1024 and r.dims["tp"] == 8 and r.dims["dp_shard"] == 128
    assert r.mesh["names"] == ["dp_shard", "tp"] and r.mesh["coordinate"] == [127, 7]
    assert r.mesh["dims"]["tp"]["max_nodes_per_group"] == 1  # a tp group inside one node's NVLink domain
    assert r.placements == {
        "tok_emb.weight": COLUMN, "norm.weight": REPLICATED, "head.weight": COLUMN,
        **{f"blocks.*.attn.{w}.weight": COLUMN for w in ("wq", "wk", "wv")},
        "blocks.*.attn.wo.weight": ROW, "blocks.*.attn_norm.weight": REPLICATED,
        "blocks.*.mlp_norm.weight": REPLICATED, **{f"blocks.*.mlp.{w}.weight": COLUMN for w in ("w1", "w3")},
        "blocks.*.mlp.w2.weight": ROW}
    assert not [p for p in r.problems if "no DTensor" in p]
    assert r.n_params == model_facts_n(shape)


def model_facts_n(shape) -> int:
    d, kv = shape.d_model, shape.n_kv_heads * shape.head_dim
    return shape.n_layers * (2 * d * d + 2 * kv * d + 3 * d * shape.ffn_dim + 2 * d) + 2 * shape.vocab_size * d + d


def test_bytes_per_rank_are_the_exact_arithmetic(result):
    r, shape = result
    exact = exact_param_bytes(shape, dp=128, tp=8, rank_dp=127, rank_tp=7)
    assert r.measured["params"] == exact
    assert r.measured["grads"] == exact
    visible = exact_param_bytes(shape, dp=128, tp=8, rank_dp=127, rank_tp=7, padded=False)
    assert visible < exact  # the last rank's vocabulary rows are fewer than the first's
    assert 0 <= r.measured["optimizer"] - 2 * visible < 64 * 1024  # AdamW: two fp32 moments, and step counts
    whole = 4 * r.n_params
    assert abs(r.measured["params"] / (whole / 1024) - 1) < 0.01  # ≈ the model over dp × tp
    assert r.checkpoint["shards"] >= 126 * 9 + 3  # every parameter a DTensor shard in DCP's local plan
    assert math.isclose(exact_param_bytes(shape, 128, 8), exact, rel_tol=0.01)  # the first rank: within 1%
    assert r.problems == [], r.problems  # and the plan, which knows tp, agrees within 1% (exit 0)
    assert r.planned is not None and abs(r.planned["params"] / r.measured["params"] - 1) < 0.01


def test_it_takes_under_a_minute_and_1_gb(result):
    r, _ = result
    assert r.peak_rss_bytes < 2**30
    assert r.seconds < 60 * 3  # a hang guard on two shared cores; the time itself is printed (about 20 s)

"""``[lora]`` on the login side: the section's checks, and memory that counts gradients and optimizer
state for the trainable parameters only (issue 33, items 1 and 2).

Classes of defect, each with cases of its own:

- a spec whose ``[lora]`` names what the family does not have (a target, a trainable pattern, a family
  without projections) loads, or is not one line naming the key;
- the planner counts gradients and Adam state for frozen weights (a LoRA 8B would not fit one GPU), or
  counts adapters that are not there (params of the built model ≠ plan's);
- ``hpcx dryrun`` of the real-size model on the fake process group disagrees with the plan by more
  than 1% (one rank, fsdp on 8, hsdp on 16).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hpc.cli import load_job
from hpc.core.errors import ConfigError
from hpc.core.lora import adapter_shapes, hf_targets, resolved_targets, with_lora
from hpc.core.models import model_facts
from hpc.core.spec import load_spec
from hpc.plan import plan_job

from tests.conftest import hpcx

ALL = "['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj']"
SPEC = """
[job]
name = "llama3-8b-lora"
nodes = 1
tasks_per_node = 1

[model]
arch = "llama"
size = "llama3-8b"

[train]
global_batch = 8
micro_batch = 1
steps = 100

[parallel]
strategy = "auto"
activation_checkpointing = true
mixed_precision = "bf16"
"""


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    path = tmp_path / "lora.toml"
    path.write_text(SPEC)
    return path


def lora(rank: int = 16, targets: str = ALL, *more: str) -> list[str]:
    return [f"lora.rank={rank}", "lora.alpha=32.0", f"lora.targets={targets}", *more]


# ---------------------------------------------------------------- the section


def test_targets_take_the_family_names_or_hugging_faces(spec_file):
    ours = load_spec(spec_file, lora(8, "['wq', 'v_proj', 'w2']")).lora
    assert resolved_targets(ours, "llama") == ["wq", "wv", "w2"]
    assert hf_targets(ours, "llama") == ["q_proj", "v_proj", "down_proj"]
    default = load_spec(spec_file, lora(8, "[]")).lora
    assert resolved_targets(default, "llama") == ["wq", "wv"]  # PEFT's default: q_proj, v_proj
    assert resolved_targets(default, "gpt") == ["qkv"]  # GPT-2's c_attn


@pytest.mark.parametrize("sets,expected", [
    (lora(8, "['q_proj', 'qq_proj']"), "`lora.targets`: 'qq_proj' is not a projection of 'llama'"),
    (lora(8, "['c_attn']"), "`lora.targets`: 'c_attn' is not a projection of 'llama'"),
    (lora(8, ALL, "lora.trainable=['*nrom*']"), "`lora.trainable`: '*nrom*' matches no parameter"),
    (lora(-1), "lora.rank"),
    (lora(8, ALL, "lora.dropout=1.5"), "lora.dropout"),
    (lora(8, ALL, "lora.rnak=3"), "did you mean `lora.rank`"),
])
def test_a_wrong_lora_section_is_one_line_naming_its_key(spec_file, sets, expected):
    with pytest.raises(ConfigError) as info:
        load_spec(spec_file, sets)
    assert any(expected in m for m in info.value.messages), info.value.messages


def test_a_user_model_has_no_projections_to_adapt(spec_file):
    with pytest.raises(ConfigError) as info:
        load_spec(spec_file, ["model.arch='tests.gated_model:build'", "model.seq_len=64", "model.vocab_size=256",
                              "model.size=''", *lora(4, "[]")])
    assert any("declares no projections for LoRA" in m for m in info.value.messages), info.value.messages


def test_adapters_are_counted_exactly(spec_file):
    spec = load_spec(spec_file, lora(16))
    shapes = adapter_shapes(spec.model, spec.lora)
    assert len(shapes) == 32 * 7 * 2
    assert shapes["blocks.0.attn.wk.lora_A.weight"] == (16, 4096) and shapes["blocks.0.attn.wk.lora_B.weight"] == (1024, 16)
    assert shapes["blocks.31.mlp.w2.lora_A.weight"] == (16, 14336)
    # r · (in + out) per projection: q, o 4096+4096; k, v 4096+1024; gate, up 4096+14336; down 14336+4096
    per_layer = 16 * (2 * 8192 + 2 * 5120 + 3 * 18432)
    facts = with_lora(model_facts(spec.model), spec)
    assert facts.trainable_params == 32 * per_layer == 41_943_040
    assert facts.n_params == model_facts(spec.model).n_params + 32 * per_layer


def test_trainable_extras_add_their_parameters(spec_file):
    spec = load_spec(spec_file, lora(16, ALL, "lora.trainable=['*norm*']"))
    facts = with_lora(model_facts(spec.model), spec)
    assert facts.trainable_params == 41_943_040 + (2 * 32 + 1) * 4096


# ---------------------------------------------------------------- the plan


def test_a_lora_8b_fits_one_h100_where_the_full_fine_tune_does_not(spec_file):
    spec, site, _ = load_job(str(spec_file), "dgx-h100", lora(16))
    plan = plan_job(spec, site)
    assert plan.choice is not None and plan.choice.fits
    row = plan.choice
    assert row.memory.grads == pytest.approx(41_943_040 * 4 / 1e9)  # fp32 gradients of the adapters only
    assert row.memory.optimizer == pytest.approx(41_943_040 * 8 / 1e9)
    # the frozen base in bf16 (lora.base_dtype = "auto" under bf16 compute), the adapters in fp32
    assert row.memory.params == pytest.approx((8_030_261_248 * 2 + 41_943_040 * 4) / 1e9)
    full, _, _ = load_job(str(spec_file), "dgx-h100", ["parallel.strategy='none'"])
    assert not plan_job(full, site).rows[0].fits


def test_hpcx_plan_says_it_fits(spec_file):
    out = hpcx("plan", str(spec_file), "--site", "dgx-h100", *(f"--set={s}" for s in lora(16)), "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert "LoRA r=16" in doc["model"] and doc["choice"] is not None, doc.get("recommendation")


# ---------------------------------------------------------------- dryrun at the real size


@pytest.mark.parametrize("sets", [
    ["job.tasks_per_node=1"],
    ["job.tasks_per_node=8", "parallel.strategy='fsdp'"],
    ["job.nodes=2", "job.tasks_per_node=8", "parallel.strategy='hsdp'", "train.global_batch=16"],
    ["job.tasks_per_node=1", "parallel.strategy='none'", "lora.base_dtype='nf4'"],
    ["job.tasks_per_node=8", "parallel.strategy='ddp'", "lora.base_dtype='fp32'"],
], ids=["none-1", "fsdp-8", "hsdp-16", "none-1-nf4", "ddp-8-fp32"])
def test_dryrun_of_a_lora_8b_agrees_with_the_plan(spec_file, sets):
    from hpc.dryrun import dryrun

    spec, site, launch = load_job(str(spec_file), "dgx-h100", [*lora(16), *sets])
    result = dryrun(spec, site, launch, 0)
    assert result.problems == [], result.problems
    assert result.planned is not None
    for what in ("params", "grads", "optimizer"):
        assert result.measured[what] == pytest.approx(result.planned[what], rel=0.01), what
    shard = launch.dims.dp_shard
    assert result.measured["optimizer"] == pytest.approx(41_943_040 * 8 / shard, rel=0.01)
    assert result.n_params == 8_030_261_248 + 41_943_040 and math.isfinite(result.seconds)


# ---------------------------------------------------------------- the frozen base's dtype (issue 44/45)

ONE_24GB = """
[scheduler]
kind = "local"

[node]
gpus = 1
gpu_model = "NVIDIA L4"
gpu_memory_gb = 24
gpu_peak_tflops = 121
cpus = 16
memory_gb = 128
"""


@pytest.mark.parametrize("dtype,params_gb,fits", [
    # 8,030,261,248 base × 2 B + 41,943,040 adapters × 4 B
    ("auto", (8_030_261_248 * 2 + 41_943_040 * 4) / 1e9, True),
    ("fp32", (8_030_261_248 + 41_943_040) * 4 / 1e9, False),
    # the 32 layers' 7 projections (6,979,321,856 weights) × (0.5 + 1/64 + 2/16384) B, embedding and head
    # (1,050,673,152) and norms (266,240) × 2 B, adapters × 4 B
    ("nf4", (6_979_321_856 * (0.5 + 1 / 64 + 2 / 16384) + (8_030_261_248 - 6_979_321_856) * 2
             + 41_943_040 * 4) / 1e9, True),
])
def test_an_8b_lora_fits_one_24gb_gpu_in_bf16(spec_file, tmp_path, dtype, params_gb, fits):
    site_file = tmp_path / "one24.toml"
    site_file.write_text(ONE_24GB)
    sets = [*lora(16), f"lora.base_dtype={dtype!r}", "model.seq_len=2048", "parallel.strategy='none'"]
    spec, site, _ = load_job(str(spec_file), str(site_file), sets)
    row = plan_job(spec, site).rows[0]
    assert row.memory.params == pytest.approx(params_gb, rel=1e-6)
    assert row.fits is fits and not row.memory.host_per_node  # without offload
    if dtype == "auto":  # 16.2 + 0.17 + 0.34 + 0.08 + 3.0 = 19.8 GB, 23.8 with 2 GB context + 10 %
        assert 19 < row.memory.total < 20.5 and row.memory.buffers < 0.1  # no autocast copies of a bf16 base
    out = hpcx("plan", str(spec_file), "--site", str(site_file), *(f"--set={s}" for s in sets))
    assert out.returncode == 0 and ("yes" in out.stdout) is fits, out.stdout


def test_an_nf4_base_counts_its_dequantized_projection(spec_file):
    spec, site, _ = load_job(str(spec_file), "dgx-h100", [*lora(16), "lora.base_dtype='nf4'", "parallel.strategy='none'"])
    facts = with_lora(model_facts(spec.model), spec)
    assert facts.nf4_params == 6_979_321_856 and facts.nf4_largest == 14_336 * 4_096  # w1/w2/w3
    bf16, _, _ = load_job(str(spec_file), "dgx-h100", [*lora(16), "lora.base_dtype='bf16'", "parallel.strategy='none'"])
    gap = plan_job(spec, site).rows[0].memory.buffers - plan_job(bf16, site).rows[0].memory.buffers
    assert gap == pytest.approx(14_336 * 4_096 * 15 / 1e9)

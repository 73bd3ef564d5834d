"""The Qwen2 and Mistral families without transformers: the activation bytes autograd really keeps
(Qwen2's biases, Mistral's sliding-window mask, a head width of its own), the meta build materialised
by the weight-init scheme, and the planner and dryrun agreeing at the published sizes (tests/hf/
test_families.py holds what transformers judges)."""

from __future__ import annotations

import pytest

from hpc.core.models import model_facts
from hpc.core.models.decoder import LlamaShape, block_activations
from hpc.core.spec import spec_from_dict

from tests.test_llama import MODES, measured_held

SHAPES = [(LlamaShape(2, 64, 4, 2, 160, 48, 300, qkv_bias=True, rope_theta=1e6, norm_eps=1e-6), 2),  # Qwen2
          (LlamaShape(2, 64, 4, 2, 160, 48, 300, window=16), 2),  # Mistral 7B v0.1's window, shorter than seq
          (LlamaShape(3, 64, 4, 1, 96, 40, 200, head_size=32, window=7, tied=True), 3),  # NeMo's head width
          (LlamaShape(2, 64, 4, 2, 160, 48, 300, window=64), 2)]  # a window longer than the samples: no mask


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape,micro_batch", SHAPES, ids=str)
def test_held_activations_match_autograd(shape, micro_batch, mode):
    mixed = "none" if mode == "fp32" else "bf16"
    predicted = block_activations(shape, micro_batch, False, mixed, autocast=mode != "bf16-weights").held
    if mode == "autocast":
        predicted += shape.matmul_params * 2
    assert measured_held(shape, micro_batch, mode) == pytest.approx(predicted, rel=0.001)


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_meta_build_materializes_with_the_weight_init_scheme(arch):
    import torch
    from trainer.model import WeightInit, build_model

    spec = spec_from_dict({"model": {"arch": arch, "size": "tiny"}}).model
    states = []
    for _ in range(2):
        net = build_model(spec, "meta")
        WeightInit.of(net, seed=7).materialize(net, torch.device("cpu"))
        states.append({k: v.clone() for k, v in net.state_dict().items()})
    biases = [k for k in states[0] if k.endswith(".bias")]
    assert len(biases) == (6 if arch == "qwen2" else 0)  # q, k, v of two blocks
    assert all(torch.equal(states[0][k], torch.zeros_like(states[0][k])) for k in biases)
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


@pytest.mark.parametrize("arch,size", [("qwen2", "qwen2.5-7b"), ("mistral", "mistral-7b-v0.1")])
def test_dryrun_at_the_published_size_agrees_with_the_plan(arch, size):
    from hpc.cli import load_job
    from hpc.dryrun import dryrun

    from tests.conftest import REPO

    spec, site, launch = load_job(str(REPO / "jobs" / "gpt-13b-auto.toml"), "dgx-h100",
                                  [f"model.arch={arch!r}", f"model.size={size!r}", "job.nodes=2",
                                   "job.tasks_per_node=8", "train.global_batch=16", "parallel.strategy='fsdp'"])
    result = dryrun(spec, site, launch, rank=15)
    assert result.n_params == model_facts(spec.model).n_params and result.problems == [], result.problems
    for what in ("params", "grads", "optimizer"):
        assert result.measured[what] == pytest.approx(result.planned[what], rel=0.01), what


@pytest.mark.parametrize("arch,size,label", [("qwen2", "qwen2.5-7b", "qwen2 qwen2.5-7b (7.62B params)"),
                                             ("mistral", "mistral-7b-v0.3", "mistral mistral-7b-v0.3 (7.25B params)")])
def test_the_presets_plan(arch, size, label):
    from tests.conftest import REPO, hpcx

    out = hpcx("plan", str(REPO / "jobs" / "llama3-8b-finetune.toml"), "--site", "dgx-h100",
               "--set", f"model.arch={arch!r}", "--set", f"model.size={size!r}", "--set", "model.seq_len=4096")
    assert out.returncode == 0, out.stderr
    assert label in out.stdout and " yes " in out.stdout

"""FLOPs per sample of a task's model (issue 45 item 4): counted from the model itself on the meta device, or the
task's declared `task.flops_per_sample`, never 6 per parameter per "token" of an image.

The ResNet-50 (tests/resnet50_task.py, torchvision's layout written out: torchvision is not installed here) at
224² counts 8.18e9 FLOPs per image forward with torch's FlopCounterMode, which counts 2 per multiply-add: 4.09e9
multiply-adds, torchvision's published 4.09 "GFLOPS" (multiply-adds, as in He et al.'s 3.8e9 for their variant).
Before, the planner took 6 × 25.6M parameters × 1 position = 0.153 GFLOPs for a training sample: 160× low.
"""

from __future__ import annotations

import pytest

from hpc.core.models import model_facts
from hpc.core.spec import spec_from_dict
from hpc.plan import plan_job
from tests.test_plan import site
from trainer.count import count_task

A100_8 = dict(gpus=8, mem=80, link="nvswitch", intra=240, net=200, peak=312)  # 8 × A100 80 GB, 312 TFLOP/s bf16


def resnet(size: int = 224, declared: float = 0.0, batch: int = 256, micro: int = 32, target: str = "ResNet50Task"):
    return spec_from_dict({"task": {"target": f"tests.resnet50_task:{target}", "kwargs": {"size": size},
                                    "flops_per_sample": declared},
                           "train": {"global_batch": batch, "micro_batch": micro}, "parallel": {"strategy": "auto"}})


def test_resnet50_forward_is_within_10_percent_of_the_published_4_1_g_multiply_adds():
    counted = count_task(resnet())
    assert counted.n_params == 25_557_032  # torchvision's resnet50
    assert counted.flops_per_sample / 2 == pytest.approx(4.1e9, rel=0.10)
    assert counted.flops_per_sample == pytest.approx(8.18e9, rel=0.005)
    assert "counted on the meta device" in counted.flops_source
    # outside the 16 bottlenecks (of different sizes: 75K to 4.5M parameters) only the stem and the head:
    # conv 7·7·3·64 = 9408, its norm 128, fc 2048·1000 + 1000 (before: 25.6M − 16 × 6.0M, below zero)
    assert model_facts(resnet().model, counted).root_params == 9408 + 128 + 2048 * 1000 + 1000


def test_the_count_follows_the_image_size():
    # convolutions scale with the pixels: 448² is four times 224² (every feature map 2× each way; the head's
    # 2048 × 1000 multiply-adds aside)
    big, full = count_task(resnet(448)).flops_per_sample, count_task(resnet()).flops_per_sample
    assert big == pytest.approx(4 * full, rel=0.01)


def test_a_declared_flops_per_sample_is_used_as_given():
    counted = count_task(resnet(declared=1e9))
    assert counted.flops_per_sample == 1e9 and "declared" in counted.flops_source
    facts = model_facts(resnet(declared=1e9).model, counted)
    assert facts.flops_per_token == 3e9  # training: forward + a backward of twice it, per position (1 per image)


def test_resnet50_on_8_a100_compute_by_hand():
    """global batch 256 over 8 A100s, micro-batch 32, no accumulation: per GPU 32 images × 3 × 8.178e9 FLOPs =
    7.851e11 FLOPs per step, / (312e12 × MFU 0.40 = 1.248e14 FLOP/s) = 6.29 ms of compute per step."""
    spec = resnet()
    facts = model_facts(spec.model, count_task(spec))
    plan = plan_job(spec, site(**A100_8), facts=facts)
    assert plan.grad_accum == 1 and plan.mfu == 0.4
    assert plan.compute_s == pytest.approx(32 * 3 * 8.178e9 / (312e12 * 0.4), rel=0.002)
    assert plan.compute_s == pytest.approx(6.29e-3, abs=0.01e-3)
    six_n = 6 * 25_557_032 * 32 / (312e12 * 0.4)  # the old estimate: 0.039 ms, 160× low
    assert plan.compute_s / six_n == pytest.approx(160, rel=0.01)
    assert plan.choice is not None and plan.choice.step_s >= plan.compute_s
    assert plan.choice.dims.ddp_enabled  # 102 MB of fp32 gradients all-reduced at 240 GB/s hide under the backward


class Unmeasurable:
    """A task whose loss reads a value (``.item()``): it cannot run on the meta device."""

    def __new__(cls, size: int = 224):
        from tests.resnet50_task import ResNet50Task

        task = ResNet50Task(size)
        real = task.loss
        task.loss = lambda model, batch: real(model, batch) * float(batch[0].sum().item() >= 0)
        return task


def test_a_forward_that_needs_values_falls_back_to_six_per_parameter(monkeypatch):
    import tests.resnet50_task as module

    monkeypatch.setattr(module, "Unmeasurable", Unmeasurable, raising=False)
    counted = count_task(resnet(target="Unmeasurable"))
    assert counted.flops_per_sample is None and "unknown" in counted.flops_source
    facts = model_facts(resnet(target="Unmeasurable").model, counted)
    assert facts.flops_per_token == 6 * 25_557_032


def test_a_declared_flops_per_sample_at_resnet_size_and_larger_loads():
    """A ResNet-50's 8.2e9 (and a long-context LM sample's 1e17) are declared values, not out of range."""
    from pathlib import Path

    from hpc.core.errors import ConfigError
    from hpc.core.spec import load_spec

    job = Path(__file__).resolve().parents[1] / "jobs" / "resnet-ddp.toml"
    for value in ("8.2e9", "1e17"):
        assert load_spec(job, [f"task.flops_per_sample={value}"]).task.flops_per_sample == float(value)
    with pytest.raises(ConfigError, match=r"task.flops_per_sample.*expected a value <= 1e\+18"):
        load_spec(job, ["task.flops_per_sample=1e19"])

"""``parallel.mixed_precision``: `auto` is bf16 on a site with GPUs and fp32 on a CPU site, decided the same way by
the planner and the trainer; explicit values (`none` = fp32) are kept on every site."""

from __future__ import annotations

import pytest
import torch

from hpc.core.config import ConfigError
from hpc.plan import plan_job
from hpc.plan.resolve import resolve
from hpc.core.site import load_site
from hpc.core.spec import Parallel, compute_precision, load_spec, spec_from_dict
from trainer.run import Run
from hpc.core.resolve import launch_parallel
from trainer.train import build_trainer
from trainer_testlib import TINY, make_run

GPU_SITES = ("dgx-h100", "pcie-4gpu")
CPU_SITES = ("local", "sandbox")


def test_the_default_is_auto():
    assert Parallel().mixed_precision == "auto"


@pytest.mark.parametrize("value,gpus,expected", [
    ("auto", True, "bf16"), ("auto", False, "none"),
    ("none", True, "none"), ("none", False, "none"),
    ("bf16", True, "bf16"), ("bf16", False, "bf16"),
    ("fp16", True, "fp16"), ("fp16", False, "fp16"),
])
def test_compute_precision(value, gpus, expected):
    assert compute_precision(value, gpus) == expected


@pytest.mark.parametrize("bad", ["fp8", "Auto", "BF16", "fp32", ""])
def test_other_values_are_refused_with_the_choices(bad):
    with pytest.raises(ConfigError) as err:
        spec_from_dict({"parallel": {"mixed_precision": bad}}, "job.toml")
    assert err.value.messages == [f"job.toml: `parallel.mixed_precision` = {bad!r}: expected one of 'auto', 'none', "
                                  "'bf16', 'fp16'"]


@pytest.mark.parametrize("site_name,value,expected", [
    *[(s, "auto", "bf16") for s in GPU_SITES], *[(s, "auto", "none") for s in CPU_SITES],
    *[(s, "none", "none") for s in GPU_SITES + CPU_SITES],
    ("dgx-h100", "fp16", "fp16"), ("local", "bf16", "bf16"),
])
def test_planner_and_trainer_decide_alike(tmp_path, site_name, value, expected):
    spec = load_spec(TINY, [f"parallel.mixed_precision={value!r}", "job.tasks_per_node=1", "parallel.strategy='ddp'"])
    site = load_site(site_name)
    assert plan_job(spec, site).mixed_precision == expected
    run = Run(tmp_path, spec, site, resolve(spec, site))
    assert launch_parallel(run.spec, run.launch).mixed_precision == expected
    assert run.spec.parallel.mixed_precision == value  # the spec itself is left as written


@pytest.mark.parametrize("strategy,ranks", [("none", 1), ("fsdp", 1)])
def test_auto_trains_in_fp32_on_a_cpu_site(tmp_path, strategy, ranks):
    from trainer.run import load_run

    run = load_run(make_run(tmp_path, "auto", strategy, ranks, ["parallel.mixed_precision='auto'"]))
    if strategy == "fsdp" and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        trainer, _ = build_trainer(run, 0, torch.device("cpu"))
        assert trainer.amp_dtype is None and trainer.scaler is None
        logits = trainer.model(torch.zeros(1, 8, dtype=torch.long))
        assert logits.dtype == torch.float32
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_an_explicit_bf16_still_casts_on_a_cpu_site(tmp_path):
    from trainer.run import load_run

    run = load_run(make_run(tmp_path, "bf16", "none", 1, ["parallel.mixed_precision='bf16'"]))
    trainer, _ = build_trainer(run, 0, torch.device("cpu"))
    assert trainer.amp_dtype == torch.bfloat16


def test_parallelize_refuses_an_undecided_parallel():
    """`auto` is decided once (``launch_parallel``/``decide_parallel``); parallelize never decides it again."""
    from hpc.core.dims import parallel_dims
    from hpc.core.resolve import decide_parallel
    from trainer.model import build_model, model_blocks
    from trainer.parallelize import parallelize

    model = build_model(spec_from_dict({}).model, "cpu")
    dims = parallel_dims("none", "full_shard", 1)
    with pytest.raises(ValueError, match="mixed_precision = 'auto'.*launch_parallel"):
        parallelize(model, model_blocks(model), Parallel(strategy="none"), dims, None, torch.device("cpu"))
    decided = decide_parallel(Parallel(strategy="none"), False)
    assert decided.mixed_precision == "none"
    assert parallelize(model, model_blocks(model), decided, dims, None, torch.device("cpu")) is model

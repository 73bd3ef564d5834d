"""``parallel.tp`` refused where it cannot work, one line each with the arithmetic, exit 2 (``hpcx dryrun``
and ``hpcx render`` share the check: ``hpc.core.tensor_parallel``); and the layout it gives where it can."""

from __future__ import annotations

import pytest

from hpc.core.dims import ParallelDims
from hpc.cli import load_job

from tests.conftest import REPO, hpcx

LLAMA = str(REPO / "jobs" / "tiny-llama.toml")  # 4 heads, 2 key/value heads
GPT = str(REPO / "jobs" / "tiny-ddp.toml")  # 4 heads
FSDP = ["--set", "parallel.strategy='fsdp'"]


def _sets(*sets: str) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


@pytest.mark.parametrize("job,site,sets,words", [
    (LLAMA, "dgx-h100", ["parallel.tp=3"], ["does not divide the 8 ranks of one NVLink domain on site 'dgx-h100' "
                                            "(8 GPUs per node): 8 / 3 = 2.667",
                                            "does not divide the model's 4 attention heads (`model.n_heads`): 4 / 3"]),
    (LLAMA, "dgx-h100", ["parallel.tp=4"], ["does not divide the model's 2 key/value heads (`model.n_kv_heads`): "
                                            "2 / 4 = 0.5 per rank"]),
    (LLAMA, "pcie-4gpu", ["parallel.tp=8", "model.n_heads=8", "model.n_kv_heads=8", "model.dim=64"],
     ["`parallel.tp` = 8 does not divide the 4 ranks of a node on site 'pcie-4gpu' (4 GPUs per node)"]),
    # issue 45: PCIe only is NVLink islands of 1 GPU; tp over PCIe only when asked (parallel.tp_cross_domain)
    (LLAMA, "pcie-4gpu", ["parallel.tp=2"], ["`parallel.tp` = 2 does not divide the 1 ranks of one NVLink domain on "
                                             "site 'pcie-4gpu' (4 GPUs per node, NVLink islands of 1: "
                                             "`node.nvlink_domain`): 1 / 2 = 0.5; `parallel.tp_cross_domain` = true "
                                             "allows a group across islands, over pcie"]),
    (LLAMA, "sandbox", ["parallel.tp=4", "parallel.tp_on_cpu=true", "job.nodes=2", "job.tasks_per_node=2", "model.n_kv_heads=4"],
     ["does not divide the 2 ranks of one NVLink domain on site 'sandbox' (2 tasks per node (a CPU site))"]),
    (GPT, "dgx-h100", ["parallel.tp=2", "parallel.strategy='ddp'"], ["`parallel.tp` = 2 needs strategy fsdp or hsdp"]),
    (GPT, "dgx-h100", ["parallel.tp=2", "model.dropout=0.1"], ["would draw different dropout masks"]),
])
def test_refusals_are_one_line_each_with_the_numbers(job, site, sets, words):
    args = (FSDP if not any("strategy" in s for s in sets) else []) + _sets(*sets)
    for command in ("dryrun", "render"):
        out = hpcx(command, job, "--site", site, *args, timeout=300)
        assert out.returncode == 2, (command, out.stdout, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert "Traceback" not in out.stderr and all(line.startswith("error:") for line in lines), out.stderr
        for w in words:
            assert sum(w in line for line in lines) == 1, (w, out.stderr)


def test_a_user_model_is_refused_above_tp_1():
    sets = ["model.arch='dryrun_models:good'", "model.seq_len=16", "model.vocab_size=64", "parallel.tp=2"]
    out = hpcx("render", GPT, "--site", "dgx-h100", *FSDP, *_sets(*sets), timeout=300,
               env={"PYTHONPATH": str(REPO / "tests" / "trainer")})
    assert out.returncode == 2, out.stderr
    line, = out.stderr.strip().splitlines()
    assert "`parallel.tp` = 2 but `model.arch` = 'dryrun_models:good' is a user model" in line and "use tp = 1" in line


def test_trainer_refuses_a_model_without_a_plan():
    """The trainer's own guard (a spec that slipped past resolve: its family declares no plan)."""
    from torch import nn

    from hpc.core.errors import ConfigError
    from hpc.core.models import family
    from hpc.core.models.tp_plan import tp_plan_of
    from trainer.tp import refuse_without_plan

    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8))
    plan = tp_plan_of(family("pkg.mod:make"))
    with pytest.raises(ConfigError, match="Sequential is not a built-in family: hpcx has no tensor-parallel plan"):
        refuse_without_plan(model, plan, 2)


@pytest.mark.parametrize("site,sets,dims", [
    ("dgx-h100", ["job.nodes=2", "parallel.tp=2", "train.global_batch=16"], (1, 8, 2)),
    ("dgx-h100", ["job.nodes=2", "parallel.tp=2", "parallel.strategy='hsdp'", "train.global_batch=16"], (2, 4, 2)),
    ("sandbox", ["job.nodes=2", "job.tasks_per_node=2", "parallel.tp=2", "parallel.tp_on_cpu=true", "train.global_batch=16"], (1, 2, 2)),
])
def test_the_launch_splits_the_world_into_data_parallel_and_tp(site, sets, dims):
    spec, _, launch = load_job(LLAMA, site, ["parallel.strategy='fsdp'", *sets])
    got: ParallelDims = launch.dims
    assert (got.dp_replicate, got.dp_shard, got.tp) == dims
    assert launch.grad_accum == spec.train.global_batch // (got.dp_world * spec.train.micro_batch)
    assert got.mesh_dim_names[-1] == "tp"

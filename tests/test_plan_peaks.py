"""The planner's start-up and checkpoint-staging terms (``hpc.plan.memory.init_bytes``, ``staging_bytes``),
and per-tensor shard padding (``sharded_numel``): a plan that says "fits" must start and save.

Classes: the init peak (device) by hand for each kind of layout; the staging peak (host) by hand,
async and sync, on GPU and CPU sites; a fit decided by these terms (host too small for async
staging, init above the training total); padding of uneven shards; and, over every shipped job,
preset and site, no fitting row whose init or host need exceeds what the site has.
"""

from __future__ import annotations

import json
import math

import pytest

from hpc.core.dims import parallel_dims
from hpc.plan.memory import GB, Config, Memory, estimate, init_bytes, sharded_numel, staging_bytes
from hpc.core.models.gpt import GPT_PRESETS, gpt_facts, gpt_shape
from hpc.plan import format_plan, plan_job
from hpc.plan.rows import Row
from hpc.core.site import load_site, parse_site
from hpc.core.spec import spec_from_dict

from tests.conftest import REPO, hpcx

F13 = gpt_facts("13b", gpt_shape("13b"))
EMBED_13B = 50304 * 5120  # the largest module of the 13b GPT (token embedding, and the head)


def cfg(strategy: str, world: int, sharding: str = "full_shard", offload: bool = False, async_save: bool = False,
        tpn: int = 8) -> Config:
    return Config(parallel_dims(strategy, sharding, world, tpn), offload, "bf16", True, 1, 0.0, async_save)


# ---------------------------------------------------------------- the init peak (device, per rank)


@pytest.mark.parametrize("strategy,sharding,world,params", [
    ("fsdp", "full_shard", 32, F13.n_params / 32), ("hsdp", "full_shard", 32, F13.n_params / 8),
    ("fsdp", "shard_grad_op", 4, F13.n_params / 4), ("fsdp", "no_shard", 8, F13.n_params)])
def test_init_is_the_ranks_fp32_params_plus_the_largest_module(strategy, sharding, world, params):
    assert F13.largest_module_params == EMBED_13B
    assert init_bytes(F13, cfg(strategy, world, sharding)) == pytest.approx(4 * (params + EMBED_13B))


def test_whole_replicas_are_initialised_in_place():
    """ddp and none: no DTensor to slice, so no module is computed beside the parameters."""
    assert init_bytes(F13, cfg("ddp", 8)) == 4 * F13.n_params
    assert init_bytes(F13, Config(parallel_dims("none", "full_shard", 1), False, "bf16", True, 1)) == 4 * F13.n_params


def test_init_under_offload_puts_only_one_module_on_the_device():
    assert init_bytes(F13, cfg("fsdp", 8, offload=True)) == 4 * EMBED_13B


def test_13b_on_four_48gb_cards_inits_the_shard_not_the_model():
    """The old trainer put 52 GB on each 48 GB card before sharding; now init is a quarter plus one module."""
    plan = plan_job(_spec("13b", 1, "fsdp"), load_site("pcie-4gpu"))
    row = next(r for r in plan.rows if r.label == "fsdp full_shard")
    assert row.memory.init == pytest.approx(4 * (F13.n_params / 4 + EMBED_13B) / GB)
    assert row.memory.init < 48 / 3


def test_need_covers_init_when_init_is_the_larger():
    mem = Memory(params=1.0, grads=1.0, optimizer=2.0, buffers=0.5, activations=0.5, init=9.0)
    row = Row(cfg("fsdp", 8), mem, None, capacity_gb=10.0, host_capacity_gb=None, gpu=True)
    assert row.peak_gb == 9.0 and row.need_gb == pytest.approx(9.0 + 2.0 + 0.9)
    assert row.fits is False
    smaller = Row(cfg("fsdp", 8), Memory(1.0, 1.0, 2.0, 0.5, 0.5, init=3.0), None, 10.0, None, True)
    assert smaller.peak_gb == 5.0


# ---------------------------------------------------------------- checkpoint staging (host)


def test_async_staging_is_params_and_optimizer_state_per_rank():
    per_rank = F13.n_params / 32
    assert staging_bytes(F13, cfg("fsdp", 32, async_save=True)) == pytest.approx(12 * per_rank)
    mem = estimate(F13, cfg("fsdp", 32, async_save=True), 8)
    assert mem.staging == pytest.approx(12 * per_rank / GB) and mem.staging_per_node == pytest.approx(8 * mem.staging)


def test_sync_staging_is_one_tensor_at_a_time():
    assert staging_bytes(F13, cfg("fsdp", 32)) == math.ceil(EMBED_13B / 32) * 4


def _spec(size: str, nodes: int, strategy: str, async_save: bool = False, tpn: int = 0, offload: bool = False):
    return spec_from_dict({"job": {"nodes": nodes, "tasks_per_node": tpn}, "model": {"size": size},
                           "train": {"global_batch": 64, "micro_batch": 1},
                           "parallel": {"strategy": strategy, "mixed_precision": "bf16",
                                        "activation_checkpointing": True, "cpu_offload": offload},
                           "checkpoint": {"async_save": async_save}})


def _gpu_site(host_gb: float):
    return parse_site({"scheduler": {"kind": "slurm", "gpu_directive": "gpus-per-node"},
                       "node": {"gpus": 8, "gpu_memory_gb": 80, "gpu_peak_tflops": 989, "memory_gb": host_gb,
                                "cpus": 64, "intra_link": "nvswitch", "intra_bandwidth_gbs": 450},
                       "network": {"fabric": "infiniband", "bandwidth_gbs": 400}}, "host-poor", "<test>")


def test_async_saves_need_host_memory_for_every_rank_of_the_node():
    """13b over 8 GPUs: 19.7 GB of params + Adam state per rank, 157 GB per node to stage."""
    poor = _gpu_site(128)  # 102 GB usable
    sync = plan_job(_spec("13b", 1, "auto"), poor)
    staged = plan_job(_spec("13b", 1, "auto", async_save=True), poor)
    full_sync = next(r for r in sync.rows if r.label == "fsdp full_shard")
    full_async = next(r for r in staged.rows if r.label == "fsdp full_shard")
    assert full_sync.fits is True and full_async.fits is False and full_async.host_fits is False
    assert full_async.host_need_gb == pytest.approx(8 * 12 * F13.n_params / 8 / GB)
    assert staged.choice is None
    assert "no (host)" in format_plan(staged)
    rich = plan_job(_spec("13b", 1, "auto", async_save=True), _gpu_site(2048))
    assert rich.choice is not None and rich.choice.host_fits is True


def test_unknown_host_memory_does_not_fail_staging_but_leaves_offload_unknown():
    site = _gpu_site(0)
    staged = next(r for r in plan_job(_spec("13b", 1, "auto", async_save=True), site).rows
                  if r.label == "fsdp full_shard")
    assert staged.host_fits is True and staged.host_need_gb > 0
    offload = next(r for r in plan_job(_spec("13b", 1, "fsdp", offload=True), site).rows if r.cfg.offload)
    assert offload.host_fits is None


def test_cpu_site_counts_async_staging_in_the_ranks_memory():
    local = load_site("local")
    sync = plan_job(_spec("small", 1, "auto", tpn=2), local)
    staged = plan_job(_spec("small", 1, "auto", async_save=True, tpn=2), local)
    a, b = (next(r for r in p.rows if r.label == "ddp") for p in (sync, staged))
    assert b.peak_gb - a.peak_gb == pytest.approx(b.memory.staging - a.memory.staging)
    assert b.memory.staging == pytest.approx(12 * GPT_PRESETS["small"].n_params / GB)
    assert b.host_need_gb == 0.0  # on a CPU site the host is the rank's memory: not counted twice


def test_plan_json_carries_the_new_terms():
    out = hpcx("plan", "jobs/gpt-13b-auto.toml", "--site", "dgx-h100", "--json")
    assert out.returncode == 0, out.stderr
    memory = json.loads(out.stdout)["choice"]["memory_gb"]
    assert {"init", "peak", "staging_per_rank", "staging_per_node", "host_need_per_node"} <= set(memory)
    assert memory["staging_per_node"] == pytest.approx(8 * memory["staging_per_rank"])
    text = hpcx("plan", "jobs/gpt-13b-auto.toml", "--site", "dgx-h100").stdout
    assert " init " in text.splitlines()[2] and "host/node" in text and "hpcx dryrun" in text


# ---------------------------------------------------------------- padding of uneven shards


def test_shards_are_padded_per_tensor():
    tiny = GPT_PRESETS["tiny"]
    assert sharded_numel(tiny.n_params, 128, tiny.param_shapes()) > math.ceil(tiny.n_params / 128)
    assert sharded_numel(10, 4, [(3,), (7,)]) == 1 + 2  # ceil(3/4) + ceil(7/4)
    assert sharded_numel(10, 4) == 3
    assert sharded_numel(0, 4, [(0, 5)]) == 0


@pytest.mark.parametrize("size", ["small", "125m", "350m", "1.3b", "13b", "30b", "70b"])
@pytest.mark.parametrize("shard", [1, 2, 4, 8, 16, 32, 64, 128])
def test_presets_divide_evenly(size, shard):
    shape = GPT_PRESETS[size]
    if all(s[0] % shard == 0 for s in shape.param_shapes()):
        assert sharded_numel(shape.n_params, shard, shape.param_shapes()) == shape.n_params // shard


# ---------------------------------------------------------------- "fits" means it starts


SITES = ["local", "sandbox", "dgx-h100", "pcie-4gpu"]


@pytest.mark.parametrize("site_name", SITES)
@pytest.mark.parametrize("size", ["tiny", "350m", "1.3b", "6.7b", "13b", "30b", "70b"])
@pytest.mark.parametrize("async_save", [False, True])
def test_no_fitting_row_has_an_init_or_host_peak_beyond_the_site(site_name, size, async_save):
    site = load_site(site_name)
    nodes = 1 if not site.multi_node else min(site.scheduler.max_nodes or 16, 16)
    plan = plan_job(_spec(size, nodes, "auto", async_save=async_save), site, nodes)
    for row in plan.rows:
        if row.fits and row.memory is not None:
            init_need = row.memory.init + (0 if row.gpu else row.memory.staging)
            assert init_need <= row.capacity_gb, row.label
            assert row.need_gb >= init_need
            if row.gpu and row.host_capacity_gb:
                assert row.host_need_gb <= row.host_capacity_gb, row.label


def test_every_shipped_job_plans_its_peaks(tmp_path):
    # the BERT examples count their model from a save_pretrained folder (examples/bert.py makes a tiny one);
    # every job at a batch that 8 GPUs divide (a task example's own batches are for 2 local ranks)
    import subprocess
    import sys

    from tests.extras import extra

    extra("transformers")
    bert = tmp_path / "bert-tiny"
    subprocess.run([sys.executable, "-m", "examples.bert", str(bert)], cwd=REPO, check=True, capture_output=True)
    for job in sorted((REPO / "jobs").glob("*.toml")):
        sets = ["--set", "train.micro_batch=1", "--set", "train.global_batch=64"]
        sets += ["--set", f"task.kwargs.pretrained={str(bert)!r}"] if job.stem.startswith("bert") else []
        out = hpcx("plan", str(job), "--site", "dgx-h100", "--json", *sets, env={"HF_HUB_OFFLINE": "1"})
        assert out.returncode == 0, (job, out.stderr)
        for row in json.loads(out.stdout)["rows"]:
            m = row["memory_gb"]
            assert m["init"] > 0 and m["peak"] >= max(m["total"], m["init"]), (job.name, row["label"])


# ---------------------------------------------------------------- FSDP's gradients at the step's peak (issue 36)


def peak_cfg(strategy: str, world: int, micro: int, grad_accum: int) -> Config:
    return Config(parallel_dims(strategy, "full_shard", world, 8), False, "bf16", True, micro, 0.0, False, grad_accum)


def test_fsdp_with_one_micro_step_holds_no_gradients_at_the_loss_backward():
    """The trainer drops gradients after every step: at the loss backward (every activation alive) none
    exist, and once backward made them all the activations are gone: the peak is the larger end."""
    memory = estimate(F13, peak_cfg("fsdp", 16, 8, 1), 8)
    resident = 4 * sharded_numel(F13.n_params, 16, F13.param_shapes) / GB
    assert memory.activations > resident and memory.grads == 0
    assert any("gradients: none at the loss backward" in n for n in memory.notes)


def test_gradients_that_outweigh_the_activations_count_by_the_excess():
    memory = estimate(F13, peak_cfg("fsdp", 2, 1, 1), 8)
    resident = 4 * sharded_numel(F13.n_params, 2, F13.param_shapes) / GB
    assert resident > memory.activations > 0
    assert memory.grads == pytest.approx(resident - memory.activations)


@pytest.mark.parametrize("strategy,world,grad_accum", [("fsdp", 16, 2), ("ddp", 8, 1), ("none", 1, 1)])
def test_gradients_stay_whole_where_they_outlive_a_micro_step(strategy, world, grad_accum):
    """Earlier micro-steps' gradients (FSDP, grad_accum > 1); DDP's buckets; ``none`` (not modelled yet)."""
    memory = estimate(F13, peak_cfg(strategy, world, 8, grad_accum), 8)
    assert memory.grads == pytest.approx(4 * sharded_numel(F13.n_params, 16 if strategy == "fsdp" else 1,
                                                           F13.param_shapes) / GB)


def test_the_row_of_a_world_size_1_fsdp_launch_is_fsdps_not_nones():
    """The plan lists only ``none`` at one rank; ``launch_row`` evaluates the layout that runs."""
    from hpc.plan import launch_row
    from hpc.plan.resolve import resolve

    spec = spec_from_dict({"job": {"nodes": 1, "tasks_per_node": 1}, "model": {"size": "350m", "seq_len": 2048},
                           "train": {"global_batch": 8, "micro_batch": 8},  # the GPU check's throughput run
                           "parallel": {"strategy": "fsdp", "mixed_precision": "bf16",
                                        "activation_checkpointing": True}})
    site = parse_site({"scheduler": {"kind": "local", "gpu_directive": "none"},
                       "node": {"gpus": 1, "gpu_memory_gb": 141, "cpus": 16, "intra_link": "none"},
                       "network": {"fabric": "none"}}, "one", "<test>")
    launch = resolve(spec, site)
    row = launch_row(spec, site, launch)
    none = next(r for r in plan_job(spec, site).rows if r.dims.strategy == "none")
    assert [r.dims.strategy for r in plan_job(spec, site).rows] == ["none"]
    assert row.dims.strategy == "fsdp" and row.memory.grads == 0 < none.memory.grads
    assert row.memory.total < none.memory.total

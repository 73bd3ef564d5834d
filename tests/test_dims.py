"""The parallel layout is decided once (hpc.core.dims.parallel_dims): every consumer — resolve and render,
the planner, the trainer's launch refit, its device mesh, and checkpoint inference — agrees with it."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from hpc.core.dims import ParallelDims, dims_from_mesh, parallel_dims
from hpc.plan.memory import GB
from hpc.core.models import model_facts
from hpc.plan import choose, evaluate, setup_of
from hpc.login.render import render_summary
from hpc.plan.resolve import resolve
from hpc.core.site import load_site
from hpc.core.spec import spec_from_dict

# (strategy, sharding, nodes, tasks_per_node, shard_size) -> expected (dp_replicate, dp_shard, mesh shape)
CASES = [
    ("none", "full_shard", 1, 1, 0, (1, 1, None)),
    ("dp", "full_shard", 1, 1, 0, (1, 1, None)),
    ("ddp", "full_shard", 1, 4, 0, (4, 1, None)),
    ("ddp", "full_shard", 2, 2, 0, (4, 1, None)),
    ("fsdp", "full_shard", 1, 4, 0, (1, 4, (4,))),
    ("fsdp", "full_shard", 2, 4, 0, (1, 8, (8,))),
    ("fsdp", "shard_grad_op", 2, 2, 0, (1, 4, (4,))),
    ("fsdp", "no_shard", 1, 4, 0, (4, 1, (4, 1))),
    ("fsdp", "no_shard", 2, 2, 0, (4, 1, (4, 1))),
    ("hsdp", "full_shard", 2, 2, 0, (2, 2, (2, 2))),
    ("hsdp", "shard_grad_op", 2, 4, 0, (2, 4, (2, 4))),
    ("hsdp", "full_shard", 4, 2, 4, (2, 4, (2, 4))),
]
IDS = [f"{c[0]}-{c[1]}-{c[2]}x{c[3]}" + (f"-shard{c[4]}" if c[4] else "") for c in CASES]


def _spec(strategy: str, sharding: str, nodes: int, tpn: int, shard_size: int):
    micro = 8 if strategy == "dp" else 1  # dp splits each micro batch over the node's 8 GPUs
    return spec_from_dict({"job": {"nodes": nodes, "tasks_per_node": tpn},
                           "parallel": {"strategy": strategy, "sharding": sharding, "shard_size": shard_size},
                           "train": {"global_batch": nodes * tpn * 2 * micro, "micro_batch": micro}}, "dims.toml")


@pytest.mark.parametrize("strategy,sharding,nodes,tpn,shard_size,expected", CASES, ids=IDS)
def test_the_one_function_gives_the_table(strategy, sharding, nodes, tpn, shard_size, expected):
    dims = parallel_dims(strategy, sharding, nodes * tpn, tpn, shard_size)
    assert (dims.dp_replicate, dims.dp_shard, dims.mesh_shape) == expected
    assert dims.world_size == nodes * tpn
    assert dims.reshard_after_forward == (dims.fsdp_enabled and sharding == "full_shard")
    assert ParallelDims.from_dict(dims.to_dict()) == dims


@pytest.mark.parametrize("strategy,sharding,nodes,tpn,shard_size,expected", CASES, ids=IDS)
def test_resolve_render_and_plan_use_the_same_layout(strategy, sharding, nodes, tpn, shard_size, expected):
    site = load_site("dgx-h100")
    spec = _spec(strategy, sharding, nodes, tpn, shard_size)
    dims = parallel_dims(strategy, sharding, nodes * tpn, tpn, shard_size)
    launch = resolve(spec, site)
    assert launch.dims == dims
    assert f"# strategy: {dims.describe()}\n" in render_summary(spec, site, launch)
    assert choose(spec, site, nodes).dims == dims
    row = evaluate(model_facts(spec.model), (dims, False), setup_of(spec, site, nodes), site)
    n = model_facts(spec.model).n_params
    assert row.dims == dims and row.memory.params == pytest.approx(4 * math.ceil(n / dims.dp_shard) / GB)


def test_describe_says_what_the_mesh_is():
    assert parallel_dims("fsdp", "no_shard", 8).describe() == (
        "fsdp no_shard (whole parameters on each of 8 ranks, mesh replicate=8 × shard=1; gradients all-reduced)")
    assert "sharded over 8" in parallel_dims("fsdp", "full_shard", 8).describe()
    assert "replicate=4 × shard=8" in parallel_dims("hsdp", "shard_grad_op", 32, 8).describe()


@pytest.mark.parametrize("args,message", [
    (("none", "full_shard", 4), "runs one process, but 4 ranks"),
    (("dp", "full_shard", 2), "runs one process, but 2 ranks"),
    (("hsdp", "full_shard", 6, 4), "shard group of 4 ranks does not divide the world of 6 ranks"),
    (("hsdp", "full_shard", 8, 8, 3), "shard group of 3 ranks does not divide the world of 8 ranks"),
    (("hsdp", "no_shard", 8, 4), "would shard nothing"),
    (("zero3", "full_shard", 8), "expected one of none, dp, ddp, fsdp, hsdp"),
    (("fsdp", "full_shard", 0), "expected at least one rank"),
])
def test_impossible_layouts_say_their_numbers(args, message):
    with pytest.raises(ValueError, match=message):
        parallel_dims(*args)


@pytest.mark.parametrize("fields,message", [
    (("fsdp", "full_shard", 2, 4), "fsdp shards over every rank"),
    (("ddp", "full_shard", 2, 2), "ddp replicates whole parameters"),
    (("ddp", "full_shard", 4, 1, 2), "tensor parallelism runs inside fsdp or hsdp"),
    (("fsdp", "full_shard", 1, 0), "dp_shard = 0: expected a degree >= 1"),
])
def test_the_value_checks_its_own_arithmetic(fields, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(*fields)


def test_hsdp_no_shard_is_refused_at_load():
    from hpc.core.config import ConfigError

    with pytest.raises(ConfigError, match="would shard nothing"):
        resolve(_spec("hsdp", "no_shard", 2, 2, 0), load_site("sandbox"))


# ---------------------------------------------------------------- the trainer's side, at full world size


@pytest.fixture
def fake_world():
    """A fake process group (torch's test backend: collectives are no-ops) at a given world size."""
    from hpc.dryrun.fake_pg import fake_process_group

    with contextlib.ExitStack() as stack:
        yield lambda world, rank=0: stack.enter_context(fake_process_group(world, rank))


@pytest.mark.parametrize("strategy,sharding,nodes,tpn,shard_size,expected", CASES, ids=IDS)
def test_trainer_mesh_refit_and_checkpoint_inference_agree(strategy, sharding, nodes, tpn, shard_size, expected,
                                                           fake_world, tmp_path):
    from trainer.checkpoint import infer_dims
    from trainer.model import WeightInit, build_model, model_blocks
    from trainer.parallelize import build_mesh, parallelize
    from trainer.run import Run
    from hpc.core.resolve import launch_parallel
    from trainer.train import fit_launch

    world = nodes * tpn
    dims = parallel_dims(strategy, sharding, world, tpn, shard_size)
    spec, site = _spec(strategy, sharding, nodes, tpn, shard_size), load_site("dgx-h100")
    half = nodes // 2 if nodes > 1 and (nodes // 2 * tpn) % (shard_size or tpn) == 0 else nodes
    started_smaller = _spec(strategy, sharding, half, tpn, shard_size)  # a folder resolved for fewer ranks
    refit = fit_launch(Run(tmp_path, spec, site, resolve(started_smaller, site)), world, tpn)
    assert refit.dims == dims and refit.world_size == world
    fake_world(world, rank=world - 1)
    mesh = build_mesh(dims, "cpu")
    if dims.mesh_shape is None:
        assert mesh is None
    else:
        assert tuple(mesh.mesh.shape) == dims.mesh_shape and mesh.mesh_dim_names == dims.mesh_dim_names
    if dims.dp_enabled:
        return  # nn.DataParallel needs GPUs
    model = build_model(spec.model, "meta")
    parallel = launch_parallel(spec, refit)  # mixed_precision "auto" decided for the site
    model = parallelize(model, model_blocks(model), parallel, dims, mesh, torch.device("cpu"), WeightInit.of(model, 0))
    seen = infer_dims(model)
    assert (seen.strategy, seen.dp_replicate, seen.dp_shard) == (dims.strategy, dims.dp_replicate, dims.dp_shard)


def test_checkpoint_inference_of_meshes():
    assert dims_from_mesh(("dp_replicate", "dp_shard"), (8, 1), ddp=False) == ParallelDims("fsdp", "no_shard", 8, 1)
    assert dims_from_mesh(("dp_replicate", "dp_shard"), (2, 4), ddp=False).strategy == "hsdp"
    assert dims_from_mesh(("dp_shard",), (4,), ddp=False) == ParallelDims("fsdp", "full_shard", 1, 4)
    assert dims_from_mesh(None, (4,), ddp=True) == ParallelDims("ddp", "full_shard", 4, 1)
    assert dims_from_mesh(None, (), ddp=False) == ParallelDims("none", "full_shard", 1, 1)


@pytest.mark.parametrize("site_name,strategy,tasks,gpus,directive", [
    ("dgx-h100", "dp", 1, 8, "#SBATCH --gpus-per-node=8"),  # one process drives the node's 8 GPUs
    ("pcie-4gpu", "dp", 1, 4, "#SBATCH --gres=gpu:4"),
    ("dgx-h100", "none", 1, 1, "#SBATCH --gpus-per-node=1"),  # one process, one GPU
    ("dgx-h100", "ddp", 8, 8, "#SBATCH --gpus-per-node=8"),  # one process per GPU
    ("local", "dp", 1, 0, None),
    ("sandbox", "none", 1, 0, None),
])
def test_one_process_strategies_take_one_task_per_node(site_name, strategy, tasks, gpus, directive):
    from hpc.login.render import render

    site = load_site(site_name)
    spec = spec_from_dict({"parallel": {"strategy": strategy}, "train": {"global_batch": 64, "micro_batch": 8}})
    launch = resolve(spec, site)
    assert (launch.tasks_per_node, launch.gpus_per_node, launch.world_size) == (tasks, gpus, tasks)
    assert choose(spec, site, 1).dims == launch.dims
    script = render(spec, site, launch, "/runs/RUN", "/venv/bin/python")
    if directive:
        assert directive in script and f"#SBATCH --ntasks-per-node={tasks}" in script


@pytest.mark.parametrize("strategy,sharding,nodes,tpn,shard_size,expected", CASES, ids=IDS)
def test_dryrun_builds_the_same_layout(strategy, sharding, nodes, tpn, shard_size, expected):
    """`hpcx dryrun` (the trainer's construction on a fake process group) reports the layout and mesh
    of the one function, and its bytes agree with the plan's for that layout."""
    from hpc.dryrun import dryrun

    spec, site = _spec(strategy, sharding, nodes, tpn, shard_size), load_site("dgx-h100")
    dims = parallel_dims(strategy, sharding, nodes * tpn, tpn, shard_size)
    if dims.dp_enabled:
        spec = spec_from_dict({"job": {"nodes": nodes, "tasks_per_node": tpn},
                               "parallel": {"strategy": strategy}, "train": {"global_batch": 16, "micro_batch": 8}})
    result = dryrun(spec, site, resolve(spec, site), rank=nodes * tpn - 1)
    assert ParallelDims.from_dict(result.dims) == dims
    shape = result.mesh["shape"]
    assert (tuple(shape) if shape else None) == dims.mesh_shape
    assert (tuple(result.mesh["names"]) if result.mesh["names"] else None) == dims.mesh_dim_names
    assert result.problems == []


@pytest.mark.parametrize("args,expected", [
    (("fsdp", "full_shard", 8, 4, 0, 2), ((1, 4, 2), ("dp_shard", "tp"), ("dp_shard",))),
    (("fsdp", "no_shard", 8, 4, 0, 2), ((4, 1, 2), ("dp_replicate", "dp_shard", "tp"), ("dp_replicate", "dp_shard"))),
    (("hsdp", "full_shard", 16, 8, 0, 2), ((2, 4, 2), ("dp_replicate", "dp_shard", "tp"), ("dp_replicate", "dp_shard"))),
    (("hsdp", "full_shard", 16, 8, 2, 4), ((2, 2, 4), ("dp_replicate", "dp_shard", "tp"), ("dp_replicate", "dp_shard"))),
    (("fsdp", "full_shard", 1024, 8, 0, 8), ((1, 128, 8), ("dp_shard", "tp"), ("dp_shard",))),
])
def test_tp_is_the_innermost_mesh_dimension_and_fsdp_sees_the_rest(args, expected):
    dims = parallel_dims(*args)
    degrees, names, fsdp_names = expected
    assert (dims.dp_replicate, dims.dp_shard, dims.tp) == degrees
    assert dims.mesh_dim_names == names and dims.fsdp_dim_names == fsdp_names
    assert dims.world_size == args[2] and dims.dp_world == args[2] // args[5]
    assert [dims.dp_rank(r) for r in range(4)] == [r // args[5] for r in range(4)]
    assert f"tp {args[5]}" in dims.describe()
    assert dims_from_mesh(dims.mesh_dim_names, dims.mesh_shape, ddp=False, sharding=dims.sharding) == dims


@pytest.mark.parametrize("args,message", [
    (("ddp", "full_shard", 8, 4, 0, 2), "tensor parallelism runs inside fsdp or hsdp"),
    (("fsdp", "full_shard", 8, 4, 0, 8), "tp = 8 does not divide the 4 ranks of a node"),
    (("fsdp", "full_shard", 8, 4, 0, 3), "tp = 3 does not divide the 4 ranks of a node"),
    (("hsdp", "full_shard", 16, 8, 3, 2), "shard group of 3 ranks does not divide the world of 8 ranks"),
])
def test_impossible_tp_layouts_say_their_numbers(args, message):
    with pytest.raises(ValueError, match=message):
        parallel_dims(*args)

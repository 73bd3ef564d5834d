"""The GPU path's decisions, checked on the CPU (issue 22): what a CPU can show of each CUDA defect.

Refusals (dp + compile), DataParallel's per-thread autocast dtype, activation checkpointing's RNG
stash, the device wait before an async save stages, the environment an NCCL job gets, the order in
which process groups are made, the GC policy, and clipping by foreach groups (bit for bit the old
per-parameter path). What only a GPU shows is in tests/gpu/.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import threading
from concurrent.futures import Future

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hpc.core.config import ConfigError
from hpc.core.site import load_site, parse_site
from hpc.core.spec import load_spec
from hpc.plan.resolve import resolve
from trainer import checkpoint, dist as tdist, garbage
from trainer.metrics import PhaseClock
from trainer.model import build_model, model_blocks
from trainer.optim import clip_grad_norm, grads_by_device_and_dtype
from trainer.parallelize import (AutocastDataParallel, AutocastReplica, apply_ac, refuse_dp_compile,
                                 uses_rng)
from trainer.run import load_run
from trainer.train import build_trainer, join_job
from trainer_testlib import TINY, make_run

GPU_SITES = ("dgx-h100", "pcie-4gpu")


def gpu_site(gpus: int):
    return parse_site({"scheduler": {"kind": "local", "gpu_directive": "none"},
                       "node": {"gpus": gpus, "gpu_memory_gb": 80, "cpus": 16, "intra_link": "pcie"},
                       "network": {"fabric": "none"}}, "g", "<test>")


# ---------------------------------------------------------------- dp + compile


def test_dp_with_compile_on_several_gpus_is_refused_in_resolve():
    spec = load_spec(TINY, ["parallel.strategy='dp'", "parallel.compile=true", "job.tasks_per_node=1",
                            "train.micro_batch=4", "train.global_batch=8"])
    with pytest.raises(ConfigError) as err:
        resolve(spec, gpu_site(4))
    assert "`parallel.compile` = true with strategy 'dp' on 4 GPUs" in err.value.messages[0]
    assert resolve(spec, gpu_site(1)).strategy == "dp"  # one GPU: no replicas, nothing to refuse


def test_the_trainer_refuses_it_too_where_more_gpus_are_visible_than_resolved():
    refuse_dp_compile(1)
    with pytest.raises(ConfigError, match="use strategy 'ddp'"):
        refuse_dp_compile(2)


# ---------------------------------------------------------------- dp under autocast


def _worker_dtype(module: nn.Module) -> torch.dtype:
    """What DataParallel's worker does: a new thread, ``autocast(enabled=True)`` without a dtype."""
    out = {}

    def run() -> None:
        with torch.autocast("cpu", enabled=True):
            out["dtype"] = module(torch.randn(2, 4)).dtype

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out["dtype"]


def test_autocast_dtype_is_per_thread_and_the_replica_wrapper_carries_it():
    # one Linear per call: autocast's cache of cast weights is not per thread
    with torch.autocast("cpu", dtype=torch.float16):  # the loop's autocast, in the main thread
        assert nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.float16
        assert _worker_dtype(nn.Linear(4, 4)) == torch.bfloat16  # the thread default, not the loop's dtype
        assert _worker_dtype(AutocastReplica(nn.Linear(4, 4), torch.float16)) == torch.float16


def test_dataparallel_replicas_are_wrapped_and_names_are_unchanged(monkeypatch):
    seen = {}
    monkeypatch.setattr(nn.DataParallel, "parallel_apply", lambda self, r, i, k: seen.setdefault("r", r))
    model = nn.Sequential(nn.Linear(4, 4))
    wrapped = AutocastDataParallel(model, torch.bfloat16)
    wrapped.parallel_apply([model, model], [(1,), (2,)], [{}, {}])
    assert [type(r) for r in seen["r"]] == [AutocastReplica, AutocastReplica]
    assert seen["r"][0].dtype == torch.bfloat16
    assert list(wrapped.state_dict()) == list(nn.DataParallel(model).state_dict())


# ---------------------------------------------------------------- activation checkpointing


def _preserve_flags(blocks: nn.ModuleList) -> list[bool]:
    return [block.checkpoint_fn.keywords["preserve_rng_state"] for block in blocks]


@pytest.mark.parametrize("dropout,user,expected", [(0.0, False, False), (0.1, False, True), (0.0, True, True)])
def test_recomputation_replays_the_rng_only_where_a_block_draws_random_numbers(dropout, user, expected):
    spec = load_spec(TINY, [f"model.dropout={dropout}"])
    blocks = model_blocks(build_model(spec.model, "cpu"), spec.model.blocks)
    assert uses_rng(dropout, blocks, user) is expected
    apply_ac(blocks, uses_rng(dropout, blocks, user))
    assert set(_preserve_flags(blocks)) == {expected}


def test_a_dropout_module_inside_a_block_counts():
    blocks = nn.ModuleList([nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.2))])
    assert uses_rng(0.0, blocks, False) and not uses_rng(0.0, nn.ModuleList([nn.Dropout(0.0)]), False)


def test_the_trainer_builds_without_the_rng_stash_when_dropout_is_zero(tmp_path):
    run = load_run(make_run(tmp_path, "r", "none", 1, ["parallel.activation_checkpointing=true"]))
    trainer, _ = build_trainer(run, 0, torch.device("cpu"))
    assert set(_preserve_flags(model_blocks(trainer.model, run.spec.model.blocks))) == {False}


def test_without_the_stash_recomputed_gradients_equal_plain_ones():
    spec = load_spec(TINY, [])
    torch.manual_seed(0)
    plain = build_model(spec.model, "cpu")
    recomputed = build_model(spec.model, "cpu")
    recomputed.load_state_dict(plain.state_dict())
    apply_ac(model_blocks(recomputed, spec.model.blocks), preserve_rng=False)
    tokens = torch.randint(0, 100, (2, 16))
    for model in (plain, recomputed):
        model(tokens).float().square().mean().backward()
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters()):
        assert torch.equal(a.grad, b.grad), name


# ---------------------------------------------------------------- async save without a process group


class FakeStream:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def synchronize(self) -> None:
        self.log.append("stream synchronized")


def test_an_async_save_waits_for_the_device_before_staging(tmp_path, monkeypatch):
    order: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: FakeStream(order))

    def async_save(*args, **kwargs):
        order.append("staging started")
        done: Future = Future()
        done.set_result(None)
        return done

    monkeypatch.setattr(checkpoint.dcp, "async_save", async_save)
    saves = checkpoint.Checkpointer(tmp_path, async_save=True)
    monkeypatch.setattr(saves, "_reused_stager", lambda: None)
    partial, final = tmp_path / ".step-0000001.partial", tmp_path / "step-0000001"
    partial.mkdir()
    saves._start_async({}, None, None, partial, final)
    assert order == ["stream synchronized", "staging started"]
    assert saves.wait() == final and final.is_dir()


def test_on_the_cpu_there_is_nothing_to_wait_for(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: pytest.fail("no CUDA stream on a CPU run"))
    checkpoint.device_work_done()


# ---------------------------------------------------------------- the environment an NCCL job gets


@pytest.fixture
def clean_env(monkeypatch):
    names = [*tdist.nccl_trace_env("/x"), *tdist.PINNED_NCCL, "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
             "NCCL_IB_HCA", "NCCL_IB_DISABLE"]
    for name in names:  # set first, so that monkeypatch restores what the test sets (also an absent name)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize("site_name", GPU_SITES)
def test_a_gpu_job_gets_a_named_gloo_interface_and_the_pinned_error_handling(tmp_path, clean_env, site_name):
    site = load_site(site_name)
    tdist.apply_job_env(site.nccl, {})
    tdist.apply_nccl_trace(tmp_path)
    gloo = os.environ["GLOO_SOCKET_IFNAME"]
    assert gloo == site.nccl["GLOO_SOCKET_IFNAME"] and gloo.strip() and not gloo.startswith("^")
    assert os.environ["NCCL_SOCKET_IFNAME"] == "^lo,docker"  # NCCL's own syntax stays NCCL's
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


def test_an_exported_gloo_interface_wins_over_the_site(tmp_path, clean_env):
    clean_env.setenv("GLOO_SOCKET_IFNAME", "ens5")
    tdist.apply_job_env(load_site("dgx-h100").nccl, {})
    assert os.environ["GLOO_SOCKET_IFNAME"] == "ens5"


@pytest.mark.parametrize("where", ["site", "exported", "env.set"])
def test_another_async_error_handling_is_overridden_with_a_warning(tmp_path, clean_env, caplog, where):
    site = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"} if where == "site" else {}
    if where == "exported":
        clean_env.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    tdist.apply_job_env(site, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"} if where == "env.set" else {})
    logging.getLogger("hpcx.trainer").propagate = True
    with caplog.at_level(logging.WARNING, logger="hpcx.trainer"):
        tdist.apply_nccl_trace(tmp_path)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=1 overridden to 3" in caplog.text


@pytest.mark.parametrize("value", ["^lo,docker", "^docker", " "])
def test_a_gloo_exclusion_is_refused_in_a_site(value):
    doc = {"scheduler": {"kind": "local"}, "node": {"gpus": 1}, "nccl": {"GLOO_SOCKET_IFNAME": value}}
    with pytest.raises(ConfigError) as err:
        parse_site(doc, "g", "site.toml")
    assert "gloo takes no '^' exclusions" in "\n".join(err.value.messages)


# ---------------------------------------------------------------- the order in which groups are made


@pytest.fixture
def recorded_groups(monkeypatch):
    made: list[str] = []
    real_init, real_new = dist.init_process_group, dist.new_group

    def init(*args, **kwargs):
        made.append(f"default {kwargs.get('backend')}")
        return real_init(*args, **kwargs)

    def new_group(*args, **kwargs):
        timeout = kwargs.get("timeout")
        made.append(f"{kwargs.get('backend')} {int(timeout.total_seconds()) if timeout else None}")
        return real_new(*args, **kwargs)

    monkeypatch.setattr(tdist.dist, "init_process_group", init)
    monkeypatch.setattr(tdist.dist, "new_group", new_group)
    yield made
    tdist.shutdown(10)


@pytest.mark.parametrize("async_save,expected", [(True, ["default gloo", "gloo 30", "gloo 30"]),
                                                 (False, ["default gloo", "gloo 30"])])
def test_side_groups_are_made_right_after_the_process_group(tmp_path, recorded_groups, async_save, expected):
    run = load_run(make_run(tmp_path, "r", "fsdp", 1, [f"checkpoint.async_save={str(async_save).lower()}"]))
    join_job(run, tdist.detect_rank_env(), run.launch)
    assert recorded_groups == expected  # before the model, the mesh and the first step
    assert sorted(tdist._SIDE_GROUPS) == sorted(tdist.side_purposes(async_save))
    assert checkpoint._gloo_group() is tdist.side_group("saves")  # async saves use the one made here


def test_a_side_group_that_cannot_bind_fails_at_once_naming_the_variable(monkeypatch):
    tdist.init_single("gloo")
    try:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "hpcx-no-such-if0")
        with pytest.raises(RuntimeError, match="GLOO_SOCKET_IFNAME='hpcx-no-such-if0'"):
            tdist.open_side_groups(600, async_saves=False)
    finally:
        tdist.shutdown(10)


# ---------------------------------------------------------------- GC policy


def test_automatic_gc_is_off_for_the_loop_and_collections_fall_on_every_nth_step(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(garbage.gc, "collect", lambda generation=2: calls.append(generation) or 0)
    assert gc.isenabled()
    collector = garbage.GarbageCollection(3)
    assert not gc.isenabled() and calls == [1]  # one collection before the first step
    collected = [step for step in range(1, 10) if collector.step(step)]
    collector.close()
    assert collected == [3, 6, 9] and calls == [1, 1, 1, 1] and gc.isenabled()


def test_gc_every_zero_leaves_pythons_collector_alone(monkeypatch):
    monkeypatch.setattr(garbage.gc, "collect", lambda generation=2: pytest.fail("collected"))
    collector = garbage.GarbageCollection(0)
    assert gc.isenabled() and not collector.step(50)
    collector.close()
    assert gc.isenabled()


def test_the_loop_collects_on_the_same_steps_on_every_rank(tmp_path, monkeypatch):
    from trainer.loop import TrainState, train

    steps: list[int] = []
    run = load_run(make_run(tmp_path, "r", "none", 1, ["train.steps=7", "train.gc_every=3"]))
    trainer, _ = build_trainer(run, 0, torch.device("cpu"))
    assert trainer.gc_every == 3
    real_step = garbage.GarbageCollection.step
    monkeypatch.setattr(garbage.GarbageCollection, "step",
                        lambda self, step: real_step(self, step) and (steps.append(step) or True))
    seen = {}
    monkeypatch.setattr(trainer.model, "forward", _noting_gc(trainer.model.forward, seen))
    train(trainer, TrainState())
    assert steps == [3, 6] and seen["enabled"] is False and gc.isenabled()


def _noting_gc(forward, seen: dict):
    def wrapped(*args, **kwargs):
        seen["enabled"] = gc.isenabled()
        return forward(*args, **kwargs)
    return wrapped


# ---------------------------------------------------------------- clipping


def _old_clip(parameters: list[nn.Parameter], coef: torch.Tensor) -> None:
    """The per-parameter path clipping had before (one cast and one mul_ per parameter)."""
    for p in parameters:
        if p.grad is not None:
            p.grad.mul_(coef.to(dtype=p.grad.dtype, device=p.grad.device))


def _params_with_grads(seed: int) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [((8, 4), torch.float32), ((4,), torch.float32), ((16, 3), torch.bfloat16), ((5,), torch.float64),
              ((3, 3), torch.bfloat16)]
    params = []
    for shape, dtype in shapes:
        p = nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = (torch.randn(shape, generator=gen) * 3).to(dtype)
        params.append(p)
    params.append(nn.Parameter(torch.zeros(2)))  # no gradient: left alone
    return params


@pytest.mark.parametrize("max_norm", [0.5, 1e6, 0.0])
def test_foreach_clipping_equals_the_per_parameter_path_bit_for_bit(max_norm):
    new, old = _params_with_grads(1), _params_with_grads(1)
    norm = clip_grad_norm(new, max_norm)
    if max_norm > 0:
        _old_clip(old, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    for a, b in zip(new, old):
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)


def test_gradients_are_grouped_by_device_and_dtype():
    groups = grads_by_device_and_dtype(_params_with_grads(2))
    cpu = torch.device("cpu")
    assert {k: len(v) for k, v in groups.items()} == {(cpu, torch.float32): 2, (cpu, torch.bfloat16): 2,
                                                       (cpu, torch.float64): 1}


@pytest.mark.parametrize("sharding", ["full_shard", "no_shard"])
def test_no_all_reduce_over_a_shard_group_of_one(tmp_path, sharding, monkeypatch):
    run = load_run(make_run(tmp_path, "r", "fsdp", 1, [f"parallel.sharding={sharding!r}"]))
    tdist.init_single("gloo")
    try:
        trainer, _ = build_trainer(run, 0, torch.device("cpu"))
        trainer.model(torch.randint(0, 100, (1, 16))).float().mean().backward()
        reduced = []
        monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: reduced.append(k.get("group")))
        norm = clip_grad_norm(trainer.params, 1.0)
        assert reduced == [] and norm.device.type == "cpu" and norm > 0
    finally:
        tdist.shutdown(10)


# ---------------------------------------------------------------- the phase clock


def test_the_phase_clock_keeps_host_seconds_off_cuda():
    clock = PhaseClock(torch.device("cpu"))
    clock.lap("forward")
    assert not clock.cuda and clock.events == [] and clock.take(1)["forward"] >= 0


class FakeGpu:
    """A GPU clock as CUDA events see it: kernels queued by the host run later, in order; an event
    records the GPU's time when the work queued before it is done."""

    def __init__(self) -> None:
        self.done = 0.0  # when the GPU finishes what was queued so far

    def queue(self, seconds: float) -> None:
        self.done += seconds

    def event_class(self):
        gpu = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.at = None

            def record(self) -> None:
                self.at = gpu.done

            def synchronize(self) -> None:
                pass

            def elapsed_time(self, later) -> float:
                return (later.at - self.at) * 1000.0

        return Event


def test_an_evaluation_is_charged_to_no_phase_on_the_cuda_clock(monkeypatch):
    gpu = FakeGpu()
    monkeypatch.setattr(torch.cuda, "Event", gpu.event_class())
    clock = PhaseClock(torch.device("cuda", 0))
    gpu.queue(1.0)
    clock.lap("forward")
    gpu.queue(30.0)  # the evaluation's kernels
    clock.skip()
    gpu.queue(2.0)
    clock.lap("boundary")
    window = clock.take(1)
    assert (window["forward"], window["boundary"]) == (1.0, 2.0) and sum(window.values()) == 3.0


class FakeCudaMesh:
    """What ``open_host_groups`` and ``_all_reduced`` read of a 1-D NCCL mesh of 2 ranks."""

    device_type, ndim = "cuda", 1
    mesh = torch.tensor([0, 1])

    def size(self, dim: int) -> int:
        return 2

    def get_group(self, dim: int):
        return "the NCCL group"


def test_offloaded_norms_reduce_on_host_groups_without_a_trip_through_the_gpu(monkeypatch):
    from trainer import optim

    made, reduced = [], []
    monkeypatch.setattr(optim, "_HOST_GROUPS", {})
    monkeypatch.setattr(dist, "new_subgroups_by_enumeration",
                        lambda ranks, backend: made.append((ranks, backend)) or ("the gloo group", []))
    monkeypatch.setattr(dist, "all_reduce", lambda t, group: reduced.append((t.device.type, group)))
    monkeypatch.setattr(torch.Tensor, "to", lambda *a, **k: pytest.fail("no copy to the GPU and back"))
    mesh = FakeCudaMesh()
    optim.open_host_groups(mesh)
    optim.open_host_groups(mesh)  # once per mesh
    squares = torch.tensor(4.0, dtype=torch.float64)
    assert optim._all_reduced(squares, mesh, [0]) is squares
    assert made == [([[0, 1]], "gloo")] and reduced == [("cpu", "the gloo group")]
    optim.forget_host_groups()
    assert optim._HOST_GROUPS == {}


def test_a_cpu_mesh_needs_no_host_groups(monkeypatch):
    from trainer import optim

    monkeypatch.setattr(dist, "new_subgroups_by_enumeration", lambda *a, **k: pytest.fail("made a group"))
    mesh = FakeCudaMesh()
    mesh.device_type = "cpu"
    optim.open_host_groups(mesh)
    optim.open_host_groups(None)


# ---------------------------------------------------------------- CUDA state a job touches (issue 36)


@pytest.fixture
def gpu_node(monkeypatch):
    """A node with 2 GPUs as torch.cuda reports them; CUDA not initialized until a test says so.
    Asking for RNG state or pinned memory while uninitialized would open a context: it raises here."""
    states = {0: torch.full((16,), 1, dtype=torch.uint8), 1: torch.full((16,), 2, dtype=torch.uint8)}
    restored: dict[int, torch.Tensor] = {}
    node = {"initialized": False, "states": states, "restored": restored}

    def untouched(*args, **kwargs):
        if not node["initialized"]:
            raise AssertionError("a CUDA context was opened")

    def get_all():
        untouched()
        return [states[0], states[1]]

    def set_state(state, device: int | str = "cuda"):  # "cuda": the current device, 0 here
        untouched()
        restored[0 if device == "cuda" else device] = state

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: node["initialized"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", get_all)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)
    return node


def test_a_gloo_job_on_a_gpu_node_saves_no_cuda_rng_state(gpu_node):
    assert "cuda" not in checkpoint.rng_state()


def test_every_gpus_rng_state_is_saved_and_restored(gpu_node):
    gpu_node["initialized"] = True
    state = checkpoint.rng_state()
    assert state["cuda"].shape == (2, 16)
    checkpoint.set_rng_state(state)
    assert {k: int(v[0]) for k, v in gpu_node["restored"].items()} == {0: 1, 1: 2}


def test_an_older_checkpoints_single_cuda_state_restores_the_current_device(gpu_node):
    gpu_node["initialized"] = True
    checkpoint.set_cuda_rng_states(torch.full((16,), 7, dtype=torch.uint8))
    assert list(gpu_node["restored"]) == [0] and int(gpu_node["restored"][0][0]) == 7


def test_a_gloo_job_on_a_gpu_node_stages_saves_in_pageable_memory(gpu_node, monkeypatch, tmp_path):
    import torch.distributed.checkpoint.staging as staging

    made = []
    monkeypatch.setattr(staging, "StagingOptions", lambda **options: options)
    monkeypatch.setattr(staging, "DefaultStager", lambda options: made.append(options) or options)
    checkpoint.Checkpointer(tmp_path, async_save=True)._reused_stager()
    assert made == [{"use_pinned_memory": False, "use_shared_memory": False, "use_async_staging": True,
                     "use_non_blocking_copy": False}]


def test_weight_init_restores_every_gpus_rng_it_reseeded(monkeypatch):
    """``manual_seed`` reseeds every GPU: the fork that restores them must cover all, not only the
    model's (``dp``'s replicas draw dropout on the others)."""
    import trainer.model as model

    forked = []

    @contextlib.contextmanager
    def fork(devices, device_type):
        forked.append((list(devices), device_type))
        yield

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.random, "fork_rng", fork)
    with model._seeded(5, torch.device("cuda", 0)):
        pass
    with model._seeded(5, torch.device("cpu")):
        pass
    assert forked == [([0, 1, 2], "cuda"), ([], "cuda")]


def test_the_one_process_group_gets_the_specs_timeout_and_its_gpu(monkeypatch):
    from datetime import timedelta

    seen = {}
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: seen.update(kwargs))
    tdist.init_single("nccl", 300, torch.device("cuda", 0))
    assert (seen["timeout"], seen["device_id"], seen["world_size"]) == (timedelta(seconds=300),
                                                                        torch.device("cuda", 0), 1)
    seen.clear()
    tdist.init_single("gloo", 300, torch.device("cpu"))
    assert "device_id" not in seen and seen["timeout"] == timedelta(seconds=300)


def test_join_job_binds_the_one_process_nccl_group(tmp_path, monkeypatch):
    import trainer.train as train_module

    run_dir = make_run(tmp_path, "r", "fsdp", 1, ["parallel.timeout_s=321"])
    run = load_run(run_dir)
    launch = dataclasses.replace(run.launch, backend="nccl")
    cuda = torch.device("cuda", 0)
    calls = []
    monkeypatch.setattr(train_module, "device_for", lambda *a: cuda)
    monkeypatch.setattr(train_module, "apply_nccl_trace", lambda run_dir: None)
    monkeypatch.setattr(train_module, "init_single", lambda *a: calls.append(a) or ["h"])
    monkeypatch.setattr(train_module, "check_world", lambda *a: 1)
    monkeypatch.setattr(train_module, "open_side_groups", lambda *a: None)
    env = tdist.RankEnv(rank=0, local_rank=0, world_size=1, master_addr="127.0.0.1", master_port=0)
    join_job(run, env, launch)
    assert calls == [("nccl", 321, cuda)]

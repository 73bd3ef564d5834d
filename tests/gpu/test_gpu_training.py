"""Training on CUDA with every GPU present: DDP, FSDP2 and HSDP over NCCL, compile, CPU offload, the fp16
scalers, DCP checkpoints of CUDA tensors, the CUDA-event phase clock, DataParallel's autocast threads.

Each test runs ``torchrun --nproc_per_node=G -m trainer RUN`` (G = the visible GPUs; tests that need
several say so) on a run folder resolved for a G-GPU local site, or the trainer in this process on
cuda:0. ``gpu``-marked: skipped where CUDA is absent (tests/conftest.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.gpu.test_gpu import GPUS, TWO_GPUS, env_with, gpu_run

pytestmark = pytest.mark.gpu
FP32 = ["parallel.mixed_precision='none'", "train.seed=3"]


def batch(gpus: int, micro: int = 2, accum: int = 2) -> list[str]:
    return [f"train.micro_batch={micro}", f"train.global_batch={micro * accum * gpus}", f"job.tasks_per_node={gpus}"]


def train_on_all_gpus(run: Path, gpus: int = GPUS, timeout: float = 600, **env: str) -> dict:
    """torchrun over ``gpus`` local ranks; rank 0's summary."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}", "-m",
           "trainer", str(run)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=timeout, env=env_with(**env))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def finite(values: list[float]) -> bool:
    return bool(values) and all(v == v and abs(v) != float("inf") for v in values)


@pytest.mark.parametrize("strategy,extra", [
    ("ddp", []), ("fsdp", []), ("fsdp", ["parallel.sharding='shard_grad_op'"]),
    ("fsdp", ["parallel.sharding='no_shard'"]), ("fsdp", ["parallel.compile=true"]),
    ("fsdp", ["parallel.activation_checkpointing=true", "parallel.compile=true"]),
    ("ddp", ["parallel.compile=true"]),
])
def test_nccl_strategies_train_on_every_gpu(tmp_path, strategy, extra):
    run = gpu_run(tmp_path, "r", GPUS, [f"parallel.strategy={strategy!r}", *batch(GPUS), *extra])
    result = train_on_all_gpus(run)
    world = json.loads((run / "world.json").read_text())
    assert (world["backend"], world["world_size"], world["all_reduce"]) == ("nccl", GPUS, GPUS)
    assert result["steps"] == 6 and finite(result["losses"])


@TWO_GPUS
def test_hsdp_shards_within_and_replicates_across_groups(tmp_path):
    shard = GPUS // 2 if GPUS % 2 == 0 else 1
    run = gpu_run(tmp_path, "r", GPUS, ["parallel.strategy='hsdp'", f"parallel.shard_size={shard}", *batch(GPUS)])
    result = train_on_all_gpus(run)
    mesh = json.loads((run / "mesh.json").read_text())
    assert len(mesh["dp_shard"]) == GPUS // shard and all(len(g) == shard for g in mesh["dp_shard"])
    assert finite(result["losses"])


@TWO_GPUS
def test_ddp_fsdp_and_hsdp_agree_over_nccl_in_fp32(tmp_path):
    shard = GPUS // 2 if GPUS % 2 == 0 else 1
    configs = {"ddp": ["parallel.strategy='ddp'"], "fsdp": ["parallel.strategy='fsdp'"],
               "hsdp": ["parallel.strategy='hsdp'", f"parallel.shard_size={shard}"]}
    seen = {name: losses_of(tmp_path, name, GPUS, sets) for name, sets in configs.items()}
    single = losses_of(tmp_path, "single", 1, ["parallel.strategy='none'", "job.tasks_per_node=1",
                                               f"train.micro_batch={2 * GPUS}", f"train.global_batch={4 * GPUS}"])
    for name, values in seen.items():
        assert max(abs(a - b) for a, b in zip(values, single)) <= 1e-3, (name, values, single)


def losses_of(root: Path, name: str, gpus: int, sets: list[str]) -> list[float]:
    overrides = [*batch(gpus), *FP32, *sets] if gpus > 1 else [*FP32, *sets]
    run = gpu_run(root, name, gpus, overrides)
    train_on_all_gpus(run, gpus, NVIDIA_TF32_OVERRIDE="0")  # fp32 matmuls: the layouts' sums then agree to 1e-3
    return losses(run)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cpu_offload_trains_as_without_it(tmp_path, precision):
    """On every GPU: with several, the norm of the host gradients reduces on the host gloo groups."""
    seen = {}
    for offload in ("false", "true"):
        run = gpu_run(tmp_path, f"offload-{offload}", GPUS, [
            "parallel.strategy='fsdp'", f"parallel.cpu_offload={offload}", f"parallel.mixed_precision={precision!r}",
            *batch(GPUS)])
        seen[offload] = train_on_all_gpus(run)["losses"]
    assert finite(seen["true"]) and max(abs(a - b) for a, b in zip(seen["true"], seen["false"])) <= 1e-2


@pytest.mark.parametrize("strategy", ["none", "ddp", "fsdp"])
def test_fp16_trains_with_its_grad_scaler(tmp_path, strategy):
    gpus = 1 if strategy == "none" else GPUS
    run = gpu_run(tmp_path, "r", gpus, [f"parallel.strategy={strategy!r}", "parallel.mixed_precision='fp16'",
                                        *batch(gpus)])
    assert finite(train_on_all_gpus(run, gpus)["losses"])


def test_fp16_scalers_are_the_sharded_one_under_fsdp(tmp_path):
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from trainer.dist import init_single, shutdown
    from trainer.run import load_run
    from trainer.train import build_trainer

    init_single("nccl")
    try:
        for strategy, kind in (("ddp", torch.amp.GradScaler), ("fsdp", ShardedGradScaler)):
            run = gpu_run(tmp_path, strategy, 1, [f"parallel.strategy={strategy!r}", "job.tasks_per_node=1",
                                                  "parallel.mixed_precision='fp16'"])
            trainer, _ = build_trainer(load_run(run), 0, torch.device("cuda", 0))
            assert type(trainer.scaler) is kind
    finally:
        shutdown(30)


@pytest.mark.parametrize("async_save", [False, True])
def test_dcp_checkpoints_of_cuda_tensors_resume_the_same_run(tmp_path, async_save):
    """6 steps saving at 3 and 6; the step-6 checkpoint removed; the same command resumes at 3 and
    steps 4-6 repeat the first incarnation's losses."""
    import shutil

    run = gpu_run(tmp_path, "r", GPUS, ["parallel.strategy='fsdp'", "checkpoint.interval_steps=3",
                                        f"checkpoint.async_save={str(async_save).lower()}", *batch(GPUS)])
    train_on_all_gpus(run)
    first = losses(run)
    shutil.rmtree(run / "checkpoints" / "step-0000006")
    train_on_all_gpus(run)
    again = losses(run)[len(first):]
    ledger = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]
    assert [e["step"] for e in ledger if e.get("event") == "start"] == [0, 3]
    assert again == pytest.approx(first[3:], abs=1e-5)


def test_the_phase_clock_times_the_gpu_with_events():
    from trainer.metrics import PHASES, PhaseClock

    clock = PhaseClock(torch.device("cuda", 0))
    a = torch.randn(4096, 4096, device="cuda")
    clock.lap("data")
    for _ in range(20):
        a = a @ a / 4096
    clock.lap("forward")  # the host is back at once; the GPU is not
    clock.lap("log")
    window = clock.take(1)
    assert set(window) == set(PHASES) and window["forward"] > window["data"] and window["forward"] > 0


@TWO_GPUS
def test_dataparallel_threads_compute_in_the_loops_dtype():
    from trainer.parallelize import AutocastDataParallel

    seen = []

    class Probe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = self.linear(x)
            seen.append(y.dtype)
            return y

    model = AutocastDataParallel(Probe().cuda(), torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(torch.randn(4, 8, device="cuda"))
    assert seen and set(seen) == {torch.bfloat16}


@TWO_GPUS
def test_dp_with_compile_is_refused_where_several_gpus_are_visible():
    from hpc.core.config import ConfigError
    from hpc.core.dims import parallel_dims
    from hpc.core.resolve import decide_parallel
    from hpc.core.spec import Parallel, load_spec
    from trainer.model import build_model, model_blocks
    from trainer.parallelize import parallelize

    spec = load_spec(REPO / "jobs" / "tiny-ddp.toml", [])
    model = build_model(spec.model, "cpu")
    with pytest.raises(ConfigError, match="DataParallel's replicas"):
        parallelize(model, model_blocks(model), decide_parallel(Parallel(strategy="dp", compile=True), True),
                    parallel_dims("dp", "full_shard", 1, 1, 0), None, torch.device("cuda", 0))

"""The loop's host syncs, its metrics cadence and phase split, and its float settings (one process, real trainer).

Reads of tensor values are counted as calls of ``aten::_local_scalar_dense``: the op behind
``.item()``, ``float(t)`` and ``bool(t)``, the one that makes the host wait for a GPU. On CPU it is
the same op, so a read that would stall a GPU step shows up here. A logging step reads two values
(loss and norm) from one host copy: one wait on a GPU (``test_cuda_steps_sync_only_to_log``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.loop import TrainState, logged_values, logs_at, set_determinism, set_float_math, train
from trainer.metrics import PHASES, PhaseClock
from trainer.run import load_run
from trainer.train import build_trainer
from trainer_testlib import make_run

SUBNORMAL = 1e-39  # below float32's smallest normal (1.2e-38)
ONE_MICRO_BATCH = "train.micro_batch=8"  # the whole global batch in one forward (make_run's default is 8 of 1)


class ScalarReads(TorchDispatchMode):
    """Counts reads of tensor values into Python (``aten._local_scalar_dense``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


class StepMarks(PhaseClock):
    """The loop's own clock, noting the read count at each step's end (the boundary lap)."""

    def __init__(self, reads: ScalarReads) -> None:
        super().__init__()
        self.reads, self.marks = reads, []

    def restart(self) -> None:  # the loop starts: what building the DataLoader iterator read is not a step's
        super().restart()
        self.marks = [self.reads.count]

    def lap(self, phase: str) -> None:
        super().lap(phase)
        if phase == "boundary":
            self.marks.append(self.reads.count)


def reads_per_step(run_dir: Path, start_step: int = 0) -> tuple[list[int], dict]:
    """Train ``run_dir`` in this process (no vote: ``run_rank`` attaches it); reads per step, and the summary."""
    trainer, state = build_trainer(load_run(run_dir), 0, torch.device("cpu"))
    reads = ScalarReads()
    trainer.clock = StepMarks(reads)
    state = TrainState(step=start_step, sampler={"consumed_samples": start_step * 8, "epoch": 0})
    with reads:
        result = train(trainer, state)
    marks = trainer.clock.marks
    return [b - a for a, b in zip(marks, marks[1:])], result


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- host syncs


def test_a_masked_step_reads_no_device_value(tmp_path):
    """With a loss mask the count of targets stays a device tensor: a step reads nothing (it read the
    count twice: the per-mask sums and the reduced total)."""
    from trainer.loop import train_step

    run_dir = make_run(tmp_path, "r", "none", 1, ["train.micro_batch=4"])  # two micro-batches
    trainer, _ = build_trainer(load_run(run_dir), 0, torch.device("cpu"))
    batches = iter(trainer.loader)
    masked = [(tokens, torch.rand(tokens.shape) < 0.5) for tokens in (next(batches), next(batches))]
    reads = ScalarReads()
    with reads:
        loss, _ = train_step(trainer, masked)
    assert reads.count == 0 and torch.isfinite(loss)


class Copies(TorchDispatchMode):
    """The ``non_blocking`` flag of every copy to another device."""

    def __init__(self) -> None:
        super().__init__()
        self.flags = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default:
            self.flags.append((kwargs or {}).get("non_blocking", False))
        return func(*args, **(kwargs or {}))


def test_tokens_and_mask_go_to_the_device_without_waiting():
    from trainer.objective import to_device

    tokens, mask = torch.zeros(2, 5, dtype=torch.int64), torch.ones(2, 5, dtype=torch.bool)
    copies = Copies()
    with copies:
        moved = to_device((tokens, mask), torch.device("meta"))
    assert [t.device.type for t in moved] == ["meta", "meta"] and copies.flags == [True, True]


@pytest.mark.parametrize("log_every,steps,warmup,extra", [
    (5, 10, 0, []),
    (3, 7, 2, []),
    (4, 9, 0, ["train.micro_batch=4"]),  # two micro-batches per step
    (10, 12, 3, ["train.grad_clip=0"]),  # no clipping
    (6, 6, 0, ["parallel.mixed_precision='bf16'"]),  # autocast
    (2, 5, 0, ["parallel.mixed_precision='fp16'"]),  # GradScaler + fused AdamW: inf checks stay on the device
])
def test_only_logging_steps_read_device_values_and_only_once(tmp_path, log_every, steps, warmup, extra):
    run_dir = make_run(tmp_path, "r", "none", 1, [ONE_MICRO_BATCH, f"train.log_every={log_every}",
                                                    f"train.steps={steps}", f"train.warmup_metrics_steps={warmup}",
                                                    *extra])
    per_step, _ = reads_per_step(run_dir)
    logged = [s for s in range(1, steps + 1) if s % log_every == 0 or s in (steps, warmup)]
    assert [s for s, n in enumerate(per_step, 1) if n] == logged, per_step
    assert all(per_step[s - 1] == 2 for s in logged), per_step  # loss and norm, from one host copy
    assert [m["step"] for m in metrics(run_dir)] == logged


def test_a_resumed_run_logs_on_the_same_grid(tmp_path):
    run_dir = make_run(tmp_path, "r", "none", 1, [ONE_MICRO_BATCH, "train.log_every=4", "train.steps=10",
                                                    "train.warmup_metrics_steps=0"])
    per_step, result = reads_per_step(run_dir, start_step=5)
    assert per_step == [0, 0, 2, 0, 2]  # steps 6..10: 8 and the last
    assert [m["step"] for m in metrics(run_dir)] == [8, 10] and result["steps"] == 10


# ---------------------------------------------------------------- metrics lines


@pytest.mark.parametrize("step,expected", [(1, False), (2, False), (3, False), (4, True), (5, True), (7, True),
                                           (8, True), (9, False)])
def test_logs_at_every_k_the_warmup_end_and_the_last_step(tmp_path, step, expected):
    trainer, _ = build_trainer(load_run(make_run(tmp_path, "r", "none", 1, [
        "train.log_every=4", "train.steps=7", "train.warmup_metrics_steps=5"])), 0, torch.device("cpu"))
    assert logs_at(trainer, step) is expected


def test_metrics_lines_split_the_step_into_phases(tmp_path):
    run_dir = make_run(tmp_path, "r", "none", 1, ["train.log_every=3", "train.steps=9",
                                                    "train.warmup_metrics_steps=3", "train.micro_batch=4"])
    _, result = reads_per_step(run_dir)
    lines = metrics(run_dir)
    assert [m["step"] for m in lines] == [3, 6, 9]
    for m in lines:
        assert set(m["phases_s"]) == set(PHASES)
        assert sum(m["phases_s"].values()) == pytest.approx(m["step_time_s"])
        assert m["data_s"] == m["phases_s"]["data"]
        assert m["phases_s"]["forward"] > 0 and m["phases_s"]["backward"] > 0 and m["phases_s"]["optimizer"] > 0
        assert m["tokens_per_s"] == pytest.approx(8 * 64 / m["step_time_s"])  # global batch × seq_len
    assert isinstance(lines[0]["grad_norm"], float) and lines[0]["grad_norm"] > 0
    steady = sorted(m["step_time_s"] for m in lines[1:])  # the warm-up line (step 3) is left out
    assert result["step_time_s"] == pytest.approx(sum(steady) / 2)


def test_logged_values_are_the_loss_and_the_norm():
    loss, norm = torch.tensor(2.5), torch.tensor(0.75, dtype=torch.float64)
    assert logged_values(loss, norm, world_size=1) == (2.5, 0.75, {})
    scalars = {"accuracy": torch.tensor(0.5), "aux_loss": torch.tensor(0.125)}
    assert logged_values(loss, norm, 1, scalars) == (2.5, 0.75, {"train_accuracy": 0.5, "train_aux_loss": 0.125})


def test_phase_clock_charges_every_lap_once():
    clock = PhaseClock()
    for phase in ("data", "forward", "backward", "optimizer", "forward", "log", "boundary"):
        clock.lap(phase)
    totals = dict(clock.totals)
    window = clock.take(2)
    assert window == {name: seconds / 2 for name, seconds in totals.items()}
    assert clock.take(1) == dict.fromkeys(PHASES, 0.0)
    clock.restart()
    assert clock.totals == dict.fromkeys(PHASES, 0.0)


# ---------------------------------------------------------------- float settings


def subnormals_survive() -> bool:
    return bool((torch.tensor([SUBNORMAL]) * 1.0 != 0).all())


@pytest.fixture
def kernel_settings(monkeypatch):
    """torch's process-wide kernel choice, restored after the test."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(saved[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1:]


def test_deterministic_sets_what_bit_for_bit_needs_and_off_undoes_it(kernel_settings):
    import os

    set_determinism(True)
    assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and not torch.backends.cudnn.benchmark
    set_determinism(False)
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic


def test_an_exported_cublas_workspace_wins(kernel_settings, monkeypatch):
    import os

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    set_determinism(True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_a_deterministic_run_trains_on_the_cpu_as_without_it(tmp_path, kernel_settings):
    """Every op the built-in model runs has a deterministic kernel (none raises), and on the CPU the
    losses are the same as without the switch."""
    losses = {}
    for on in (False, True):
        run_dir = make_run(tmp_path, f"d{on}", "none", 1, ["train.steps=3", "model.dropout=0.1",
                                                            f"train.deterministic={str(on).lower()}"])
        run = load_run(run_dir)
        set_determinism(run.spec.train.deterministic)
        trainer, state = build_trainer(run, 0, torch.device("cpu"))
        losses[on] = train(trainer, state)["losses"]
    assert losses[True] == losses[False] and len(losses[True]) == 3


def test_a_rank_chooses_its_kernels_before_it_touches_a_device(tmp_path, monkeypatch):
    import trainer.train as train_module

    calls = []

    class Stop(Exception):
        pass

    def joined(*args):
        calls.append("join_job")
        raise Stop

    monkeypatch.setattr(train_module, "set_determinism", lambda on: calls.append(("set_determinism", on)))
    monkeypatch.setattr(train_module, "join_job", joined)
    run_dir = make_run(tmp_path, "r", "none", 1, ["train.deterministic=true"])
    exported = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")
    for name in exported:  # run_rank exports torchrun's variables: restored after this test
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    with pytest.raises(Stop):
        train_module.run_rank(str(run_dir))
    assert calls == [("set_determinism", True), "join_job"]
    assert os.environ["RANK"] == "0" and os.environ["WORLD_SIZE"] == "1" and os.environ["LOCAL_RANK"] == "0"


def test_cpu_training_flushes_subnormals_and_keeps_fp32_matmuls(tmp_path):
    torch.set_flush_denormal(False)
    assert subnormals_survive()
    precision = torch.get_float32_matmul_precision()
    try:
        set_float_math(torch.device("cpu"))
        assert not subnormals_survive()
        assert torch.get_float32_matmul_precision() == precision  # TF32 is a CUDA matter
        torch.set_flush_denormal(False)
        reads_per_step(make_run(tmp_path, "r", "none", 1, [ONE_MICRO_BATCH, "train.steps=1"]))  # train() sets it
        assert not subnormals_survive()
    finally:
        torch.set_flush_denormal(True)  # what every trainer process runs with


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_training_allows_tf32_matmuls():
    previous = torch.get_float32_matmul_precision()
    try:
        set_float_math(torch.device("cuda"))
        assert torch.get_float32_matmul_precision() == "high"
        assert not subnormals_survive()  # CPU work of a GPU job (offloaded AdamW) too
    finally:
        torch.set_float32_matmul_precision(previous)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_steps_sync_only_to_log(tmp_path):
    """On a GPU, CUDA's own sync detector: no sync on a non-logging step, one on a logging step."""
    import warnings

    run_dir = make_run(tmp_path, "r", "none", 1, ["train.log_every=3", "train.steps=7", "train.warmup_metrics_steps=0",
                                                    "train.micro_batch=4"])
    trainer, state = build_trainer(load_run(run_dir), 0, torch.device("cuda"))

    class SyncMarks(PhaseClock):
        def restart(self) -> None:
            super().restart()
            self.marks = [syncs()]

        def lap(self, phase: str) -> None:
            super().lap(phase)
            if phase == "boundary":
                self.marks.append(syncs())

    def syncs() -> int:
        return sum("synchronizing" in str(w.message) for w in seen)

    trainer.clock = SyncMarks()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            train(trainer, state)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    marks = trainer.clock.marks
    assert [b - a for a, b in zip(marks, marks[1:])] == [0, 0, 1, 0, 0, 1, 1]

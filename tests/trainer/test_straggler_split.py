"""One rank's step split (``trainer.straggler.StepSplit``) with an injected clock and an injected gather:
what it counts as work and as wait, what rank 0 writes per interval, when it names a straggler and
when it takes the name back. The real hooks and the real all-gather: tests/trainer/test_straggler_gloo.py."""

from __future__ import annotations

import logging

import pytest

from hpc.core import straggler
from hpc.core.straggler import Judge
from trainer.straggler import StepSplit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Lines:
    def __init__(self) -> None:
        self.lines: list[dict] = []

    def write(self, record: dict) -> None:
        self.lines.append(record)


def split_of(tmp_path, clock, peers, rank=0, every=2, intervals=2, lines=None):
    """Rank ``rank`` of two; ``peers``: the other rank's [compute, wait] per interval, in turn."""
    def gather(pair, world):
        other = peers.pop(0)
        return [pair, other] if rank == 0 else [other, pair]
    return StepSplit(tmp_path, rank, 2, "9.0", every, Judge(1.5, intervals), metrics=lines, host="a", clock=clock,
                     gather=gather, gather_hosts=lambda host, world: ["a", "b"])


def step(split, clock, forward, waited, after=0.0, boundary=0.0, number=1):
    """One step: ``forward`` s of compute up to the last gradient, ``waited`` s in the gradient sync,
    ``after`` s of optimizer, then ``boundary`` s of log/save/eval (not the rank's own step)."""
    clock.now += forward
    split._grad_ready(None)
    clock.now += waited
    split.synced()
    clock.now += after
    split.worked()
    clock.now += boundary
    split.boundary(number)


def test_work_less_the_sync_wait_is_compute_and_the_boundary_is_neither(tmp_path):
    clock, lines = Clock(), Lines()
    split = split_of(tmp_path, clock, [[2.0, 0.0]], lines=lines)
    split.boundary(0)
    step(split, clock, 1.0, 3.0, after=0.5, boundary=7.0, number=1)
    step(split, clock, 1.0, 1.0, after=0.5, boundary=0.0, number=2)
    (line,) = lines.lines
    assert line["ranks"]["compute_s"] == [1.5, 1.0] and line["ranks"]["wait_s"] == [2.0, 0.0]
    assert line["ranks"]["steps"] == 2 and line["step"] == 2
    assert split.work_spans == split.wait_spans == [] and split.steps == 0  # the next interval starts from nothing


def test_no_step_is_measured_before_the_first_boundary_and_a_no_sync_backward_waits_nothing(tmp_path):
    clock, lines = Clock(), Lines()
    split = split_of(tmp_path, clock, [[0.0, 0.0]], every=1, lines=lines)
    clock.now += 50.0  # start-up, resume: no boundary yet
    split.worked()
    split.synced()  # a backward without a gradient hook since (nothing to wait for)
    assert split.work_spans == split.wait_spans == [] and split.steps == 0
    split.boundary(1)
    assert lines.lines == []  # gathered (every rank does), but an interval without a measured step says nothing


def test_a_slow_rank_is_named_after_the_warmup_interval_and_k_intervals_then_unnamed(tmp_path, caplog):
    clock, lines = Clock(), Lines()
    slow, even = [3.0, 0.0], [1.0, 0.0]
    split = split_of(tmp_path, clock, [slow, slow, slow, slow, even], every=1, lines=lines)
    split.boundary(0)
    with caplog.at_level(logging.WARNING, logger="hpcx.trainer"):
        for n in range(1, 3):  # the first interval is the start's warm-up: not judged
            step(split, clock, 1.0, 0.0, number=n)
        assert straggler.read(tmp_path)["stragglers"] == []  # the start's (empty) verdict replaces an older one
        step(split, clock, 1.0, 0.0, number=3)
        assert straggler.read(tmp_path)["stragglers"] == [{"rank": 1, "host": "b", "intervals": 2, "ratio": 3.0}]
        step(split, clock, 1.0, 0.0, number=4)
        found = straggler.read(tmp_path)
        assert found["stragglers"] == [{"rank": 1, "host": "b", "intervals": 3, "ratio": 3.0}]
        assert found["incarnation"] == "9.0" and found["step"] == 4
        step(split, clock, 1.0, 0.0, number=5)
    assert straggler.read(tmp_path)["stragglers"] == []
    assert straggler.of_start(tmp_path, "9.0") == [{"rank": 1, "host": "b", "intervals": 3, "ratio": 3.0}]
    warned = [r.getMessage() for r in caplog.records]
    assert warned == ["straggler: rank 1 on b, 3.0× the median over the last 2 intervals (at step 3)",
                      "straggler report: rank 1 is no longer slower than the others (at step 5)"]
    assert [r["ranks"]["ratio"][1] for r in lines.lines] == [3.0, 3.0, 3.0, 3.0, 1.0]


def test_other_ranks_gather_but_write_nothing(tmp_path):
    clock = Clock()
    split = split_of(tmp_path, clock, [[1.0, 0.0]] * 3, rank=1, every=1)
    split.boundary(0)
    for n in range(1, 4):
        step(split, clock, 5.0, 0.0, number=n)
    assert straggler.read(tmp_path) == {} and split.hosts == ["a", "b"]


@pytest.mark.parametrize("every,gathers", [(0, 0), (1, 6), (3, 2), (7, 0)])
def test_the_interval_is_every_n_steps_and_0_is_off(tmp_path, every, gathers):
    clock, calls = Clock(), []
    split = StepSplit(tmp_path, 0, 2, "9.0", every, Judge(), clock=clock, gather_hosts=lambda h, w: ["a", "b"],
                      gather=lambda pair, world: calls.append(pair) or [pair, pair])
    split.boundary(0)
    for n in range(1, 7):
        step(split, clock, 1.0, 0.0, number=n)
    assert len(calls) == gathers


# ---------------------------------------------------------------- a GPU's moments: device events, read per interval


class Event:
    """A stand-in for ``torch.cuda.Event(enable_timing=True)``: its time is the device's when the stream
    reaches it (``device.now`` at ``record``), readable only after a synchronize."""

    def __init__(self, device: "Device") -> None:
        self.device, self.at = device, None

    def record(self) -> None:
        self.device.pending.append(self)

    def elapsed_time(self, end: "Event") -> float:
        assert self.at is not None and end.at is not None, "read before the device passed both events"
        return (end.at - self.at) * 1000.0


class Device:
    """The device's own timeline: events complete in stream order at ``run``; synchronize runs it all."""

    def __init__(self) -> None:
        self.now, self.pending, self.syncs = 0.0, [], 0

    def run(self, seconds: float) -> None:
        self.now += seconds
        for event in self.pending:
            event.at = self.now
        self.pending = []

    def synchronize(self) -> None:
        self.syncs += 1
        self.run(0.0)


def test_on_a_gpu_the_split_is_the_devices_timeline_read_once_per_interval(tmp_path):
    """The host enqueues a whole step at once (its clock would see no wait at all); the device runs 1 s of
    compute up to the last gradient, then waits 3 s in DDP's all-reduce for a slow peer."""
    from trainer.straggler import DeviceMarks

    device, lines = Device(), Lines()
    split = split_of(tmp_path, Clock(), [[4.0, 0.0]], every=1, lines=lines)
    split.marks = DeviceMarks(lambda: Event(device), device.synchronize)
    split.boundary(0)
    device.run(0.0)  # the boundary's event: the stream is there now
    split._grad_ready(None)  # recorded behind the backward kernels
    device.run(1.0)
    split.synced()  # behind the all-reduce the compute stream waits for
    device.run(3.0)
    split.worked()
    assert device.syncs == 0 and split.work_spans  # nothing read yet: the host never waited
    split.boundary(1)  # the interval: one synchronize, then every span is the device's
    (line,) = lines.lines
    assert device.syncs == 1 and line["ranks"]["compute_s"][0] == pytest.approx(1.0)
    assert line["ranks"]["wait_s"][0] == pytest.approx(3.0)


def test_the_marks_follow_the_models_device():
    import torch

    from trainer.straggler import DeviceMarks, HostMarks, marks_for

    assert isinstance(marks_for(torch.device("cpu")), HostMarks) and isinstance(marks_for(None), HostMarks)
    assert isinstance(marks_for(torch.device("cuda", 0)), DeviceMarks)  # built lazily: no CUDA needed here
    assert HostMarks(lambda: 5.0).seconds(2.0, 5.0) == 3.0


@pytest.mark.gpu
def test_cuda_events_time_a_kernel_on_the_device():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from trainer.straggler import marks_for

    marks = marks_for(torch.device("cuda", 0))
    a = torch.randn(4096, 4096, device="cuda")
    start = marks.mark()
    for _ in range(10):
        a = a @ a / 64
    end = marks.mark()
    marks.settle()
    assert 0 < marks.seconds(start, end) < 60

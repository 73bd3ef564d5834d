"""The hang watchdog (``trainer.watchdog``) with an injected clock: when it is armed, what its timeout is,
that saves and evaluations are not hangs, and what the ranks that fire write and decide. Real files and a
real faulthandler dump; the SIGSTOP of a real rank runs on the sandbox (tests/slurm/test_health_slurm.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc.core import health
from hpc.core.health import Health
from trainer.watchdog import Watchdog, main_thread_place


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 0.01)


def dog(run: Path, clock: Clock, rank: int = 0, world: int = 2, fired: list | None = None, **settings) -> Watchdog:
    out = fired if fired is not None else []
    return Watchdog(run, rank, world, "77.0", Health(**settings), 120.0, on_fire=out.append, host=f"n{rank + 1}",
                    clock=clock, wall=clock, sleep=clock.sleep)


def steps(w: Watchdog, clock: Clock, seconds: list[float], first: int = 1) -> None:
    for i, s in enumerate(seconds):
        clock.now += s
        w.beat(first + i)


# ---------------------------------------------------------------- the timeout


def test_it_is_armed_once_one_interval_was_measured(tmp_path):
    clock = Clock()
    w = dog(tmp_path, clock)
    assert w.timeout() is None and not w.due()
    clock.now += 10_000  # start-up, resume, the first step: the long collective timeout's business
    assert w.timeout() is None and not w.due()
    steps(w, clock, [500.0])  # the first boundary: no interval yet
    assert w.timeout() is None and not w.due()
    steps(w, clock, [2.0], first=2)
    assert w.timeout() == 60.0  # the floor: 10 × 2 s is below it


def test_the_automatic_timeout_is_the_median_step_times_the_factor_below_the_collective_timeout(tmp_path):
    clock = Clock()
    w = dog(tmp_path, clock, hang_factor=4, hang_floor_s=5)
    steps(w, clock, [9.0, 2.0, 3.0, 2.5, 40.0])
    assert w.timeout() == pytest.approx(4 * 2.75)  # the median of 2, 3, 2.5, 40
    steps(w, clock, [20.0] * 9, first=6)
    assert w.timeout() == pytest.approx(80.0)  # 4 × 20 s, below the cap (0.9 × 120 s = 108 s)
    steps(w, clock, [50.0] * 20, first=15)
    assert w.timeout() == pytest.approx(0.9 * 120)  # 4 × 50 s would be after the collective timeout


def test_a_given_timeout_is_used_from_the_first_boundary(tmp_path):
    clock = Clock()
    w = dog(tmp_path, clock, hang_timeout_s=30)
    assert w.timeout() is None
    steps(w, clock, [100.0])
    assert w.timeout() == 30
    clock.now += 29
    assert not w.due()
    clock.now += 2
    assert w.due()


def test_no_boundary_for_longer_than_the_timeout_fires_and_a_step_boundary_resets_it(tmp_path):
    clock = Clock()
    w = dog(tmp_path, clock, hang_floor_s=10, hang_factor=2)
    steps(w, clock, [1.0, 1.0, 1.0])
    clock.now += 9.5
    assert not w.due()
    w.beat(4)
    clock.now += 9.5
    assert not w.due()
    clock.now += 1
    assert w.due()


def test_a_long_save_or_evaluation_is_not_a_hang_and_is_not_measured(tmp_path):
    clock = Clock()
    w = dog(tmp_path, clock, hang_floor_s=10, hang_factor=2)
    steps(w, clock, [1.0, 1.0, 1.0])
    with w.suspended():
        clock.now += 500
        assert not w.due()
        with w.suspended():  # nested: an evaluation's save
            clock.now += 100
        assert not w.due()
    assert not w.due()  # the wait starts again when the suspension ends
    clock.now += 2
    w.beat(4)
    assert w.intervals == [1.0, 1.0]  # the interval holding the save is left out
    clock.now += 11
    assert w.due()


def write_beat(run: Path, rank: int, time: float, incarnation: str = "77.0", step: int = 3) -> None:
    health.beats_dir(run).mkdir(exist_ok=True)
    health.write_json_atomic(health.beats_dir(run) / f"rank-{rank}.json", {
        "rank": rank, "host": f"n{rank + 1}", "pid": 4242, "step": step, "time": time, "incarnation": incarnation})


@pytest.mark.parametrize("rank,world,neighbour", [(0, 2, 1), (1, 2, 0), (3, 8, 4), (7, 8, 0), (1023, 1024, 0)])
def test_a_save_that_waits_on_a_silent_neighbour_fires_after_the_timeout(tmp_path, rank, world, neighbour):
    clock = Clock()
    w = dog(tmp_path, clock, rank, world, hang_timeout_s=30)
    steps(w, clock, [1.0, 1.0])
    write_beat(tmp_path, neighbour, clock.now)  # its last word: at the boundary before the save
    with w.suspended():
        clock.now += 29
        assert not w.due()  # within the timeout: a save may rightly take that long
        clock.now += 2
        assert w.due() and w.silent == neighbour  # 31 s without a heartbeat from the next rank around the ring
    assert not w.due()  # the save ended after all: the step clock starts again


@pytest.mark.parametrize("beat", [
    "fresh",  # alive and writing: a long save is no hang
    "other start",  # a heartbeat of an earlier start says nothing of this one
    "none",  # never written (or unreadable): no evidence
    "torn",
    "no time",
    "other rank",  # the file of rank 1 holds another rank's record
])
def test_a_long_save_beside_a_neighbour_not_known_silent_is_not_a_hang(tmp_path, beat):
    clock = Clock()
    w = dog(tmp_path, clock, 0, 2, hang_timeout_s=30)
    steps(w, clock, [1.0, 1.0])
    path = health.beats_dir(tmp_path) / "rank-1.json"
    with w.suspended():
        for _ in range(100):  # 500 s of save
            clock.now += 5
            if beat == "fresh":
                write_beat(tmp_path, 1, clock.now)
            elif beat == "other start":
                write_beat(tmp_path, 1, 0.0, incarnation="77.1")
            elif beat == "torn":
                health.beats_dir(tmp_path).mkdir(exist_ok=True)
                path.write_text('{"rank": 1, "time"')
            elif beat == "no time":
                write_beat(tmp_path, 1, 0.0)
                path.write_text(json.dumps({**json.loads(path.read_text()), "time": None}))
            elif beat == "other rank":
                write_beat(tmp_path, 1, 0.0)
                path.write_text(json.dumps({**json.loads(path.read_text()), "rank": 5}))
            assert not w.due()


def test_the_silence_must_also_outlast_a_few_heartbeats(tmp_path):
    """With a timeout shorter than the heartbeat's period, a neighbour is silent only after ``SILENT_S``."""
    from trainer.watchdog import SILENT_S

    clock = Clock()
    w = dog(tmp_path, clock, 0, 2, hang_timeout_s=4)
    steps(w, clock, [1.0, 1.0])
    write_beat(tmp_path, 1, clock.now)
    with w.suspended():
        clock.now += SILENT_S - 0.5
        assert not w.due()
        clock.now += 1
        assert w.due()


def test_a_single_rank_never_waits_on_a_neighbour(tmp_path):
    clock = Clock()
    w = dog(tmp_path, clock, 0, 1, hang_timeout_s=10)
    steps(w, clock, [1.0, 1.0])
    with w.suspended():
        clock.now += 10_000
        assert not w.due()


def test_a_suspended_rank_joins_a_firing_after_half_its_timeout(tmp_path):
    clock = Clock()
    w = dog(tmp_path, clock, 2, 4, hang_timeout_s=30)
    steps(w, clock, [1.0, 1.0])
    with w.suspended():
        health.hang_dir(tmp_path, "77.0").mkdir(parents=True)  # rank 1 found rank 0 silent and fired
        clock.now += 14
        assert not w.due()
        clock.now += 2
        assert w.due() and w.silent is None  # it answers, so that it is not named hung


def test_the_thread_keeps_the_heartbeat_fresh_while_no_boundary_comes(tmp_path):
    clock = Clock()
    w = dog(tmp_path, clock, 1, 2, hang_timeout_s=30)
    w.keep_alive()
    assert health.read_beats(tmp_path) == {}  # not before the first step boundary (nothing to aim at yet)
    steps(w, clock, [1.0])
    written = health.read_beat(tmp_path, 1)["time"]
    with w.suspended():
        clock.now += 3
        w.keep_alive()
        assert health.read_beat(tmp_path, 1)["time"] == written  # at most every few seconds
        clock.now += 3
        w.keep_alive()
        beat = health.read_beat(tmp_path, 1)
        assert beat["time"] == clock.now and beat["step"] == 1  # alive, still at the same boundary


def test_real_threads_a_stopped_rank_during_a_save_is_found_by_its_neighbour(tmp_path, monkeypatch):
    """Two watchdogs on real threads and the real clock: rank 1 reaches a boundary, then is stopped (its
    thread never runs); rank 0 waits in a save; rank 0 fires naming rank 1. Nothing timed is asserted."""
    import threading
    import time

    import trainer.watchdog as watchdog

    monkeypatch.setattr(watchdog, "SILENT_S", 0.5)
    monkeypatch.setattr(watchdog, "BEAT_EVERY_S", 0.1)
    fired: list[dict] = []
    done = threading.Event()
    w0 = Watchdog(tmp_path, 0, 2, "77.0", Health(hang_timeout_s=1), 120.0,
                  on_fire=lambda verdict: (fired.append(verdict), done.set()), poll_s=0.05)
    w1 = Watchdog(tmp_path, 1, 2, "77.0", Health(hang_timeout_s=1), 120.0, on_fire=fired.append)
    w0.beat(1)
    w1.beat(1)  # rank 1's last word; its thread is never started (SIGSTOP)
    with w0.suspended():
        w0.start()
        try:
            assert done.wait(120), "rank 0's watchdog never fired"
        finally:
            w0.stop()
    assert fired[0]["ranks"] == [1] and fired[0]["node_fault"]
    assert fired[0]["error"].startswith("hang at step 2, rank 1 (last seen in no answer to the watchdog")
    assert time.time() - health.read_beat(tmp_path, 0)["time"] < 60  # rank 0's thread kept its own beat fresh


def test_a_rank_that_waited_half_its_timeout_joins_one_that_fired(tmp_path):
    clock = Clock()
    w = dog(tmp_path, clock, hang_floor_s=10, hang_factor=2)
    steps(w, clock, [1.0, 1.0])
    clock.now += 6
    assert not w.due()
    health.hang_dir(tmp_path, "77.0").mkdir(parents=True)  # another rank fired
    assert w.due()
    clock.now -= 2  # only 4 s waited: not yet half
    assert not w.due()


# ---------------------------------------------------------------- the heartbeat


def test_heartbeats_reach_the_run_folder_every_few_seconds_with_where_to_find_the_rank(tmp_path):
    clock = Clock()
    w = dog(tmp_path, clock, rank=3, world=4)
    steps(w, clock, [1.0, 1.0])
    beat = health.read_beats(tmp_path)[3]
    assert beat["step"] == 1 and beat["host"] == "n4" and beat["incarnation"] == "77.0" and beat["pid"] > 0
    steps(w, clock, [6.0], first=3)
    assert health.read_beats(tmp_path)[3]["step"] == 3
    (tmp_path / "health" / "rank-9.json").write_text("{torn")
    assert set(health.read_beats(tmp_path)) == {3}


# ---------------------------------------------------------------- firing


def test_the_ranks_that_answer_dump_their_stacks_and_the_lowest_names_the_silent_one(tmp_path):
    clock = Clock()
    fired: list[dict] = []
    w0, w1 = dog(tmp_path, clock, 0, 3, fired), dog(tmp_path, clock, 1, 3, fired)
    silent = dog(tmp_path, clock, 2, 3)
    for w in (w0, w1, silent):
        steps(w, clock, [1.0, 1.0], first=5)
    w1.hang_folder.mkdir(parents=True)
    w1._dump()  # rank 1 answered first; rank 2 never does (stopped)
    w0.fire()
    verdict = fired[0]
    assert verdict["ranks"] == [2] and verdict["rank"] == 2 and verdict["host"] == "n3" and verdict["node_fault"]
    assert verdict["error"].startswith("hang at step 7, rank 2 (last seen in no answer to the watchdog")
    assert "its last heartbeat was at step 5" in verdict["error"]  # written at most every 5 s
    folder = w0.hang_folder
    stacks = (folder / "rank-0.stacks.txt").read_text()
    assert "rank 0 on n1" in stacks and "test_the_ranks_that_answer_dump_their_stacks" in stacks
    assert json.loads((folder / "hang.json").read_text())["ranks"] == [2]
    report = json.loads((tmp_path / "requeue" / "77.0.rank-2.json").read_text())
    assert report["node_fault"] and report["hang"]["step"] == 7 and report["error"] == verdict["error"]
    w1.fire()  # not the lowest answering rank: ends with the verdict rank 0 wrote
    assert fired[1]["ranks"] == [2] and not (tmp_path / "requeue" / "77.0.rank-1.json").exists()


def test_a_rank_that_answers_alone_after_the_grace_period_decides(tmp_path):
    clock = Clock()
    fired: list[dict] = []
    w1 = dog(tmp_path, clock, 1, 2, fired, hang_timeout_s=40)
    steps(w1, clock, [1.0], first=3)
    start = clock.now
    w1.fire()
    assert fired[0]["ranks"] == [0] and 10 <= clock.now - start <= 11  # grace: a quarter of 40 s
    assert w1.grace_s() == 10


@pytest.mark.parametrize("answers,beats,ranks,fault", [
    ({0: {"step": 5}, 1: {"step": 5}}, {2: {"step": 5, "host": "n2"}}, [2], True),
    ({0: {"step": 5}}, {}, [1, 2], True),
    ({0: {"step": 5, "collective": "all_reduce"}, 1: {"step": 4, "collective": "broadcast"},
      2: {"step": 5, "collective": "all_reduce"}}, {}, [1], False),
    ({0: {"step": 5, "collective": "all_reduce"}, 1: {"step": 5, "collective": ""},
      2: {"step": 5, "collective": "all_reduce"}}, {}, [1], False),  # stuck outside a collective: the culprit
    ({0: {"step": 5, "collective": "all_reduce"}, 1: {"step": 5, "collective": "all_reduce"},
      2: {"step": 5, "collective": "all_reduce"}}, {}, [0, 1, 2], False),
])
def test_which_ranks_hung(answers, beats, ranks, fault):
    verdict = health.hang_verdict(3, answers, beats)
    assert verdict["ranks"] == ranks and verdict["node_fault"] is fault and verdict["rank"] == ranks[0]


def test_where_the_main_thread_is():
    where, collective = main_thread_place()
    assert "test_where_the_main_thread_is" in where or "main_thread_place" in where
    assert collective == ""


def test_where_nobody_ends_the_step_the_hung_ranks_of_this_start_on_this_host_are_killed(tmp_path):
    import os
    import subprocess

    from trainer.watchdog import end_hung

    here = os.uname().nodename
    hung, stale, elsewhere = (subprocess.Popen(["sleep", "60"]) for _ in range(3))
    try:
        folder = health.beats_dir(tmp_path)
        folder.mkdir()
        for rank, proc, host, inc in ((1, hung, here, "5.0"), (2, stale, here, "4.0"), (3, elsewhere, "n9", "5.0")):
            (folder / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "host": host, "pid": proc.pid,
                                                                  "incarnation": inc}))
        end_hung(tmp_path, {"ranks": [1, 2, 3], "incarnation": "5.0"})
        assert hung.wait(timeout=30) == -9
        assert stale.poll() is None and elsewhere.poll() is None  # another start's pid; another host's
    finally:
        for proc in (hung, stale, elsewhere):
            proc.kill()
            proc.wait()


def test_real_processes_a_rank_stopped_before_the_teardown_barrier_is_named(tmp_path):
    """Two gloo processes with real watchdogs: rank 1 stops itself after its last step; rank 0 waits in the
    teardown barrier (``trainer.dist.shutdown`` under the watchdog's suspension, as ``trainer.train`` calls it)
    and its watchdog names rank 1, long before the barrier's 600 s. Nothing timed is asserted."""
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import REPO

    script = str(REPO / "tests" / "resilience" / "teardown_stop.py")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, script, str(r), str(tmp_path / "init"), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in (0, 1)]
    try:
        out0, _ = procs[0].communicate(timeout=300)
        assert procs[0].returncode == 7, out0.decode()[-3000:]  # rank 0's watchdog fired
        verdict = json.loads((tmp_path / "fired-0.json").read_text())
        assert verdict["ranks"] == [1] and verdict["node_fault"], verdict
        assert verdict["error"].startswith("hang at step 3, rank 1 (last seen in no answer to the watchdog")
        assert procs[1].poll() is None  # still stopped: the scheduler (or end_hung) ends it
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()

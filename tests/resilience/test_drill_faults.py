"""``hpcx drill --hang/--slow/--fail-node`` (``hpc.login.drill``): bad options are one line, each fault is
the right command at the right process, and the slow loop really stops and continues a process. The
faults on a running job: the local site here (test_a_local_rank_that_hangs…), the sandbox in
tests/slurm/test_health_slurm.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hpc.core import health
from hpc.login.drill import SLOW_LOOP, current_beats, fault_commands
from tests.conftest import REPO, hpcx
from tests.resilience.resilience_lib import ledger, losses_by_step, submit, wait_state


@pytest.fixture
def run(tmp_path: Path) -> Path:
    folder = tmp_path / "run-1"
    folder.mkdir()
    (folder / "resolved.json").write_text(json.dumps({"spec": {}, "launch": {"world_size": 2}}))
    (folder / "job.json").write_text(json.dumps({"job_id": "1", "scheduler": "local"}))
    return folder


@pytest.mark.parametrize("args,words", [
    (["--hang", "2"], "error: --hang '2': expected a rank of this run, 0 to 1"),
    (["--slow", "-1"], "error: --slow '-1': expected a rank of this run, 0 to 1"),
    (["--hang", "x"], "error: --hang 'x': expected a rank of this run, 0 to 1"),
    (["--hang", "0", "--slow", "1"], "error: --hang and --slow: expected one fault per drill"),
    (["--slow", "0", "--fail-node"], "error: --slow and --fail-node: expected one fault per drill"),
    (["--slow", "0", "--for", "0"], "Invalid value for '--for'"),
])
def test_a_bad_fault_is_one_line_and_exit_2(run, args, words):
    out = hpcx("drill", str(run), *args)
    assert out.returncode == 2 and words in out.stderr and "Traceback" not in out.stderr


BEATS = {0: {"rank": 0, "host": "n1", "pid": 11}, 1: {"rank": 1, "host": "n1", "pid": 12},
         2: {"rank": 2, "host": "n2", "pid": 21}, 3: {"rank": 3, "host": "n2", "pid": 22}}


def test_each_fault_is_a_command_on_the_ranks_node():
    assert fault_commands("hang", 2, BEATS, 60) == [("n2", ["kill", "-STOP", "21"], True)]
    assert fault_commands("fail_node", 3, BEATS, 60) == [("n2", ["kill", "-KILL", "21", "22"], True)]
    assert fault_commands("fail_node", 0, BEATS, 60) == [("n1", ["kill", "-KILL", "11", "12"], True)]
    ((host, argv, wait),) = fault_commands("slow", 1, BEATS, 90)
    assert host == "n1" and argv[:3] == ["sh", "-c", SLOW_LOOP] and argv[4:] == ["12", "90", "0.5", "0.5"]
    assert not wait  # the loop outlives the drill


def test_only_the_heartbeats_of_the_current_start_count(run):
    (run / "ledger.jsonl").write_text(json.dumps({"event": "start", "time": 1000.0}) + "\n")
    folder = health.beats_dir(run)
    folder.mkdir()
    for rank, when in ((0, 1005.0), (1, 900.0)):  # rank 1's is from the previous start
        (folder / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "host": "n1", "pid": 5, "time": when}))
    assert set(current_beats(run)) == {0}
    (run / "ledger.jsonl").unlink()
    assert current_beats(run) == {}  # not started: nothing to aim at


def state_of(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_the_slow_loop_stops_and_continues_a_real_process_and_leaves_it_running():
    victim = subprocess.Popen(["sleep", "60"])
    try:
        loop = subprocess.Popen(["sh", "-c", SLOW_LOOP, "hpcx-slow", str(victim.pid), "2", "0.3", "0.3"])
        seen = set()
        while loop.poll() is None:
            seen.add(state_of(victim.pid))
            time.sleep(0.05)
        assert "T" in seen and seen - {"T"}  # stopped, and running (sleeping) in between
        assert state_of(victim.pid) != "T" and victim.poll() is None  # continued at the end, alive
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.parametrize("sent, loop_goes_on", [(signal.SIGUSR2, True), (signal.SIGTERM, False),
                                                (signal.SIGINT, False), (signal.SIGHUP, False)])
def test_a_signal_to_the_slow_loops_step_never_leaves_the_rank_stopped(sent, loop_goes_on):
    """The scheduler signals every process of the drill's own step (``scancel --signal=USR2`` a preemption,
    SIGTERM a cancel), the loop's ``sleep`` too: the rank is continued whatever comes; the preemption signal
    leaves the loop running."""
    victim = subprocess.Popen(["sleep", "120"])
    try:
        loop = subprocess.Popen(["sh", "-c", SLOW_LOOP, "hpcx-slow", str(victim.pid), "60", "0.4", "0.2"],
                                start_new_session=True)  # its own group, as a step's processes are
        while state_of(victim.pid) != "T":
            time.sleep(0.02)
        os.killpg(loop.pid, sent)  # while the rank is stopped
        if loop_goes_on:
            seen = set()
            for _ in range(60):
                seen.add(state_of(victim.pid))
                time.sleep(0.05)
            assert loop.poll() is None and "T" in seen and seen - {"T"}  # still slowing it, and continuing it
            os.killpg(loop.pid, signal.SIGTERM)
        loop.wait(timeout=30)
        time.sleep(0.1)
        assert state_of(victim.pid) != "T" and victim.poll() is None  # continued, alive
    finally:
        victim.kill()
        victim.wait()


def test_a_local_rank_that_hangs_is_named_and_the_job_resumes(tmp_path):
    """The first start trains slowly (0.1 s a forward call) until the drill landed, so that the SIGSTOP reaches
    rank 1 while it trains, however loaded the machine: a tiny job's 16 steps take 0.3 s, and a stop after
    the last step holds a job whose watchdog has ended. It may land in a save (every 3 steps): rank 0 then
    finds its neighbour silent (tests/resilience/test_watchdog.py)."""
    landed = tmp_path / "landed"
    folder = submit(str(REPO / "jobs" / "tiny-ddp.toml"), "job.name=local-hang", "train.steps=16", "train.log_every=1",
                    "checkpoint.interval_steps=3", "health.hang_timeout_s=8", "job.time_limit_min=10",
                    'model.arch="tests.slurm.slow_model:build"', "model.seq_len=64", "model.vocab_size=256",
                    f"model.kwargs={{sleep_s = 0.1, until = {json.dumps(str(landed))}}}")
    out = hpcx("drill", str(folder), "--at-step", "5", "--hang", "1", timeout=300)
    landed.touch()
    assert out.returncode == 0 and "hang at rank 1" in out.stdout, out.stderr
    final = wait_state(folder, ("COMPLETED", "FAILED", "CANCELLED"), timeout=400)
    assert final["state"] == "COMPLETED", (folder / "logs" / "rank-0.log").read_text()[-3000:]
    start0, stop0, start1, stop1 = ledger(folder)
    assert stop0["reason"] == "failed" and stop0["requeued"] and "hang at step" in stop0["error"]
    assert "rank 1 (last seen in no answer" in stop0["error"]
    assert stop1["reason"] == "completed" and sorted(losses_by_step(folder)) == list(range(1, 17))

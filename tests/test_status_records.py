"""What `hpcx status` says from the run folder when nobody else can: how a run ended with the scheduler
unreachable, a job.json not yet (or half) written, the last stop's cause (time limit, preemption,
failure), only the caller's own runs of a shared run root, and no error for a folder it cannot read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc.core import runs
from hpc.core.config import ConfigError
from hpc.login import submit
from hpc.schedulers.base import UNREACHABLE
from tests.conftest import REPO
from tests.test_slurm_vars import bogus_conf, fake_runs, site_path_with

STOP = {"event": "stop", "step": 40, "job_id": "990000"}


def ledger(run: Path, *lines: dict) -> None:
    (run / "ledger.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.fixture
def down(tmp_path, monkeypatch) -> Path:
    """A run root of Slurm runs and a cluster that does not answer."""
    monkeypatch.setenv("SLURM_CONF", str(bogus_conf(tmp_path)))
    return tmp_path / "runs"


@pytest.mark.parametrize("lines,state", [
    ([{"event": "start"}, {**STOP, "reason": "failed", "requeued": False}], "FAILED"),
    ([{"event": "start"}, {**STOP, "reason": "time_limit", "requeued": False}], "TIMEOUT"),
    ([{"event": "start"}, {**STOP, "reason": "terminated", "requeued": False}], "CANCELLED"),
    ([{"event": "start"}, {**STOP, "reason": "completed", "requeued": False}], "COMPLETED"),
    ([{"event": "start"}, {**STOP, "reason": "preempted", "requeued": False}], "FAILED"),
    ([{"event": "start"}, {**STOP, "reason": "failed", "requeued": True}], "UNKNOWN"),  # queued again, maybe
    ([{"event": "start"}, {**STOP, "reason": "time_limit", "requeued": True}], "UNKNOWN"),
    ([{"event": "start"}], "UNKNOWN"),  # running when last seen
])
def test_an_unreachable_scheduler_leaves_the_recorded_end(down, lines, state):
    (run,) = fake_runs(down, 1)
    ledger(run, *lines)
    got = submit.job_states([run], timeout=10)[run]
    assert got.state == state
    if state == "UNKNOWN":
        assert got.words == f"unknown ({UNREACHABLE})"
    else:
        assert got.words == f"{state} (recorded in the run folder; {UNREACHABLE})" and got.done


def test_without_a_ledger_the_last_recorded_end_state_counts(down):
    ended, running = fake_runs(down, 2)
    (ended / "states.jsonl").write_text("".join(json.dumps({"state": s}) + "\n" for s in ("RUNNING", "TIMEOUT")))
    states = submit.job_states([ended, running], timeout=10)
    assert states[ended].state == "TIMEOUT" and states[running].state == "UNKNOWN"


def test_the_list_shows_recorded_ends_when_the_cluster_is_down(tmp_path):
    root = tmp_path / "runs"
    failed, timed_out, live = fake_runs(root, 3)
    ledger(failed, {"event": "start"}, {**STOP, "reason": "failed", "requeued": False, "error": "ValueError: x",
                                        "not_requeued": "job.max_requeues = 0 reached"})
    ledger(timed_out, {"event": "start"}, {**STOP, "reason": "time_limit", "requeued": False,
                                           "not_requeued": "job.max_requeues = 1 reached"})
    env = {**os.environ, **site_path_with(tmp_path, root), "SLURM_CONF": str(bogus_conf(tmp_path))}
    out = subprocess.run([sys.executable, "-m", "hpc.cli", "status", "--json"], capture_output=True, text=True,
                         env=env, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    rows = {Path(r["run_dir"]).name: r for r in json.loads(out.stdout)}
    assert rows[failed.name]["state"] == "FAILED" and rows[timed_out.name]["state"] == "TIMEOUT"
    assert rows[live.name]["state"] == "UNKNOWN"
    assert rows[failed.name]["last_stop"]["words"] == ("failed at step 40: ValueError: x (not requeued: "
                                                       "job.max_requeues = 0 reached)")
    assert rows[timed_out.name]["last_stop"]["words"].startswith("time limit at step 40 (not requeued")


@pytest.mark.parametrize("stop,words", [
    ({"reason": "time_limit", "step": 7, "requeued": True}, "time limit at step 7 (requeued)"),
    ({"reason": "preempted", "step": 7, "requeued": True}, "preempted at step 7 (requeued)"),
    ({"reason": "failed", "step": 3, "requeued": False, "error": "ModuleNotFoundError: No module named 'm'",
      "not_requeued": "it would fail the same way"},
     "failed at step 3: ModuleNotFoundError: No module named 'm' (not requeued: it would fail the same way)"),
    ({"reason": "terminated", "step": 9, "requeued": False}, "cancelled at step 9"),
    ({"reason": "completed", "step": 20, "requeued": False}, "completed at step 20"),
])
def test_the_last_stop_in_words(stop, words):
    assert submit.stop_summary(stop)["words"] == words


# ---------------------------------------------------------------- job.json: not yet, or half, written


def young_run(root: Path, name: str = "young") -> Path:
    run = root / name
    (run / "submitit").mkdir(parents=True)
    (run / "resolved.json").write_text(json.dumps({"site": {"scheduler": {"kind": "slurm"}}, "launch": {}}))
    return run


@pytest.mark.parametrize("job_json", [None, "", '{"job_id": "12', '{"job_id": "12", "sched', "\0\0\0\0"])
def test_a_job_json_being_written_is_submitting_never_not_submitted(tmp_path, job_json):
    run = young_run(tmp_path)
    if job_json is not None:
        (run / "job.json").write_text(job_json)
    assert submit.job_states([run], timeout=5)[run].state == "SUBMITTING"
    assert submit.summaries([run], timeout=5)[0]["state_words"] == "SUBMITTING (no job.json yet)"


def test_the_job_id_submitit_already_wrote_is_used_until_job_json_exists(tmp_path, monkeypatch):
    run = young_run(tmp_path)
    (run / "job.json").write_text('{"job_id": "4')
    (run / "submitit" / "4242_submitted.pkl").write_bytes(b"")
    asked = {}

    class Answer:
        def states(self, jobs, timeout):
            asked.update(jobs)
            return {j: submit.schedulers.JobState("RUNNING", "n1", "fake") for j in jobs}

    monkeypatch.setattr(submit.schedulers, "get", lambda kind: Answer())
    assert submit.job_states([run])[run].state == "RUNNING" and asked == {"4242": run}
    assert submit.job_info(runs.RunDir(run)) == {"job_id": "4242", "scheduler": "slurm", "from": "submitit"}


def test_an_old_folder_without_job_json_was_never_submitted(tmp_path):
    run = young_run(tmp_path)
    old = time.time() - 2 * submit.SUBMIT_GRACE_S
    os.utime(run / "resolved.json", (old, old))
    assert submit.job_states([run])[run].state == "NOT SUBMITTED"


def test_job_json_is_written_whole_while_status_reads_it(tmp_path):
    """A reader polling job.json while it is rewritten sees either nothing or the whole file."""
    import threading

    rd = runs.RunDir(young_run(tmp_path))
    stop = threading.Event()

    def writer():
        n = 0
        while not stop.is_set():
            runs.write_json(rd.job, {"job_id": str(1000 + n), "scheduler": "slurm", "pad": "x" * 50000})
            n += 1

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        seen = [submit.job_info(rd) for _ in range(300)]
    finally:
        stop.set()
        thread.join()
    assert all(info.get("job_id", "").startswith("1") and info["scheduler"] == "slurm" for info in seen if info)
    assert not list(rd.path.glob(".job.json.tmp-*"))


# ---------------------------------------------------------------- a run root shared by several users


@pytest.fixture
def other_uid() -> int:
    if os.getuid() != 0:
        pytest.skip("giving a folder to another user needs root (the two-user test is tests/slurm/)")
    return 54321  # no such user: a uid the system does not name


def runs_of_two_users(root: Path, other: int) -> tuple[Path, Path]:
    mine, theirs = fake_runs(root, 2)
    (theirs / "job.json").write_text(json.dumps({"job_id": "777001", "scheduler": "slurm"}))
    os.chown(theirs, other, other)
    return mine, theirs


def test_the_list_and_the_lookups_see_only_the_callers_runs(tmp_path, other_uid):
    root = tmp_path / "runs"
    mine, theirs = runs_of_two_users(root, other_uid)
    assert runs.list_runs([root]) == [mine]
    assert runs.find_run(mine.name, [root]) == mine.resolve()
    assert runs.find_run("990000", [root]) == mine  # its job id
    with pytest.raises(ConfigError, match="not a run folder, run name or job id"):
        runs.find_run("777001", [root])  # the other user's job id resolves to nothing
    with pytest.raises(ConfigError, match=f"belongs to uid {other_uid}, not to you"):
        runs.find_run(theirs.name, [root])
    assert runs.find_run(str(theirs), [root]) == theirs.resolve()  # a path is the caller's explicit choice


def test_status_cancel_logs_and_drill_refuse_another_users_run_by_name_or_id(tmp_path, other_uid):
    root = tmp_path / "runs"
    _, theirs = runs_of_two_users(root, other_uid)
    env = {**os.environ, **site_path_with(tmp_path, root), "SLURM_CONF": str(bogus_conf(tmp_path))}
    for command in ("status", "cancel", "logs", "drill"):
        for ref in (theirs.name, "777001"):
            out = subprocess.run([sys.executable, "-m", "hpc.cli", command, ref], capture_output=True, text=True,
                                 env=env, timeout=60, cwd=REPO)
            assert out.returncode == 2 and out.stderr.startswith("error: ") and out.stderr.count("\n") == 1, \
                (command, ref, out.stderr)


def test_folders_that_cannot_be_looked_at_are_skipped(tmp_path, monkeypatch):
    root = tmp_path / "runs"
    (good,) = fake_runs(root, 1)
    (root / "dangling").symlink_to(tmp_path / "nowhere")
    (root / "a-file").write_text("not a folder")
    real_stat = Path.stat

    def stat(self, *args, **kwargs):  # a folder this user may not enter (root enters every folder)
        if self.name == "resolved.json" and self.parent.name == "locked":
            raise PermissionError(13, "Permission denied", str(self))
        return real_stat(self, *args, **kwargs)

    locked = root / "locked"
    locked.mkdir()
    (locked / "resolved.json").write_text("{}")
    monkeypatch.setattr(Path, "stat", stat)
    assert runs.list_runs([root, tmp_path / "no-such-root"]) == [good]


def test_a_run_whose_files_cannot_be_read_is_a_row_saying_so(tmp_path, monkeypatch):
    (good, bad) = fake_runs(tmp_path / "runs", 2)
    real = runs.read_jsonl

    def read_jsonl(path):
        if path.parent == bad:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(runs, "read_jsonl", read_jsonl)
    monkeypatch.setenv("SLURM_CONF", str(bogus_conf(tmp_path)))
    rows = submit.summaries([good, bad], timeout=5)
    assert rows[0]["state"] == "UNKNOWN" and rows[1]["state"] == "UNREADABLE"
    assert rows[1]["state_words"] == "UNREADABLE (Permission denied)"


def test_two_runs_with_the_same_job_id_both_get_a_state(down):
    """Job ids repeat across clusters (and local pids are reused): every listed run gets its row."""
    first, second = fake_runs(down, 2)
    (second / "job.json").write_text((first / "job.json").read_text())
    ledger(second, {"event": "start"}, {**STOP, "reason": "failed", "requeued": False})
    states = submit.job_states([first, second], timeout=10)
    assert states[first].state == "UNKNOWN" and states[second].state == "FAILED"
    assert [r["state"] for r in submit.summaries([first, second], timeout=10)] == ["UNKNOWN", "FAILED"]


@pytest.mark.parametrize("text,torn", [
    ("", True), ("\0\0\0\0", True), ('{"job_id": "12', True), ('{"job_id": "12", "sched', True),
    ('{"job_id": ', True), ('{"job_id": "12", "scheduler": "slurm"', True), ('{"job_id": 12}', False),
    ('{"job_id": 12} trailing', False), ('{"job_id": ' * 5000, False), ("not json at all", False),
])
def test_what_counts_as_a_half_written_json_file(tmp_path, text, torn):
    (tmp_path / "job.json").write_text(text)
    assert runs.torn_json(tmp_path / "job.json") is torn


def test_a_hostile_job_json_is_a_row_in_the_list_and_an_error_for_the_run(tmp_path, monkeypatch):
    (good, odd) = fake_runs(tmp_path / "runs", 2)
    (odd / "job.json").write_text('{"job_id": ' * 5000)
    monkeypatch.setenv("SLURM_CONF", str(bogus_conf(tmp_path)))
    rows = submit.summaries([good, odd], timeout=5)
    assert [r["state"] for r in rows] == ["UNKNOWN", "UNREADABLE"] and "nested deeper" in rows[1]["state_words"]
    with pytest.raises(ConfigError, match="nested deeper than 32 levels"):
        submit.job_states([odd])


def test_an_end_the_ledger_confirms_is_not_asked_again(tmp_path, monkeypatch):
    """FAILED or TIMEOUT recorded by a poll, and a last stop line that was not requeued: final, like
    COMPLETED; after a requeued stop (or none) the scheduler is asked."""
    settled_, requeued, killed = fake_runs(tmp_path / "runs", 3)
    for run, stop in ((settled_, {"requeued": False}), (requeued, {"requeued": True}), (killed, None)):
        (run / "states.jsonl").write_text("".join(json.dumps({"state": s}) + "\n" for s in ("RUNNING", "FAILED")))
        ledger(run, {"event": "start"}, *([{**STOP, "reason": "failed", **stop}] if stop else []))
    asked = {}

    class Answer:
        def states(self, jobs, timeout):
            asked.update(jobs)
            return {j: submit.schedulers.JobState("PENDING", "", "fake") for j in jobs}

    monkeypatch.setattr(submit.schedulers, "get", lambda kind: Answer())
    states = submit.job_states([settled_, requeued, killed])
    assert states[settled_].state == "FAILED" and states[settled_].source == "states.jsonl"
    assert set(asked.values()) == {requeued, killed}


@pytest.mark.parametrize("text,ok", [
    (json.dumps({"a": [[1]], "b": {"c": {}}}), True), ("[" * 32 + "]" * 32, True), ("[" * 33 + "]" * 33, False),
    ("[" * 100000, False), ('{"a": ' * 40 + "1" + "}" * 40, False), ('{"a": 1} x', False),
])
def test_run_folder_json_is_read_fast_and_still_bounded(tmp_path, text, ok):
    (tmp_path / "f.json").write_text(text)
    if ok:
        assert runs.read_json(tmp_path / "f.json") == json.loads(text)
    else:
        with pytest.raises(ConfigError, match="f.json: (JSON nested deeper than 32 levels|not valid JSON)"):
            runs.read_json(tmp_path / "f.json")


def slurm_shims(tmp_path: Path, sacct: str, squeue: str) -> Path:
    """sacct, squeue and scontrol stand-ins (scontrol leaves a mark when it runs)."""
    shims = tmp_path / "bin"
    shims.mkdir()
    for tool, body in (("sacct", sacct), ("squeue", squeue), ("scontrol", f"touch {tmp_path}/scontrol-ran")):
        (shims / tool).write_text(f"#!/bin/sh\n{body}\n")
        (shims / tool).chmod(0o755)
    return shims


@pytest.fixture
def controller_up(monkeypatch):
    from hpc.schedulers.slurm import scheduler as slurm

    monkeypatch.setattr(slurm, "controller_down", lambda timeout: "")


def test_jobs_squeue_has_running_do_not_wait_for_accounting(tmp_path, monkeypatch, controller_up):
    from hpc.schedulers.slurm import scheduler as slurm

    shims = slurm_shims(tmp_path, "sleep 20", "printf '71|RUNNING|n1\\n72|PENDING|\\n'")
    monkeypatch.setenv("PATH", f"{shims}:{os.environ['PATH']}")
    started, waited = [], []

    def in_background(query, ids, timeout):  # the real background query, and a note of each wait for it
        started.append(query)
        answer = real_in_background(query, ids, timeout)
        return lambda deadline: waited.append(query) or answer(deadline)

    real_in_background = slurm._in_background
    monkeypatch.setattr(slurm, "_in_background", in_background)
    states = slurm.SlurmScheduler().states({"71": tmp_path, "72": tmp_path}, timeout=120)
    assert {j: s.state for j, s in states.items()} == {"71": "RUNNING", "72": "PENDING"}
    assert started == [slurm._sacct] and waited == []  # sacct (20 s) was started, and not waited for


def test_accounting_wins_and_scontrol_is_left_alone_when_accounting_answers(tmp_path, monkeypatch, controller_up):
    from hpc.schedulers.slurm.scheduler import SlurmScheduler

    shims = slurm_shims(tmp_path, "printf '71|TIMEOUT|n1|0:0\\n'", "printf '71|COMPLETING|n1\\n'")
    monkeypatch.setenv("PATH", f"{shims}:{os.environ['PATH']}")
    states = SlurmScheduler().states({"71": tmp_path, "73": tmp_path}, timeout=120)
    assert states["71"].state == "TIMEOUT" and states["71"].source == "sacct"
    assert states["73"].state == "UNKNOWN" and not states["73"].detail.get("reason")  # answered: not known
    assert not (tmp_path / "scontrol-ran").exists()

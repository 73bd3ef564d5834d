"""Node health across starts (``hpc.core.health``): the node of a failed rank, whether the failure is the
node's, which nodes the next start excludes and for how long, and what the check after srun records.
The granted ``scontrol requeue`` and ``ExcNodeList`` themselves run on the sandbox
(tests/slurm/test_health_slurm.py); here the job side grants the requeue and records the exclusion."""

from __future__ import annotations

import json
import time

import pytest

from hpc.core import health, requeue, runs
from hpc.core.config import ConfigError
from hpc.core.health import Health
from hpc.core.spec import spec_from_dict
from hpc.login.status import health_text
from hpc.schedulers.slurm.requeue import after_srun
from hpc.schedulers.slurm.scheduler import SlurmJobSide
from tests.resilience.test_failure_records import batch_log, srun_says, write_batch_log
from tests.resilience.test_requeue import JOB, start, write_ledger


class GrantingSide(SlurmJobSide):
    """The job side of the check after srun whose requeue the scheduler grants (recorded, not sent)."""

    def __init__(self, spare: int | None = 5) -> None:
        self.excluded: list[list[str]] = []
        self.spare = spare

    def requeue(self) -> str | None:
        return None

    def exclude(self, nodes):
        self.excluded.append(list(nodes))
        return None

    def spare_nodes(self) -> int | None:
        return self.spare


@pytest.fixture
def granting(slurm_side) -> GrantingSide:  # slurm_side: inside job 424242, restart 1, under the check
    return GrantingSide()


# ---------------------------------------------------------------- one failure


def test_the_failed_ranks_nodes_come_from_srun_then_from_the_reports():
    ends = [{"ranks": [2, 3], "host": "n7", "first": True}, {"ranks": [0], "host": "n1", "first": False}]
    reports = [{"rank": 5, "host": "n9"}, {"rank": 0, "host": "n1"}]
    assert health.failed_nodes([3], reports, ends) == ["n7"]
    assert health.failed_nodes([3, 5], reports, ends) == ["n7", "n9"]
    assert health.failed_nodes([4], reports, ends) == []
    assert health.failed_nodes([0], reports, ends) == ["n1"]  # named twice, listed once


@pytest.mark.parametrize("account,reports,blamed", [
    ({"failed_ranks": [1], "signal": "SIGKILL", "error": "rank 1 on n2 was killed"}, [], True),
    ({"failed_ranks": [1], "signal": "SIGBUS"}, [], True),
    ({"failed_ranks": [1], "error": "RuntimeError: flaky rank 1"}, [{"rank": 1}], False),
    ({"failed_ranks": [1], "error": "ValueError: bad input"}, [], False),
    ({"failed_ranks": [1], "error": "hang at step 9, rank 1"}, [{"rank": 1, "node_fault": True}], True),
    ({"failed_ranks": [2], "error": "hang at step 9, rank 1"}, [{"rank": 1, "node_fault": True}], False),
    ({"failed_ranks": [0], "error": "RuntimeError: CUDA error: uncorrectable ECC error encountered"}, [], True),
    ({"failed_ranks": [0], "error": "RuntimeError: GPU has fallen off the bus"}, [], True),
])
def test_whether_a_failure_is_the_nodes(account, reports, blamed):
    assert health.node_fault(account, reports) is blamed


# ---------------------------------------------------------------- exclusions over time


def test_nodes_are_excluded_newest_first_within_the_window_and_the_cap():
    settings = Health(exclude_nodes=2, exclude_minutes=10)
    found = [("n1", 1000.0), ("n2", 1100.0), ("n3", 1200.0), ("n1", 1250.0)]
    assert health.exclusions(found, 1300.0, settings, None) == {"n1": 1850.0, "n3": 1800.0}
    assert health.exclusions(found, 1300.0, settings, 1) == {"n1": 1850.0}  # one spare node in the partition
    assert health.exclusions(found, 1300.0, settings, 0) == {}
    assert health.exclusions(found, 1801.0, settings, None) == {"n1": 1850.0}  # n3's window has passed
    assert health.exclusions(found, 1900.0, settings, None) == {}
    assert health.exclusions(found, 1300.0, Health(exclude_nodes=0), None) == {}


def test_faults_are_the_stop_lines_that_blame_a_node():
    ledger = [start(0, 0), {"event": "stop", "time": 5.0, "failed_nodes": ["n1"], "node_fault": True},
              start(3), {"event": "stop", "time": 9.0, "failed_nodes": ["n2"], "node_fault": False},
              {"event": "stop", "time": 12.0, "reason": "preempted"}]
    assert health.faults(ledger) == [("n1", 5.0)]


def test_status_shows_the_nodes_still_excluded():
    ledger = [{"event": "stop", "excluded_until": {"n1": 500.0, "n2": 100.0}}, start(3),
              {"event": "stop", "reason": "preempted"}]
    assert health.active(ledger, 200.0) == {"n1": 500.0}
    assert health.active(ledger, 600.0) == {}
    now = time.time()
    assert health_text({"excluded_nodes": {"n4": now + 600}}) == "  excluded n4 (10 min more)"
    assert health_text({"excluded_nodes": {}}) == "" and health_text({}) == ""


# ---------------------------------------------------------------- the check after srun


def test_a_rank_killed_by_a_signal_gets_its_node_excluded_on_the_requeue(run_dir, granting):
    write_ledger(run_dir, [start(0)])
    write_batch_log(run_dir, batch_log((1, srun_says("n2: task 1: Killed", ["n1: task 0: Killed"]))))
    line = after_srun(run_dir, 137, granting)
    assert line["requeued"] and line["failed_ranks"] == [1] and line["failed_nodes"] == ["n2"]
    assert line["node_fault"] is True and line["excluded_nodes"] == ["n2"] and granting.excluded == [["n2"]]
    assert 59 * 60 < line["excluded_until"]["n2"] - time.time() <= 60 * 60 + 1  # the default window, an hour
    assert runs.RunDir(run_dir).read_ledger()[-1] == line


def test_a_python_error_excludes_no_node(run_dir, granting):
    write_ledger(run_dir, [start(0)])
    requeue.report_failure(run_dir, f"{JOB}.1", 1, step=4, error="RuntimeError: flaky", host="n2")
    write_batch_log(run_dir, batch_log((1, srun_says("n2: task 1: Exited with exit code 1"))))
    line = after_srun(run_dir, 1, granting)
    assert line["requeued"] and line["failed_nodes"] == ["n2"] and line["node_fault"] is False
    assert "excluded_nodes" not in line and granting.excluded == []


def test_a_node_comes_back_at_the_first_requeue_after_its_window(run_dir, granting):
    long_ago = time.time() - 2 * 3600
    write_ledger(run_dir, [start(0, 0), {"event": "stop", "reason": "failed", "step": 3, "time": long_ago,
                                         "failed_nodes": ["n1"], "node_fault": True, "excluded_nodes": ["n1"],
                                         "excluded_until": {"n1": long_ago + 3600}}, start(3)])
    requeue.report_failure(run_dir, f"{JOB}.1", 0, step=9, error="RuntimeError: flaky", host="n2")
    line = after_srun(run_dir, 1, granting)
    assert line["requeued"] and line["excluded_nodes"] == [] and granting.excluded == [[]]  # n1 is let back


def test_a_node_excluded_before_stays_excluded_within_its_window(run_dir, granting):
    recent = time.time() - 60
    write_ledger(run_dir, [start(0, 0), {"event": "stop", "reason": "failed", "step": 3, "time": recent,
                                         "failed_nodes": ["n1"], "node_fault": True}, start(3)])
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 8, "loss": 1.0}) + "\n")  # progress since
    write_batch_log(run_dir, batch_log((1, srun_says("n3: task 2: Segmentation fault"))))
    line = after_srun(run_dir, 139, granting)
    assert line["excluded_nodes"] == ["n3", "n1"] and granting.excluded == [["n3", "n1"]]


def test_no_more_nodes_are_excluded_than_the_partition_spares(run_dir, slurm_side):
    side = GrantingSide(spare=0)  # a two-node job on a two-node partition: excluding one would never start it
    write_ledger(run_dir, [start(0)])
    write_batch_log(run_dir, batch_log((1, srun_says("n2: task 1: Killed"))))
    line = after_srun(run_dir, 137, side)
    assert line["node_fault"] and line.get("excluded_nodes", []) == [] and side.excluded in ([], [[]])


def test_a_refused_exclusion_is_recorded_and_the_requeue_stands(run_dir, slurm_side):
    class Refusing(GrantingSide):
        def exclude(self, nodes):
            return "scontrol update JobId=1 ExcNodeList=n2 failed: Invalid node name specified"

    write_ledger(run_dir, [start(0)])
    write_batch_log(run_dir, batch_log((1, srun_says("n2: task 1: Killed"))))
    line = after_srun(run_dir, 137, Refusing())
    assert line["requeued"] and "Invalid node name" in line["exclude_failed"]


def test_a_failure_that_is_not_requeued_excludes_nothing(run_dir, slurm_side):
    (run_dir / "resolved.json").write_text(json.dumps({"spec": {"job": {"max_requeues": 0}}}))
    side = GrantingSide()
    write_ledger(run_dir, [start(0)])
    write_batch_log(run_dir, batch_log((1, srun_says("n2: task 1: Killed"))))
    line = after_srun(run_dir, 137, side)
    assert not line["requeued"] and line["failed_nodes"] == ["n2"] and side.excluded == []


def test_the_spec_sets_the_window_and_the_cap(run_dir, granting):
    (run_dir / "resolved.json").write_text(json.dumps({"spec": {"health": {"exclude_nodes": 0}}}))
    write_ledger(run_dir, [start(0)])
    write_batch_log(run_dir, batch_log((1, srun_says("n2: task 1: Killed"))))
    assert "excluded_nodes" not in after_srun(run_dir, 137, granting) and granting.excluded == []


# ---------------------------------------------------------------- the [health] section


def test_health_of_an_older_run_folder_is_the_defaults():
    assert health.health_of({}) == Health()
    assert health.health_of({"health": {"exclude_minutes": 5, "unknown": 1}}).exclude_minutes == 5


@pytest.mark.parametrize("doc,words", [
    ({"health": {"hang_timeout_s": 120}}, "`health.hang_timeout_s` = 120 is not below the collective timeout"),
    ({"health": {"hang_timeout_s": 50}, "parallel": {"timeout_s": 40}}, "(`parallel.step_timeout_s` = 40)"),
    ({"health": {"exclude_nodes": -1}}, "health.exclude_nodes"),
    ({"health": {"exclude_minuts": 3}}, "did you mean `health.exclude_minutes`?"),
    ({"health": {"hang_factor": 0.5}}, "health.hang_factor"),
])
def test_bad_health_settings_are_named(doc, words):
    with pytest.raises(ConfigError) as err:
        spec_from_dict(doc)
    assert words in str(err.value)


def test_a_hang_timeout_below_the_collective_timeout_is_taken():
    assert spec_from_dict({"health": {"hang_timeout_s": 30}}).health.hang_timeout_s == 30


def test_a_hang_the_watchdog_named_is_the_hung_ranks_failure_and_its_nodes(run_dir, granting):
    write_ledger(run_dir, [start(0)])
    requeue.report_failure(run_dir, f"{JOB}.1", 1, step=6, error="hang at step 7, rank 1 (last seen in no answer)",
                           host="n2", node_fault=True, hang={"ranks": [1], "step": 7, "where": "no answer"})
    write_batch_log(run_dir, batch_log((1, srun_says("n1: task 0: Exited with exit code 86",
                                                     "n2: task 1: Killed"))))
    line = after_srun(run_dir, 86, granting)
    assert line["failed_ranks"] == [1] and line["error"].startswith("hang at step 7, rank 1")
    assert line["failed_nodes"] == ["n2"] and line["node_fault"] and line["excluded_nodes"] == ["n2"]
    assert line["hang"]["ranks"] == [1] and line["requeued"]

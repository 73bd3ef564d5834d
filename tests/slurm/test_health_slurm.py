"""Goodput at scale on the real two-node sandbox: a node that failed the job is excluded on its requeue
(``hpc.core.health``). A one-node job whose rank is killed on its node starts again on the other one."""

from __future__ import annotations

import json
import os
import signal

from tests.conftest import REPO
from tests.resilience.resilience_lib import ledger, losses_by_step, submit, wait_state
from tests.slurm.test_failure_slurm import TERMINAL, task_pid, wait_for

DDP = str(REPO / "jobs" / "tiny-ddp.toml")


def hosts(folder) -> list[str]:
    return json.loads((folder / "world.json").read_text())["hosts"]


def test_a_node_that_killed_the_rank_is_excluded_and_the_job_lands_on_the_other(sandbox):
    folder = submit(DDP, "job.name=exclude-node", "job.nodes=1", "job.tasks_per_node=1", "train.steps=20",
                    "train.log_every=1", "checkpoint.interval_steps=4", site="sandbox")
    job_id = json.loads((folder / "job.json").read_text())["job_id"]
    wait_for(lambda: max(losses_by_step(folder), default=0) >= 6, "step 6", timeout=240)
    first = hosts(folder)
    pid = wait_for(lambda: task_pid(job_id, 0), "the rank's process", timeout=30)
    os.kill(pid, signal.SIGKILL)  # a node-level failure: no Python error, srun says "Killed"
    final = wait_state(folder, TERMINAL, timeout=300)
    assert final["state"] == "COMPLETED", (folder / "logs" / "rank-0.log").read_text()[-3000:]
    start0, stop0, start1, stop1 = ledger(folder)
    assert stop0["failed_nodes"] == first and stop0["node_fault"] and stop0["excluded_nodes"] == first
    assert "exclude_failed" not in stop0
    assert hosts(folder) != first and final["nodes"] not in first  # the second start ran on the other node
    assert set(final["excluded_nodes"]) == set(first)  # status: still within the window (an hour)
    assert stop1["reason"] == "completed" and sorted(losses_by_step(folder)) == list(range(1, 21))

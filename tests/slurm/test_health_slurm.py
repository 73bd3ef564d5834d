"""Goodput at scale on the real two-node sandbox: a node that failed the job is excluded on its requeue
(``hpc.core.health``). A one-node job whose rank is killed on its node starts again on the other one."""

from __future__ import annotations

import json
import time

from tests.conftest import REPO, hpcx
from tests.resilience.resilience_lib import ledger, losses_by_step, submit, wait_state
from tests.slurm.test_failure_slurm import HERE, TERMINAL

DDP = str(REPO / "jobs" / "tiny-ddp.toml")
# the first start is slowed (0.1 s a forward call, 8 a step: ~0.8 s a step) so that a drill at step 6 lands while
# the job trains, however long `srun --overlap` takes on a loaded machine; the restart runs at full speed
SLOW_FIRST_START = ('model.arch="slow_model:build"', "model.kwargs={sleep_s = 0.1}",
                    f"env.set.PYTHONPATH={json.dumps(HERE)}", "model.seq_len=64", "model.vocab_size=256")


def hosts(folder) -> list[str]:
    return json.loads((folder / "world.json").read_text())["hosts"]


def test_a_node_that_killed_the_rank_is_excluded_and_the_job_lands_on_the_other(sandbox):
    folder = submit(DDP, "job.name=exclude-node", "job.nodes=1", "job.tasks_per_node=1", "train.steps=20",
                    "train.log_every=1", "checkpoint.interval_steps=4", *SLOW_FIRST_START, site="sandbox")
    drilled = hpcx("drill", str(folder), "--at-step", "6", "--fail-node", "--json")  # SIGKILL: srun says "Killed"
    assert drilled.returncode == 0, drilled.stderr
    done = json.loads(drilled.stdout)
    first = [done["host"]]
    assert done["fault"] == "fail_node" and done["rank"] == 0 and done["step"] >= 6
    final = wait_state(folder, TERMINAL, timeout=300)
    assert final["state"] == "COMPLETED", (folder / "logs" / "rank-0.log").read_text()[-3000:]
    start0, stop0, start1, stop1 = ledger(folder)
    assert stop0["failed_nodes"] == first and stop0["node_fault"] and stop0["excluded_nodes"] == first
    assert "exclude_failed" not in stop0
    assert hosts(folder) != first and final["nodes"] not in first  # the second start ran on the other node
    assert set(final["excluded_nodes"]) == set(first)  # status: still within the window (an hour)
    assert stop1["reason"] == "completed" and sorted(losses_by_step(folder)) == list(range(1, 21))


def test_a_stopped_rank_is_named_by_the_watchdog_and_the_job_resumes_with_nothing_lost(sandbox):
    folder = submit(DDP, "job.name=hang-rank", "job.nodes=2", "job.tasks_per_node=1", "train.steps=24",
                    "train.log_every=1", "checkpoint.interval_steps=4", "health.hang_timeout_s=20", *SLOW_FIRST_START,
                    site="sandbox")
    job_id = json.loads((folder / "job.json").read_text())["job_id"]
    drilled = hpcx("drill", str(folder), "--at-step", "6", "--hang", "1")  # SIGSTOP: its watchdog stops too
    stopped_at = time.time()
    assert drilled.returncode == 0 and "hang at rank 1 on n2 (srun --jobid=" in drilled.stdout, drilled.stderr
    final = wait_state(folder, TERMINAL, timeout=400)
    assert final["state"] == "COMPLETED", (folder / "logs" / "rank-0.log").read_text()[-3000:]
    start0, stop0, start1, stop1 = ledger(folder)
    assert stop0["reason"] == "failed" and stop0["requeued"] and stop0["failed_ranks"] == [1]
    assert stop0["error"].startswith(f"hang at step {stop0['hang']['step']}, rank 1 (last seen in no answer")
    assert stop0["hang"]["ranks"] == [1] and stop0["node_fault"] and stop0["failed_nodes"] == ["n2"]
    assert stop0.get("excluded_nodes", []) == []  # a two-node job on the two-node sandbox: none to spare
    hangs = folder / "hangs" / f"{job_id}.0"
    assert json.loads((hangs / "hang.json").read_text())["answered"] == [0]  # rank 1 was stopped
    assert "Thread" in (hangs / "rank-0.stacks.txt").read_text()
    requeued = next(s for s in states_of(folder) if s["state"] == "REQUEUED")
    print(f"SIGSTOP to REQUEUED: {requeued['time'] - stopped_at:.1f} s (watchdog timeout 20 s)")
    assert requeued["time"] - stopped_at >= 20  # never before the watchdog's time
    assert int(start1["checkpoint"].removeprefix("step-")) == start1["step"] >= 4  # the newest checkpoint
    assert stop1["reason"] == "completed" and sorted(losses_by_step(folder)) == list(range(1, 25))


def states_of(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "states.jsonl").read_text().splitlines()]


def test_the_nodes_a_job_may_exclude_are_those_its_partition_spares(sandbox, monkeypatch):
    from hpc.schedulers.slurm.scheduler import SlurmJobSide

    monkeypatch.setenv("SLURM_JOB_PARTITION", "debug")
    for nodes, spare in (("1", 1), ("2", 0)):
        monkeypatch.setenv("SLURM_JOB_NUM_NODES", nodes)
        assert SlurmJobSide().spare_nodes() == spare

"""The straggler report on the real two-node sandbox (``trainer.straggler``, ``hpc.core.straggler``): a
one-node job of two ranks whose rank 1 ``hpcx drill --slow`` stops half of each second is named in
``hpcx status``; with ``health.exclude_stragglers`` its node is kept out when the job is requeued (here after
a drilled preemption), so the next start lands on the other node."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import REPO, hpcx
from tests.resilience.resilience_lib import ledger, submit, wait_state
from tests.slurm.test_failure_slurm import TERMINAL, wait_for

DDP = str(REPO / "jobs" / "tiny-ddp.toml")


def named(folder: Path) -> str:
    out = hpcx("status", str(folder)).stdout
    return out if "straggler: rank 1 on " in out else ""


def starts(folder: Path) -> list[dict]:
    return [e for e in ledger(folder) if e["event"] == "start"]


def test_a_slowed_rank_is_named_and_its_node_kept_out_of_the_requeue(sandbox):
    folder = submit(DDP, "job.name=straggler", "job.nodes=1", "job.tasks_per_node=2", "train.steps=100000",
                    "train.log_every=5", "checkpoint.interval_steps=100000", "health.straggler_every=50",
                    "health.straggler_intervals=3", "health.straggler_factor=1.3", "health.exclude_stragglers=true", site="sandbox")
    try:
        slowed = hpcx("drill", str(folder), "--at-step", "20", "--slow", "1", "--for", "120", "--json", timeout=300)
        assert slowed.returncode == 0, slowed.stderr
        first = json.loads(slowed.stdout)["host"]
        shown = wait_for(lambda: named(folder), "status to name rank 1", timeout=240)
        assert f"straggler: rank 1 on {first}, " in shown, shown
        preempted = hpcx("drill", str(folder), "--json", timeout=300)  # USR2: save, requeue
        assert preempted.returncode == 0, preempted.stderr
        wait_for(lambda: len(starts(folder)) == 2, "the requeued start", timeout=300)
        stop0 = next(e for e in ledger(folder) if e["event"] == "stop")
        assert stop0["reason"] == "preempted" and stop0["requeued"], stop0
        assert [s["rank"] for s in stop0["stragglers"]] == [1] and stop0["excluded_nodes"] == [first], stop0
        hosts = json.loads((folder / "world.json").read_text())["hosts"]  # rank 0 wrote it before its start line
        assert first not in hosts, hosts  # the straggler's node was kept out
    finally:
        hpcx("cancel", str(folder))
    wait_state(folder, TERMINAL, timeout=300)

"""The pre-flight check on the real two-node sandbox (``trainer.preflight``): a one-node job whose node fails
the check (the drill hook ``PREFLIGHT_DRILL_FAIL_HOST=@first``: wherever its first start landed) never
trains there; the check after srun records the failed check as the node's fault, excludes the node, and
the requeued job completes on the other node."""

from __future__ import annotations

import json

from tests.conftest import REPO
from tests.resilience.resilience_lib import ledger, losses_by_step, submit, wait_state
from tests.slurm.test_failure_slurm import TERMINAL

DDP = str(REPO / "jobs" / "tiny-ddp.toml")


def test_a_node_that_fails_the_preflight_check_is_excluded_and_the_job_completes_on_the_other(sandbox):
    folder = submit(DDP, "job.name=preflight-node", "job.nodes=1", "job.tasks_per_node=1", "train.steps=6",
                    "train.log_every=1", "env.set.PREFLIGHT_DRILL_FAIL_HOST=@first", site="sandbox")
    final = wait_state(folder, TERMINAL, timeout=300)
    assert final["state"] == "COMPLETED", (folder / "logs" / "rank-0.log").read_text()[-3000:]
    stop0, start1, stop1 = ledger(folder)  # the failed start wrote no start line: it never trained
    first = stop0["failed_nodes"]
    assert stop0["reason"] == "failed" and stop0["requeued"] and stop0["node_fault"] and len(first) == 1
    assert stop0["error"] == f"preflight: {first[0]} failed: cpu failed the drill (PREFLIGHT_DRILL_FAIL_HOST=@first)"
    assert stop0["preflight"]["nodes"] == first and stop0["excluded_nodes"] == first
    assert start1["step"] == 0 and stop1["reason"] == "completed"
    assert json.loads((folder / "world.json").read_text())["hosts"] != first  # the second start: the other node
    assert sorted(losses_by_step(folder)) == list(range(1, 7))
    assert final["goodput"]["seconds"]["preflight"] > 0  # the thrown-away start, by cause
    assert "preflight: 1 rank(s) in" in (folder / "logs" / "rank-0.log").read_text()  # the passing check, logged

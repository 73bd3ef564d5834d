"""Tensor parallelism on the real two-node Slurm sandbox: a tp-2 run (2 nodes × 2 tasks; each tp group is
the two tasks of one node, fsdp over the two nodes) drilled at a random step requeues, resumes from its
own checkpoint and ends bit-identical to an uninterrupted run: same losses step by step, same tensors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.conftest import REPO, hpcx
from tests.resilience.resilience_lib import (checkpoint_steps, ledger, losses_by_step, same_checkpoint_tensors,
                                             submit, token_file, wait_state)

JOB = str(REPO / "jobs" / "tiny-hsdp-2node.toml")
STEPS = 30
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


@pytest.fixture(scope="module")
def tokens(sandbox) -> Path:
    folder = sandbox / "tp-test-data"
    folder.mkdir(exist_ok=True)
    return token_file(folder / "tokens.bin", samples=100)


def sets(tokens: Path, name: str) -> list[str]:
    return [f"job.name={name!r}", f"data.source={json.dumps(str(tokens))}", "data.shuffle=true",
            "model.arch='llama'", "model.size='tiny'", "model.dropout=0.0", "parallel.strategy='fsdp'", "parallel.tp=2", "parallel.tp_on_cpu=true",
            "job.nodes=2", "job.tasks_per_node=2", "train.log_every=1", "checkpoint.interval_steps=10",
            f"train.steps={STEPS}"]


def test_drilled_tp_run_resumes_bit_identical(tokens):
    at_step = random.Random().randint(3, 9)
    reference = submit(JOB, *sets(tokens, "tp-reference"), site="sandbox")
    drilled = submit(JOB, *sets(tokens, "tp-drilled"), site="sandbox")
    out = hpcx("drill", str(drilled), "--at-step", str(at_step), "--json", timeout=300)
    assert out.returncode == 0, out.stderr
    for folder in (reference, drilled):
        final = wait_state(folder, TERMINAL, timeout=400)
        assert final["state"] == "COMPLETED", f"{folder}: {final}"
    mesh = json.loads((drilled / "mesh.json").read_text())
    assert mesh["tp"] == [[0, 1], [2, 3]] and mesh["dp_shard"] == [[0, 2], [1, 3]]  # tp inside a node
    start0, stop0, start1, stop1 = ledger(drilled)
    assert stop0["reason"] == "preempted" and start1["step"] == stop0["step"] >= at_step
    assert stop1["reason"] == "completed" and stop1["step"] == STEPS
    assert losses_by_step(drilled) == losses_by_step(reference), f"drilled at step {at_step}"
    final = f"step-{STEPS:07d}"
    assert same_checkpoint_tensors(drilled / "checkpoints" / final, reference / "checkpoints" / final) == []
    assert checkpoint_steps(drilled)[-1] == STEPS

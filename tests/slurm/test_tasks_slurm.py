"""The worked examples of the task seam on the real two-node Slurm sandbox (2 nodes × 1 rank each):
the ResNet-style classifier (with BatchNorm: its running statistics resume too) and the BERT-style one, with
DDP and with FSDP, drilled through Slurm
(USR2, the preemption save, the one requeue) and resumed bit for bit; their accuracy in status."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, hpcx
from tests.extras import extra
from tests.resilience.resilience_lib import ledger, same_checkpoint_tensors, submit, wait_state
from tests.resilience.test_tasks_local import HELD, evals, step_samples, train_losses

# the drilled run holds at HOLD_STEP's samples until its drill has signalled (tests/resilience/held.py)
STEPS, DRILL_AT, HOLD_STEP = 8, 3, 6
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


@pytest.fixture(scope="module")
def tiny_bert(sandbox) -> Path:
    """A tiny BertForSequenceClassification saved with save_pretrained where the nodes read it."""
    transformers = extra("transformers")
    folder = sandbox / "tasks-test-data" / "bert-tiny"
    if not (folder / "model.safetensors").exists():
        config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, max_position_embeddings=32, num_labels=2,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        torch.manual_seed(1)
        transformers.BertForSequenceClassification(config).save_pretrained(folder)
    return folder


def sets(example: str, strategy: str, tiny_bert: Path) -> list[str]:
    common = ["job.nodes=2", "job.tasks_per_node=1", f"parallel.strategy={strategy!r}", "train.log_every=1",
              f"train.steps={STEPS}", "train.eval_every=4", "checkpoint.interval_steps=4", "train.warmup_steps=2"]
    if example == "resnet":
        return [*common, "train.global_batch=16", "train.micro_batch=4", "task.kwargs.norm='batch'"]  # BatchNorm's buffers
    return [*common, "train.global_batch=8", "train.micro_batch=2", "task.kwargs.seq_len=12",
            f"task.kwargs.pretrained={json.dumps(str(tiny_bert))}", "task.tokens_per_sample=12"]


def finished(run: Path) -> dict:
    info = wait_state(run, TERMINAL, timeout=900)
    assert info["state"] == "COMPLETED", (run / "logs" / "rank-0.log").read_text()[-3000:]
    return info


@pytest.mark.parametrize("example,strategy", [("resnet", "ddp"), ("resnet", "fsdp"), ("bert", "ddp"), ("bert", "fsdp")])
def test_a_task_drilled_on_two_nodes_resumes_bit_identical(tiny_bert, example, strategy):
    job = str(REPO / "jobs" / ("resnet-ddp.toml" if example == "resnet" else f"bert-{strategy}.toml"))
    spec_sets = [*sets(example, strategy, tiny_bert), f"task.target={HELD[Path(job).stem]!r}"]
    reference = submit(job, *spec_sets, f"job.name='task-{example}-{strategy}-ref'", site="sandbox")
    marker = tiny_bert.parent / f"release-{example}-{strategy}-{reference.name}"
    hold = f"{marker}:{','.join(map(str, step_samples(reference, HOLD_STEP)))}"
    drilled = submit(job, *spec_sets, f"job.name='task-{example}-{strategy}-drill'",
                     f"env.set.DRILL_HOLD={json.dumps(hold)}", site="sandbox")
    out = hpcx("drill", str(drilled), "--at-step", str(DRILL_AT), "--json", timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["step"] < HOLD_STEP, "the run went past its hold"
    marker.touch()
    assert json.loads(out.stdout)["scheduler"] == "slurm"
    finished(reference)
    info = finished(drilled)
    hosts = json.loads((drilled / "world.json").read_text())
    assert hosts["world_size"] == 2 and sorted(hosts["hosts"]) == ["n1", "n2"], hosts
    start0, stop0, start1, stop1 = ledger(drilled)
    assert stop0["reason"] == "preempted" and stop0["requeued"] and DRILL_AT <= stop0["step"] <= HOLD_STEP + 1 < STEPS
    assert start1["restart"] == 1 and start1["checkpoint"] == f"step-{stop0['step']:07d}"
    assert stop1["reason"] == "completed" and info["restarts"] == 1
    assert train_losses(drilled) == train_losses(reference) and sorted(train_losses(drilled)) == list(range(1, STEPS + 1))
    final = f"checkpoints/step-{STEPS:07d}"
    assert same_checkpoint_tensors(drilled / final, reference / final) == []
    last = evals(drilled)[-1]
    assert last == {**evals(reference)[-1], "eval_s": last["eval_s"], "start": last["start"]}
    assert info["eval_metrics"] == {"eval_accuracy": last["eval_accuracy"]}
    status = hpcx("status", str(drilled))
    assert f"accuracy {last['eval_accuracy']:.4g}" in status.stdout, status.stdout

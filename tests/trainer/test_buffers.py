"""BatchNorm's running statistics across a resume (2 real gloo ranks under torchrun, the local site).

A run resumed from one of its own checkpoints must evaluate as its uninterrupted twin, bit for bit:
the same losses after the resume, the same eval loss and accuracy at every later evaluation, the
same final checkpoint. BatchNorm's buffers are what differs between ranks (each updates them from its
own batches); a checkpoint that took some of them from rank 1 and some from rank 0 failed this.
The "resume" copies the twin's checkpoint of step 2 into a fresh run folder of the same spec, so no
signal races the run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from hpc.core import runs
from hpc.core.resolve import resolved_document
from hpc.core.site import load_site
from hpc.core.spec import load_spec
from hpc.plan.resolve import resolve
from trainer_testlib import REPO, torchrun

RESNET = REPO / "jobs" / "resnet-ddp.toml"
STEPS, RESUME_AT = 6, 2
SETS = [f"train.steps={STEPS}", "train.global_batch=16", "train.micro_batch=4", "train.log_every=1",
        "train.eval_every=2", "train.warmup_steps=1", "checkpoint.interval_steps=2", "checkpoint.keep=4",
        "job.tasks_per_node=2", "task.kwargs.norm='batch'", "task.kwargs.width=8", "task.kwargs.train_samples=128",
        "task.kwargs.eval_samples=64", "parallel.timeout_s=120"]


def make_task_run(root: Path, name: str, sets: list[str]) -> Path:
    """A run folder of the ResNet task with BatchNorm, resolved as `hpcx submit` resolves it."""
    spec = load_spec(RESNET, SETS + sets)
    site = load_site("local")
    run_dir = root / name
    run_dir.mkdir(parents=True)
    (run_dir / "resolved.json").write_text(json.dumps(resolved_document(spec, site, resolve(spec, site),
                                                                        str(run_dir)), indent=1))
    return run_dir


def trained(run_dir: Path) -> Path:
    proc = torchrun(2, ["-m", "trainer", str(run_dir)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir


def records(run_dir: Path) -> tuple[dict[int, float], dict[int, tuple]]:
    """(step → loss, step → (eval loss, eval accuracy)) of metrics.jsonl."""
    lines = runs.read_jsonl(run_dir / "metrics.jsonl")
    return ({r["step"]: r["loss"] for r in lines if "loss" in r},
            {r["step"]: (r["eval_loss"], r["eval_accuracy"]) for r in lines if "eval_loss" in r})


def resumed_twin(tmp_path: Path, sets: list[str]) -> tuple[Path, Path]:
    twin = trained(make_task_run(tmp_path, "twin", sets))
    resumed = make_task_run(tmp_path, "resumed", sets)
    step = f"step-{RESUME_AT:07d}"
    shutil.copytree(twin / "checkpoints" / step, resumed / "checkpoints" / step)
    return twin, trained(resumed)


def read(folder: Path, key: str) -> torch.Tensor:
    from hpc.ckpt.dcp import DcpReader

    reader = DcpReader(folder)
    try:
        return reader.read(key)
    finally:
        reader.close()


CASES = {"ddp": ["parallel.strategy='ddp'"], "fsdp": ["parallel.strategy='fsdp'"],
         "ddp-sync": ["parallel.strategy='ddp'", "task.sync_batchnorm=true"],
         "fsdp-sync": ["parallel.strategy='fsdp'", "task.sync_batchnorm=true"],
         "hsdp-sync": ["parallel.strategy='hsdp'", "parallel.shard_size=1", "task.sync_batchnorm=true"]}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_batchnorm_task_resumes_to_its_twins_losses_and_evaluations_bit_for_bit(tmp_path, case):
    from tests.resilience.resilience_lib import same_checkpoint_tensors

    twin, resumed = resumed_twin(tmp_path, CASES[case])
    (losses, evals), (losses_r, evals_r) = records(twin), records(resumed)
    assert sorted(losses_r) == list(range(RESUME_AT + 1, STEPS + 1))
    assert losses_r == {s: losses[s] for s in losses_r}
    assert sorted(evals_r) == [4, 6] and evals_r == {s: evals[s] for s in evals_r}
    final = f"checkpoints/step-{STEPS:07d}"
    assert same_checkpoint_tensors(twin / final, resumed / final, ("model.", "optim.", "buffers.")) == []
    saved = twin / "checkpoints" / f"step-{RESUME_AT:07d}"
    mean = read(saved, "model.blocks.0.norm1.running_mean")
    assert mean.abs().sum() > 0  # trained statistics, not the initial zeros
    if not case.startswith("ddp"):  # fsdp, hsdp: each rank's own statistics beside rank 0's, which the model entry holds
        own = [read(saved, f"buffers.rank{r}.blocks.{b}.norm{n}.running_{s}") for r in (0, 1)
               for b in (0, 1) for n in (1, 2) for s in ("mean", "var")]
        assert torch.equal(own[0], mean)
        # without SyncBatchNorm each rank's statistics are its own batches'; with it, all ranks' together
        assert all(torch.equal(a, b) for a, b in zip(own[:8], own[8:])) == case.endswith("sync")


def global_plan(planner, states: list[dict]) -> list:
    """The global save plan ``planner`` makes of each rank's state (rank 0 first), in one process."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    local = []
    for rank, state in enumerate(states):
        one = DefaultSavePlanner()
        one.set_up_planner(state, None, rank == 0)
        local.append(one.create_local_plan())
    planner.set_up_planner(states[0], None, True)
    return planner.create_global_plan(local)[0]


def writers(plans: list, key: str) -> list[int]:
    return [rank for rank, plan in enumerate(plans) if any(item.index.fqn == key for item in plan.items)]


@pytest.mark.parametrize("ranks", [2, 3, 8])
def test_a_buffer_is_written_by_rank_0_where_dcp_would_balance_it_onto_another(ranks):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from trainer.checkpoint import BufferPlanner

    keys = ["model.bn.running_mean", "model.bn.running_var", "model.bn.num_batches_tracked"]
    states = [{"model": {"weight": torch.zeros(1000), "bn.running_mean": torch.full((4,), float(r)),
                         "bn.running_var": torch.full((4,), 1.0 + r), "bn.num_batches_tracked": torch.tensor(r)}}
              for r in range(ranks)]
    balanced = global_plan(DefaultSavePlanner(), states)
    assert any(writers(balanced, k) != [0] for k in keys)  # DCP's own: a mix of ranks
    ours = global_plan(BufferPlanner(keys), states)
    assert [writers(ours, k) for k in keys] == [[0]] * 3
    assert writers(ours, "model.weight") == writers(balanced, "model.weight")  # the rest balanced as before


def test_a_dtensor_buffer_chunk_is_written_by_the_first_rank_of_its_replicas():
    from trainer.checkpoint import lowest_rank_buffers
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

    def item(fqn: str, offset: int) -> WriteItem:
        return WriteItem(index=MetadataIndex(fqn, torch.Size([offset])), type=WriteItemType.SHARD)

    # 4 ranks, a buffer sharded in two chunks, each chunk replicated on two ranks (ranks 0,2 and 1,3)
    plans = [SavePlan([item("model.b", 0 if r % 2 == 0 else 2), item("model.w", r)]) for r in range(4)]
    kept = lowest_rank_buffers(plans, frozenset({"model.b"}))
    assert [[(i.index.fqn, i.index.offset[0]) for i in p.items] for p in kept] == [
        [("model.b", 0), ("model.w", 0)], [("model.b", 2), ("model.w", 1)], [("model.w", 2)], [("model.w", 3)]]


def test_the_cpu_sync_batchnorm_of_two_ranks_is_batchnorm_over_their_whole_batch(tmp_path):
    out = tmp_path / "diffs.json"
    proc = torchrun(2, ["tests/trainer/syncbn_worker.py", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for case, diffs in json.loads(out.read_text()).items():
        assert diffs["tracked"] == 0.0, case
        assert max(diffs.values()) < 1e-5, (case, diffs)


def test_sync_batchnorm_refuses_a_model_without_batchnorm_and_keeps_the_keys():
    from hpc.core.errors import ConfigError
    from trainer.syncbn import HostSyncBatchNorm, convert

    with pytest.raises(ConfigError, match="has no BatchNorm layer"):
        convert(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)), "pkg.mod:Task", "cpu")
    for device, kind in (("cpu", HostSyncBatchNorm), ("cuda", nn.SyncBatchNorm)):
        with torch.device("meta"):
            model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Sequential(nn.BatchNorm1d(4)))
        keys = list(model.state_dict())
        converted = convert(model, "pkg.mod:Task", device)
        assert [type(m) for m in (converted[1], converted[2][0])] == [kind] * 2
        assert list(converted.state_dict()) == keys and converted[1].running_mean.is_meta
    # DDP refuses a CPU module that holds a torch SyncBatchNorm; ours is a BatchNorm to it
    assert not isinstance(HostSyncBatchNorm(4), nn.SyncBatchNorm)

"""The checkpoint layer: commit protocol, retention, torn folders, resharding, async == sync."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_helpers import HERE, build, launch, read_json, train_step  # noqa: E402

from hpc.ckpt.digests import check_digests  # noqa: E402
from hpc.core.errors import CheckpointError  # noqa: E402
from trainer.checkpoint import Checkpointer, latest_checkpoint, load_checkpoint, step_dir  # noqa: E402
from hpc.ckpt.convert import verify_checkpoints  # noqa: E402


def trained(steps: int = 1):
    model, optimizer, scheduler = build("none")
    for s in range(steps):
        train_step(model, optimizer, scheduler, s)
    return model, optimizer, scheduler


def test_save_names_commits_and_keeps_newest(tmp_path: Path) -> None:
    model, optimizer, scheduler = trained()
    saves = Checkpointer(tmp_path, keep=2)
    for step in (5, 10, 15):
        path = saves.save(step, model, optimizer, scheduler, {"step": step})
        assert path == tmp_path / "checkpoints" / f"step-{step:07d}" and (path / ".metadata").is_file()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-0000010", "step-0000015"]
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 15)


def test_refuses_to_save_into_an_existing_folder(tmp_path: Path) -> None:
    model, optimizer, scheduler = trained()
    saves = Checkpointer(tmp_path)
    saves.save(3, model, optimizer, scheduler, {"step": 3})
    with pytest.raises(FileExistsError, match="step-0000003"):
        saves.save(3, model, optimizer, scheduler, {"step": 3})
    with pytest.raises(ValueError, match="keep=1"):
        Checkpointer(tmp_path, keep=1)


@pytest.mark.parametrize("damage", ["no-metadata", "missing-shard", "truncated-shard", "partial-folder"])
def test_latest_skips_torn_checkpoints(tmp_path: Path, damage: str) -> None:
    model, optimizer, scheduler = trained()
    saves = Checkpointer(tmp_path, keep=3)
    saves.save(1, model, optimizer, scheduler, {"step": 1})
    newest = saves.save(2, model, optimizer, scheduler, {"step": 2})
    shard = next(newest.glob("*.distcp"))
    if damage == "no-metadata":
        (newest / ".metadata").unlink()
    elif damage == "missing-shard":
        shard.unlink()
    elif damage == "truncated-shard":
        os.truncate(shard, shard.stat().st_size - 1)
    else:
        newest.rename(newest.parent / ".step-0000002.partial")
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 1)
    if damage != "partial-folder":
        with pytest.raises(CheckpointError, match=r"step-0000002"):
            load_checkpoint(newest, *build("none"))


def test_resume_restores_train_state_scheduler_and_rng(tmp_path: Path) -> None:
    model, optimizer, scheduler = trained(3)
    sampler = {"consumed_samples": 12, "epoch": 1}
    Checkpointer(tmp_path).save(3, model, optimizer, scheduler, {"step": 3, "tokens_seen": 192, "sampler": sampler})
    expected_rand = torch.rand(3)
    model2, optimizer2, scheduler2 = build("none", seed=7)
    state = load_checkpoint(latest_checkpoint(tmp_path), model2, optimizer2, scheduler2)
    assert torch.equal(torch.rand(3), expected_rand)  # RNG restored to the moment of the save
    assert (state["step"], state["tokens_seen"], state["sampler"]) == (3, 192, sampler)
    assert state["meta"]["world_size"] == 1 and state["meta"]["strategy"] == "none"
    assert scheduler2.state_dict()["last_epoch"] == scheduler.state_dict()["last_epoch"]
    assert train_step(model2, optimizer2, scheduler2, 3) == train_step(model, optimizer, scheduler, 3)


@pytest.mark.slow
def test_fsdp4_checkpoint_reshards_into_every_strategy(tmp_path: Path) -> None:
    """Saved by fsdp on 4 ranks; loaded by fsdp 4 and 2, hsdp 2x2, ddp 2 and none; same next losses."""
    launch(4, ["save", str(tmp_path / "run"), str(tmp_path / "async"), str(tmp_path / "ref.json")], tmp_path)
    reference = read_json(tmp_path / "ref.json")["losses"][2:]
    checkpoint = step_dir(tmp_path / "run", 2)
    for folder in (checkpoint, step_dir(tmp_path / "async", 2)):  # every rank's shard has its digest
        shards = sorted(p.name for p in folder.glob("*.distcp"))
        assert len(shards) == 4 and check_digests(folder, shards) == {"checked": shards, "missing": []}
    for strategy, world in (("fsdp", 4), ("fsdp", 2), ("hsdp", 4), ("ddp", 2), ("none", 1)):
        out = tmp_path / f"{strategy}{world}.json"
        launch(world, ["load", strategy, str(checkpoint), str(out)], tmp_path)
        got = read_json(out)
        assert (got["step"], got["sampler"]) == (2, {"consumed_samples": 8, "epoch": 0})
        assert got["meta"]["world_size"] == 4 and got["meta"]["strategy"] == "fsdp"
        if strategy == "fsdp" and world == 4:
            assert got["losses"] == reference, "FSDP -> FSDP at the same world size must be bitwise"
        else:
            assert got["losses"] == pytest.approx(reference, abs=1e-5), f"{strategy} on {world}"
    # The async save (written while training mutated the parameters) equals the sync one bit for bit.
    result = verify_checkpoints(checkpoint, step_dir(tmp_path / "async", 2))
    assert [d for d in result["differences"] if not d.startswith("meta.saved_at")] == []


@pytest.mark.slow
def test_sigkill_at_20_points_during_saves_never_leaves_a_trusted_torn_checkpoint(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(HERE / "kill_harness.py"), str(tmp_path), "16"], check=True, timeout=280,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    report = json.loads((tmp_path / "report.json").read_text())
    results = report["results"]
    assert len({(r["kill_rank"], r["kill_at"]) for r in results}) >= 20
    for r in results:
        assert -9 in r["status"].values(), f"{r['name']}: the victim was not killed"
        assert r["latest"] == ("step-0000003" if r["renamed"] else "step-0000002"), r
        assert r["equal_to_reference"], r
    assert any(r["renamed"] for r in results) and not all(r["renamed"] for r in results)

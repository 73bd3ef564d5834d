"""Async saves stage into host buffers reused from one save to the next: each save must still hold
exactly the state of its own step, also when the state's layout changes between saves."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ckpt_helpers import build, train_step  # noqa: E402

from trainer.checkpoint import Checkpointer, load_checkpoint  # noqa: E402


def params(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_consecutive_async_saves_each_hold_their_own_step(tmp_path: Path):
    model, optimizer, scheduler = build("none")
    expected = {}
    saves = Checkpointer(tmp_path, keep=10, async_save=True)
    # step 0 has no optimizer state yet, steps 1-3 do: the staging buffers are rebuilt once, then reused
    for step in range(4):
        if step:
            train_step(model, optimizer, scheduler, step)
        expected[step] = params(model)
        saves.save(step + 1, model, optimizer, scheduler, {"step": step})
        train_step(model, optimizer, scheduler, 100 + step)  # mutate while the write may be in flight
    saves.wait()
    for step, want in expected.items():
        fresh, opt, sched = build("none", seed=1)
        state = load_checkpoint(tmp_path / "checkpoints" / f"step-{step + 1:07d}", fresh, opt, sched,
                                restore_rng=False)
        assert state["step"] == step
        got = params(fresh)
        assert all(got[k].equal(want[k]) for k in want), f"step {step} holds another step's tensors"


def test_staging_runs_behind_the_next_step_and_the_optimizer_waits_for_it(tmp_path: Path, monkeypatch):
    """The async save returns before the state is copied; the optimizer's step must wait for the copy."""
    import threading

    model, optimizer, scheduler = build("none")
    train_step(model, optimizer, scheduler, 0)
    want = params(model)
    saves = Checkpointer(tmp_path, keep=10, async_save=True)
    stager = saves._reused_stager()
    stage, release, staging = stager._stage, threading.Event(), threading.Event()

    def slow_stage(state, **kwargs):  # hold the copy until the test lets it go
        staging.set()
        release.wait(30)
        return stage(state, **kwargs)

    monkeypatch.setattr(stager, "_stage", slow_stage)
    saves.save(1, model, optimizer, scheduler, {"step": 1})
    assert not saves._pending.staged.done() and staging.wait(30)  # returned while the copy is held
    threading.Timer(0.5, release.set).start()
    train_step(model, optimizer, scheduler, 1)  # optimizer.step waits for the copy, then changes the weights
    saves.wait()
    fresh, opt, sched = build("none", seed=1)
    load_checkpoint(tmp_path / "checkpoints" / "step-0000001", fresh, opt, sched, restore_rng=False)
    assert all(params(fresh)[k].equal(v) for k, v in want.items()), "the step changed weights before they were copied"


def test_without_an_optimizer_the_state_is_copied_before_save_returns(tmp_path: Path):
    model, _, _ = build("none")
    want = params(model)
    saves = Checkpointer(tmp_path, async_save=True)
    saves.save(1, model, None, None, {"step": 1})
    with __import__("torch").no_grad():
        for p in model.parameters():
            p.add_(1.0)  # nothing tells the save about this change: it must not be in the checkpoint
    saves.wait()
    fresh, _, _ = build("none", seed=1)
    load_checkpoint(tmp_path / "checkpoints" / "step-0000001", fresh, restore_rng=False)
    assert all(params(fresh)[k].equal(v) for k, v in want.items())


def test_each_checkpointer_waits_for_its_own_save_only(tmp_path: Path):
    model, _, _ = build("none")
    first, second = Checkpointer(tmp_path / "a", async_save=True), Checkpointer(tmp_path / "b", async_save=True)
    path = first.save(1, model, None, None, {"step": 1})
    assert second.wait() is None  # the save in flight is the first one's, not a process-wide one
    assert first.wait() == path and (path / ".metadata").is_file()
    assert first.wait() is None


def test_close_commits_the_save_then_drops_the_stager_and_the_step_hook(tmp_path: Path, monkeypatch):
    model, optimizer, scheduler = build("none")
    train_step(model, optimizer, scheduler, 0)
    saves = Checkpointer(tmp_path, async_save=True)
    path = saves.save(1, model, optimizer, scheduler, {"step": 1})
    assert saves._stager is not None
    saves.close()
    assert (path / ".metadata").is_file() and saves._stager is None

    def hooked() -> None:
        raise AssertionError("optimizer.step still waits on a closed checkpointer")

    monkeypatch.setattr(saves, "wait_staged", hooked)
    train_step(model, optimizer, scheduler, 1)  # optimizer.step no longer asks the closed checkpointer

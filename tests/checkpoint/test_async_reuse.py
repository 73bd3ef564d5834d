"""Async saves stage into host buffers reused from one save to the next: each save must still hold
exactly the state of its own step, also when the state's layout changes between saves."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ckpt_helpers import build, train_step  # noqa: E402

from trainer.checkpoint import load_checkpoint, save_checkpoint, wait_pending  # noqa: E402


def params(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_consecutive_async_saves_each_hold_their_own_step(tmp_path: Path):
    model, optimizer, scheduler = build("none")
    expected = {}
    # step 0 has no optimizer state yet, steps 1-3 do: the staging buffers are rebuilt once, then reused
    for step in range(4):
        if step:
            train_step(model, optimizer, scheduler, step)
        expected[step] = params(model)
        save_checkpoint(tmp_path, step + 1, model, optimizer, scheduler, {"step": step}, keep=10, async_save=True)
        train_step(model, optimizer, scheduler, 100 + step)  # mutate while the write may be in flight
    wait_pending()
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

    from trainer import checkpoint as ckpt

    model, optimizer, scheduler = build("none")
    train_step(model, optimizer, scheduler, 0)
    want = params(model)
    stager = ckpt._reused_stager()
    stage, release, staging = stager._stage, threading.Event(), threading.Event()

    def slow_stage(state, **kwargs):  # hold the copy until the test lets it go
        staging.set()
        release.wait(30)
        return stage(state, **kwargs)

    monkeypatch.setattr(stager, "_stage", slow_stage)
    save_checkpoint(tmp_path, 1, model, optimizer, scheduler, {"step": 1}, keep=10, async_save=True)
    assert not ckpt._pending["staged"].done() and staging.wait(30)  # returned while the copy is held
    threading.Timer(0.5, release.set).start()
    train_step(model, optimizer, scheduler, 1)  # optimizer.step waits for the copy, then changes the weights
    wait_pending()
    fresh, opt, sched = build("none", seed=1)
    load_checkpoint(tmp_path / "checkpoints" / "step-0000001", fresh, opt, sched, restore_rng=False)
    assert all(params(fresh)[k].equal(v) for k, v in want.items()), "the step changed weights before they were copied"


def test_without_an_optimizer_the_state_is_copied_before_save_returns(tmp_path: Path):
    model, _, _ = build("none")
    want = params(model)
    save_checkpoint(tmp_path, 1, model, None, None, {"step": 1}, async_save=True)
    with __import__("torch").no_grad():
        for p in model.parameters():
            p.add_(1.0)  # nothing tells the save about this change: it must not be in the checkpoint
    wait_pending()
    fresh, _, _ = build("none", seed=1)
    load_checkpoint(tmp_path / "checkpoints" / "step-0000001", fresh, restore_rng=False)
    assert all(params(fresh)[k].equal(v) for k, v in want.items())

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

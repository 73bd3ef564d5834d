"""A user model (``model.arch = "tests.gated_model:build"``) whose build waits for a file to exist.

A test that must see what happens while a job has not got far holds it here, instead of racing it:
the job cannot end before the test writes ``gate``.
"""

from __future__ import annotations

import time
from pathlib import Path

from torch import nn

from tests.resilience.failing_model import build as failing_build

WAIT_S = 600.0  # a test that never opens the gate: the job gives up, not the machine


def build(gate: str, vocab_size: int = 64, d_model: int = 16) -> nn.Module:
    """FailingLM that never fails, built once ``gate`` exists (polled, so no clock decides)."""
    for _ in range(int(WAIT_S / 0.1)):
        if Path(gate).exists():
            return failing_build(vocab_size, d_model, fail_after=2**62)
        time.sleep(0.1)
    raise RuntimeError(f"the test never opened {gate}")

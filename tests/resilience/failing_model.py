"""A user model (``model.arch = "tests.resilience.failing_model:build"``) that fails deterministically.

Its forward-call counter is a persistent buffer, so it is saved in checkpoints and restored on
resume: the failure comes back at the same optimizer step after every restart.
"""

from __future__ import annotations

import torch
from torch import nn


class FailingLM(nn.Module):
    def __init__(self, vocab_size: int, d_model: int, fail_after: int, words: str):
        super().__init__()
        self.fail_after, self.words = fail_after, words
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList([nn.Linear(d_model, d_model)])
        self.head = nn.Linear(d_model, vocab_size)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def reset_parameters(self) -> None:
        """The model's own tensor (a model built on the meta device is initialised module by module)."""
        self.calls.zero_()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if int(self.calls) > self.fail_after:
            raise RuntimeError(f"{self.words} in forward call {int(self.calls)}")
        return self.head(torch.relu(self.blocks[0](self.embed(tokens))))


def build(vocab_size: int = 64, d_model: int = 16, fail_after: int = 4,
          words: str = "deterministic failure") -> nn.Module:
    """``words``: the error's message; NCCL's words make it look like the machine's failure (requeued)."""
    return FailingLM(vocab_size, d_model, fail_after, words)

"""User models (``model.arch = "dryrun_models:NAME"``) for ``hpcx dryrun``'s start-up checks: one that
passes, and one per way a job would fail before its first step (``tests/test_dryrun.py``)."""

from __future__ import annotations

import typing as tp
from dataclasses import dataclass

import torch
from torch import nn

NOT_A_FUNCTION = 3  # `dryrun_models:NOT_A_FUNCTION`: not callable


class RMSNorm(nn.Module):
    """A hand-written norm, as in HF models: owns a weight, defines no reset_parameters."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Rotary(nn.Module):
    """Owns a buffer only (like a rotary table's ``inv_freq``), no reset_parameters."""

    def __init__(self, width: int):
        super().__init__()
        self.register_buffer("inv_freq", torch.ones(width // 2), persistent=False)


class Block(nn.Module):
    def __init__(self, width: int, norm: type[nn.Module] = nn.LayerNorm):
        super().__init__()
        self.norm = norm(width)
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(self.norm(x))


class LM(nn.Module):
    """Token ids [batch, seq] → logits [batch, seq, vocab]; blocks at ``blocks``."""

    def __init__(self, vocab: int, width: int, layers: int, norm: type[nn.Module] = nn.LayerNorm):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, norm) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def good(vocab: int = 64, width: int = 16, layers: int = 3) -> nn.Module:
    return LM(vocab, width, layers)


def needs_width(width: int) -> nn.Module:  # called without `model.kwargs`: TypeError
    return LM(64, width, 2)


def no_reset(vocab: int = 64) -> nn.Module:
    model = LM(vocab, 16, 3, norm=RMSNorm)
    model.rotary = Rotary(16)
    return model


@dataclass
class Output:
    """What an HF model returns: an object holding the logits."""

    logits: torch.Tensor
    loss: tp.Any = None


class WithOutput(LM):
    def forward(self, tokens: torch.Tensor) -> Output:  # type: ignore[override]
        return Output(logits=super().forward(tokens))


def hf_output(vocab: int = 64) -> nn.Module:
    return WithOutput(vocab, 16, 2)


class LastOnly(LM):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens)[:, -1]  # the next token's logits only: [batch, vocab]


def last_only(vocab: int = 64) -> nn.Module:
    return LastOnly(vocab, 16, 2)


def sequential_blocks(vocab: int = 64) -> nn.Module:
    model = LM(vocab, 16, 2)
    model.blocks = nn.Sequential(*model.blocks)
    return model


class Trunk(nn.Module):
    """Token ids → logits with its layers in a Sequential named ``trunk`` and no ``blocks``: fine under
    none, dp and ddp; AC, compile, tp and FSDP need a ModuleList to work on."""

    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.trunk = nn.Sequential(nn.Embedding(vocab, width), nn.Linear(width, width), nn.GELU(),
                                   nn.Linear(width, vocab))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.trunk(tokens)


def no_blocks(vocab: int = 64) -> nn.Module:
    return Trunk(vocab, 16)

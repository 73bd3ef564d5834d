"""A user model (``model.arch = "init_models:make"``) for the meta-init tests: torch layers with
biases, a block list at a custom path, a non-persistent buffer computed in ``reset_parameters``,
and an uneven vocabulary, so every kind of tensor goes through ``WeightInit``."""

from __future__ import annotations

import torch
from torch import nn


class Scaled(nn.Module):
    """A module owning a buffer (like a rotary table): ``reset_parameters`` recomputes it."""

    def __init__(self, width: int):
        super().__init__()
        self.gain = nn.Parameter(torch.empty(width))
        self.register_buffer("table", torch.empty(width), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.gain, 0.5, 1.5)
        with torch.no_grad():
            self.table.copy_(torch.arange(self.table.numel(), dtype=self.table.dtype, device=self.table.device) / 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain + self.table


class Layer(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.lin = nn.Linear(width, width)  # kaiming-uniform weight and uniform bias: torch's own init
        self.scale = Scaled(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale(self.lin(self.norm(x)))


class UserLM(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.trunk = nn.Module()
        self.trunk.layers = nn.ModuleList(Layer(width) for _ in range(layers))
        self.out = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.trunk.layers:
            x = layer(x)
        return self.out(x)


def make(vocab: int = 250, width: int = 24, layers: int = 3) -> nn.Module:
    return UserLM(vocab, width, layers)


class NoReset(nn.Module):
    """Owns a parameter but cannot initialise it: refused with the module's name."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))


def make_without_reset(vocab: int = 250) -> nn.Module:
    model = UserLM(vocab, 8, 2)
    model.trunk.layers[1].extra = NoReset()
    return model

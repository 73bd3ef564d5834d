"""The model: the built-in GPT, or a user's ``package.module:function``.

Built-in GPT, from ``hpc.models.gpt_shape`` so the planner's counts hold by
construction: token + learned position embeddings, ``n_layers`` pre-LN blocks
(LayerNorm → causal SDPA attention → LayerNorm → 4× GELU MLP), a final
LayerNorm and an output head (tied to the token embedding when the shape says
so). Linear layers have no bias; LayerNorms have weight and bias.

User models
-----------
``model.arch = "pkg.mod:function"`` imports ``pkg.mod`` and calls
``function(**model.kwargs)``; it must return an ``nn.Module`` whose forward
takes a ``LongTensor[batch, seq]`` of token ids and returns logits
``[batch, seq, vocab]``. ``model.blocks`` is the attribute path (dots, e.g.
``transformer.h``) of the ``nn.ModuleList`` whose children are the repeated
units: each is activation-checkpointed, compiled and ``fully_shard``-ed on its
own. Default path: ``blocks`` (what the built-in GPT uses).
"""

from __future__ import annotations

import importlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from hpc.models import GPTShape, model_facts
from hpc.spec import Model as ModelSpec

DEFAULT_BLOCKS = "blocks"


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (t.view(b, s, self.n_heads, d // self.n_heads).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model, bias=False)
        self.proj = nn.Linear(4 * d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """One pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """The built-in GPT; ``GPT(shape).num_params() == shape.n_params``."""

    def __init__(self, shape: GPTShape, dropout: float = 0.0):
        super().__init__()
        self.shape = shape
        self.tok_emb = nn.Embedding(shape.vocab_size, shape.d_model)
        self.pos_emb = nn.Embedding(shape.seq_len, shape.d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(shape.d_model, shape.n_heads, dropout) for _ in range(shape.n_layers))
        self.ln_f = nn.LayerNorm(shape.d_model)
        self.head = nn.Linear(shape.d_model, shape.vocab_size, bias=False)
        if shape.tied:  # one matrix for both; parameters() lists it once, under tok_emb
            self.head.weight = self.tok_emb.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2·layers)."""
        residual_std = 0.02 / math.sqrt(2 * max(1, self.shape.n_layers))
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # LayerNorms keep their ones/zeros
            std = residual_std if name.endswith("proj.weight") else 0.02
            nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_model(spec: ModelSpec) -> nn.Module:
    """The model of ``spec`` on the CPU in fp32, initialized from the current torch RNG."""
    shape = model_facts(spec).gpt
    if shape is not None:
        return GPT(shape, spec.dropout)
    module_name, function_name = spec.arch.split(":")
    model = getattr(importlib.import_module(module_name), function_name)(**spec.kwargs)
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model.arch` = {spec.arch!r} returned {type(model).__name__}, expected an nn.Module")
    return model


def model_blocks(model: nn.Module, path: str = "") -> nn.ModuleList:
    """The ModuleList at attribute path ``path`` (default ``blocks``): the units to shard and checkpoint."""
    path = path or DEFAULT_BLOCKS
    target: object = model
    for part in path.split("."):
        if not hasattr(target, part):
            children = ", ".join(n for n, _ in target.named_children()) if isinstance(target, nn.Module) else ""
            raise AttributeError(f"`model.blocks` = {path!r}: {type(target).__name__} has no attribute {part!r} "
                                 f"(children: {children or 'none'})")
        target = getattr(target, part)
    if not isinstance(target, nn.ModuleList):
        raise TypeError(f"`model.blocks` = {path!r} is a {type(target).__name__}, expected nn.ModuleList")
    return target

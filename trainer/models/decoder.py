"""What the built-in decoder families (``trainer.models.gpt``, ``trainer.models.llama``) share: bias-free
linear layers and embeddings initialised N(0, 0.02) as GPT-2 does, the scaled init of the residual
projections, causal attention over heads, the parameter count. A family module imports this, never
another family's module (tests/test_layers.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

GPT2_STD = 0.02


def residual_std(n_layers: int) -> float:
    """The init std of each block's residual projections: N(0, 0.02/sqrt(2·layers)) (GPT-2)."""
    return GPT2_STD / math.sqrt(2 * max(1, n_layers))


class Linear(nn.Linear):
    """A bias-free linear layer initialised N(0, std) as GPT-2 does (torch's default is kaiming-uniform)."""

    def __init__(self, d_in: int, d_out: int, std: float = GPT2_STD):
        self.std = std  # set first: nn.Linear.__init__ calls reset_parameters
        super().__init__(d_in, d_out, bias=False)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)


class Embedding(nn.Embedding):
    """An embedding initialised N(0, 0.02) (torch's default is N(0, 1))."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=GPT2_STD)


def heads(x: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """[batch, seq, n_heads·head_dim] → [batch, n_heads, seq, head_dim] (a view)."""
    b, s, _ = x.shape
    return x.view(b, s, n_heads, head_dim).transpose(1, 2)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float = 0.0,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA over heads ([batch, heads, seq, head_dim]; fewer key/value heads than query heads share
    them, grouped-query attention), back to [batch, seq, heads·head_dim]. ``mask``: None is plain
    causal attention (SDPA's ``is_causal``, its fused kernels); else a boolean ``[batch, 1, seq, seq]``,
    True where a query may see a key, causality included (``document_mask``)."""
    gqa = k.shape[1] != q.shape[1]
    if mask is None:
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, enable_gqa=gqa)
    else:
        if gqa:  # a mask with enable_gqa leaves SDPA only its math kernel (every head's scores materialized)
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
    b, _, s, _ = q.shape
    return y.transpose(1, 2).reshape(b, s, -1)


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """The block-diagonal causal mask of packed documents: ``documents`` [batch, seq] numbers each
    position's document (non-decreasing along a window); a query sees the keys of its own document up
    to itself. Boolean [batch, 1, seq, seq] (one byte per pair, built once per forward and shared by
    every layer: the planner's ``mask`` term); every row sees at least its own key, so none is all -inf."""
    seq = documents.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
    return ((documents[:, :, None] == documents[:, None, :]) & causal).unsqueeze(1)


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Each position's offset in its document ([batch, seq] int64): positions restart at 0 where the
    document number changes (and at the window's first token)."""
    seq = documents.shape[1]
    index = torch.arange(seq, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def num_params(model: nn.Module) -> int:
    """Parameters of ``model``, a tied matrix once."""
    return sum(p.numel() for p in model.parameters())

"""The built-in GPT's trainer side: its ``nn.Module`` from ``hpc.core.models.gpt``'s shape, so the
planner's counts hold by construction.

Token + learned position embeddings, ``n_layers`` pre-LN blocks (LayerNorm → causal SDPA attention →
LayerNorm → 4× GELU MLP), a final LayerNorm and an output head (tied to the token embedding when the
shape says so). Linear layers have no bias; LayerNorms have weight and bias. GPT-2 initialisation
(each module's ``reset_parameters``): N(0, 0.02), the two residual projections of each block
N(0, 0.02/sqrt(2·layers)), LayerNorms ones/zeros. Its FSDP units outside the blocks: ``GPT.fsdp_units``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hpc.core.models import model_facts
from hpc.core.models.gpt import GPTShape
from hpc.core.spec import Model as ModelSpec
from trainer.models.decoder import (GPT2_STD, DocumentAttention, Embedding, Linear, causal_attention,
                                    document_attention, document_positions, heads, num_params, residual_std)

__all__ = ["GPT", "GPT2_STD", "Block", "CausalSelfAttention", "Embedding", "Linear", "MLP", "build"]



def build(spec: ModelSpec) -> nn.Module:
    """The GPT of ``spec`` (under the caller's ``torch.device``)."""
    return GPT(model_facts(spec).shape, spec.dropout)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float, residual_std: float):
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = Linear(d_model, 3 * d_model)
        self.proj = Linear(d_model, d_model, residual_std)

    def forward(self, x: torch.Tensor, mask: DocumentAttention | None = None) -> torch.Tensor:
        d = x.shape[-1]
        q, k, v = (heads(t, self.n_heads, d // self.n_heads) for t in self.qkv(x).split(d, dim=2))
        return self.proj(causal_attention(q, k, v, self.dropout if self.training else 0.0, mask))


class MLP(nn.Module):
    def __init__(self, d_model: int, residual_std: float):
        super().__init__()
        self.fc = Linear(d_model, 4 * d_model)
        self.proj = Linear(4 * d_model, d_model, residual_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """One pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int, dropout: float, residual_std: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout, residual_std)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, residual_std)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: DocumentAttention | None = None) -> torch.Tensor:
        # the mask only when there is one: the tensor-parallel plan prepares the one input (``trainer.tp``)
        x = x + self.drop(self.attn(self.ln1(x)) if mask is None else self.attn(self.ln1(x), mask))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """The built-in GPT; ``GPT(shape).num_params() == shape.n_params``."""

    document_kernel: str | None = None  # packed documents' attention kernel (None: the device's; ``DocumentAttention``)

    def __init__(self, shape: GPTShape, dropout: float = 0.0):
        super().__init__()
        self.shape = shape
        std = residual_std(shape.n_layers)
        self.tok_emb = Embedding(shape.vocab_size, shape.d_model)
        self.pos_emb = Embedding(shape.seq_len, shape.d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(shape.d_model, shape.n_heads, dropout, std) for _ in range(shape.n_layers))
        self.ln_f = nn.LayerNorm(shape.d_model)
        self.head = Linear(shape.d_model, shape.vocab_size)
        if shape.tied:  # one matrix for both; parameters() lists it once, under tok_emb
            self.head.weight = self.tok_emb.weight

    def forward(self, tokens: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ``tokens`` [batch, seq]; with ``documents`` (each position's document number, packed
        windows: ``data.packing = "document"``) positions restart per document and attention stays inside it
        (``DocumentAttention``, prepared once for every layer)."""
        if documents is None:
            pos, mask = torch.arange(tokens.shape[1], device=tokens.device), None
        else:
            dropout = self.drop.p if self.training else 0.0  # flex_attention has none: then the segments kernel
            pos, mask = document_positions(documents), document_attention(documents, self.document_kernel, dropout)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x) if mask is None else block(x, mask)
        return self.head(self.ln_f(x))

    def fsdp_units(self) -> list[list[nn.Module]]:
        """The modules outside the blocks, as FSDP units in forward order: embeddings, final norm + head.
        A tied head shares its matrix with the token embedding, which one parameter cannot be in two
        units: then they all stay in the root unit."""
        if self.shape.tied:
            return []
        return [[self.tok_emb, self.pos_emb], [self.ln_f, self.head]]

    def num_params(self) -> int:
        return num_params(self)

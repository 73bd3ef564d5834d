"""The Llama family's trainer side: ``Llama(shape)`` from ``hpc.core.models.llama.LlamaShape``.

RMSNorm → grouped-query attention (rotary embeddings on q and k, ``F.scaled_dot_product_attention``)
→ RMSNorm → SwiGLU MLP, per block; token embedding in front, final RMSNorm and output head behind
(tied to the embedding when the shape says so). Linear layers have no bias. The rotary embedding
rotates the two halves of each head, as ``transformers``' ``LlamaForCausalLM`` does, so the weights
map to it name for name (``hpc.core.models.llama.hf_names``) without the q/k row permutation Meta's interleaved layout
needs. Initialisation as the GPT's (``trainer.models.decoder``): N(0, 0.02), the residual projections
(``wo``, ``w2``) N(0, 0.02/sqrt(2·layers)), norms ones, the rotary buffer computed; every module
that owns tensors has ``reset_parameters`` so ``WeightInit`` builds it on the meta device.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hpc.core.models import model_facts
from hpc.core.models.llama import LlamaShape
from hpc.core.spec import Model as ModelSpec
from trainer.models.decoder import Embedding, Linear, causal_attention, heads, num_params, residual_std


def build(spec: ModelSpec) -> nn.Module:
    """The Llama of ``spec`` (under the caller's ``torch.device``)."""
    return Llama(model_facts(spec).shape)


class RMSNorm(nn.Module):
    """x / rms(x) · weight; normalised in fp32, cast back to the input's dtype before the weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).type_as(x) * self.weight


def rope_frequencies(shape: LlamaShape) -> torch.Tensor:
    """The inverse frequencies of each rotated pair, with Llama 3's scaling when ``rope_factor`` > 1:
    wavelengths longer than original/low are divided by the factor, shorter than original/high kept,
    and those between interpolated smoothly."""
    half = torch.arange(0, shape.head_dim, 2, dtype=torch.int64).float() / shape.head_dim
    inv = 1.0 / (shape.rope_theta ** half)
    if shape.rope_factor <= 1:
        return inv
    factor, low, high = shape.rope_factor, shape.rope_low_freq_factor, shape.rope_high_freq_factor
    original = shape.rope_original_seq_len
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > original / low, inv / factor, inv)
    smooth = (original / wavelen - low) / (high - low)
    between = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(between, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


class Rotary(nn.Module):
    """The rotary embedding's inverse frequencies (a buffer outside the state dict) and cos/sin per position."""

    inv_freq: torch.Tensor  # registered in __init__

    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.shape = shape
        self.register_buffer("inv_freq", torch.empty(shape.head_dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.inv_freq.copy_(rope_frequencies(self.shape).to(self.inv_freq.device))

    def forward(self, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(seq_len, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.float())
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin over the last dimension (first half against second half)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """Grouped-query causal self-attention: ``n_kv_heads`` key/value heads shared by ``n_heads`` queries."""

    def __init__(self, shape: LlamaShape, residual_std: float):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = shape.n_heads, shape.n_kv_heads, shape.head_dim
        self.wq = Linear(shape.d_model, shape.d_model)
        self.wk = Linear(shape.d_model, shape.kv_dim)
        self.wv = Linear(shape.d_model, shape.kv_dim)
        self.wo = Linear(shape.d_model, shape.d_model, residual_std)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Heads counted from the projections' width: under tensor parallelism (``trainer.tp``) each
        rank holds ``n_heads / tp`` query and ``n_kv_heads / tp`` key/value heads."""
        q = rotate(heads(self.wq(x), -1, self.head_dim), cos, sin)
        k = rotate(heads(self.wk(x), -1, self.head_dim), cos, sin)
        v = heads(self.wv(x), -1, self.head_dim)
        return self.wo(causal_attention(q, k, v))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) · w3 x)."""

    def __init__(self, shape: LlamaShape, residual_std: float):
        super().__init__()
        self.w1 = Linear(shape.d_model, shape.ffn_dim)
        self.w2 = Linear(shape.ffn_dim, shape.d_model, residual_std)
        self.w3 = Linear(shape.d_model, shape.ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, shape: LlamaShape, residual_std: float):
        super().__init__()
        self.attn_norm = RMSNorm(shape.d_model, shape.norm_eps)
        self.attn = Attention(shape, residual_std)
        self.mlp_norm = RMSNorm(shape.d_model, shape.norm_eps)
        self.mlp = SwiGLU(shape, residual_std)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """The built-in Llama; ``Llama(shape).num_params() == shape.n_params``."""

    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.shape = shape
        std = residual_std(shape.n_layers)
        self.tok_emb = Embedding(shape.vocab_size, shape.d_model)
        self.rope = Rotary(shape)
        self.blocks = nn.ModuleList(LlamaBlock(shape, std) for _ in range(shape.n_layers))
        self.norm = RMSNorm(shape.d_model, shape.norm_eps)
        self.head = Linear(shape.d_model, shape.vocab_size)
        if shape.tied:  # one matrix for both; parameters() lists it once, under tok_emb
            self.head.weight = self.tok_emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens)
        cos, sin = self.rope(tokens.shape[1], x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))

    def fsdp_units(self) -> list[list[nn.Module]]:
        """The embedding, then final norm + head, as units of their own; all in the root when tied."""
        return [] if self.shape.tied else [[self.tok_emb], [self.norm, self.head]]

    def num_params(self) -> int:
        return num_params(self)

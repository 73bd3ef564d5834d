"""What the built-in decoder families share: linear layers and embeddings initialised N(0, 0.02) as
GPT-2 does, the scaled init of the residual projections, causal attention over heads (with a sliding
window when asked), the parameter count; and the Llama block (``LlamaBlock``, ``Llama``) that the
``llama``, ``qwen2`` and ``mistral`` families build from their ``LlamaShape``. A family module imports
this, never another family's module (tests/test_layers.py).

The Llama block: RMSNorm → grouped-query attention (rotary embeddings on q and k,
``F.scaled_dot_product_attention``) → RMSNorm → SwiGLU MLP; token embedding in front, final RMSNorm and
output head behind (tied to the embedding when the shape says so). Linear layers have no bias, but q, k
and v have one when ``shape.qkv_bias`` (Qwen2). The rotary embedding rotates the two halves of each
head, as ``transformers``' ``LlamaForCausalLM`` does, so the weights map to it name for name
(``hpc.core.models.decoder.hf_names``) without the q/k row permutation Meta's interleaved layout needs.
Initialisation as the GPT's: N(0, 0.02), the residual projections (``wo``, ``w2``) N(0,
0.02/sqrt(2·layers)), biases zeros, norms ones, the rotary buffer computed; every module that owns
tensors has ``reset_parameters`` so ``WeightInit`` builds it on the meta device.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hpc.core.models.decoder import LlamaShape

GPT2_STD = 0.02


def residual_std(n_layers: int) -> float:
    """The init std of each block's residual projections: N(0, 0.02/sqrt(2·layers)) (GPT-2)."""
    return GPT2_STD / math.sqrt(2 * max(1, n_layers))


class Linear(nn.Linear):
    """A linear layer initialised N(0, std) as GPT-2 does (torch's default is kaiming-uniform); bias-free
    unless ``bias`` (then zeros, as transformers initialises Qwen2's)."""

    def __init__(self, d_in: int, d_out: int, std: float = GPT2_STD, bias: bool = False):
        self.std = std  # set first: nn.Linear.__init__ calls reset_parameters
        super().__init__(d_in, d_out, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    """An embedding initialised N(0, 0.02) (torch's default is N(0, 1))."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=GPT2_STD)


def heads(x: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """[batch, seq, n_heads·head_dim] → [batch, n_heads, seq, head_dim] (a view)."""
    b, s, _ = x.shape
    return x.view(b, s, n_heads, head_dim).transpose(1, 2)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float = 0.0,
                     mask: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """SDPA over heads ([batch, heads, seq, head_dim]; fewer key/value heads than query heads share
    them, grouped-query attention), back to [batch, seq, heads·head_dim]. ``mask``: None is plain
    causal attention (SDPA's ``is_causal``, its fused kernels); else a boolean ``[batch, 1, seq, seq]``,
    True where a query may see a key, causality included (``document_mask``). ``window`` > 0 shorter than
    the sequence: each query sees the last ``window`` keys, itself included (a banded causal mask, as
    transformers' sliding window: key > query - window), within its document when both are given."""
    gqa = k.shape[1] != q.shape[1]
    windowed = 0 < window < q.shape[2]
    if mask is None and not windowed:
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, enable_gqa=gqa)
    else:
        if windowed:
            band = sliding_window_mask(q.shape[2], window, q.device)
            mask = band if mask is None else mask & band
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


def sliding_window_mask(seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    """[seq, seq] booleans: True where query i may attend to key j (i - window < j <= i)."""
    i = torch.arange(seq_len, device=device)
    back = i[:, None] - i[None, :]
    return (back >= 0) & (back < window)


def num_params(model: nn.Module) -> int:
    """Parameters of ``model``, a tied matrix once."""
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- the Llama block


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

    def forward(self, seq_len: int, dtype: torch.dtype,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions ``0 .. seq_len-1`` ([seq, head_dim]), or of ``positions`` [batch, seq]
        ([batch, 1, seq, head_dim]: broadcast over heads)."""
        if positions is None:
            t = torch.arange(seq_len, device=self.inv_freq.device, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq.float())
        else:
            freqs = (positions.to(torch.float32)[..., None] * self.inv_freq.float()).unsqueeze(1)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin over the last dimension (first half against second half)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """Grouped-query causal self-attention: ``n_kv_heads`` key/value heads shared by ``n_heads`` queries
    (within the last ``shape.window`` tokens when set)."""

    def __init__(self, shape: LlamaShape, residual_std: float):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = shape.n_heads, shape.n_kv_heads, shape.head_dim
        self.window = shape.window
        self.wq = Linear(shape.d_model, shape.q_dim, bias=shape.qkv_bias)
        self.wk = Linear(shape.d_model, shape.kv_dim, bias=shape.qkv_bias)
        self.wv = Linear(shape.d_model, shape.kv_dim, bias=shape.qkv_bias)
        self.wo = Linear(shape.q_dim, shape.d_model, residual_std)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Heads counted from the projections' width: under tensor parallelism (``trainer.tp``) each
        rank holds ``n_heads / tp`` query and ``n_kv_heads / tp`` key/value heads."""
        q = rotate(heads(self.wq(x), -1, self.head_dim), cos, sin)
        k = rotate(heads(self.wk(x), -1, self.head_dim), cos, sin)
        v = heads(self.wv(x), -1, self.head_dim)
        return self.wo(causal_attention(q, k, v, mask=mask, window=self.window))


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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        # the mask only when there is one: the tensor-parallel plan prepares (x, cos, sin) (``trainer.tp``)
        x = x + (self.attn(self.attn_norm(x), cos, sin) if mask is None else self.attn(self.attn_norm(x), cos, sin, mask))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """The Llama-block model of ``shape`` (Llama, Qwen2, Mistral); ``Llama(shape).num_params() == shape.n_params``."""

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

    def forward(self, tokens: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ``tokens`` [batch, seq]; with ``documents`` (each position's document number, packed
        windows: ``data.packing = "document"``) rotary positions restart per document and attention
        stays inside it."""
        x = self.tok_emb(tokens)
        if documents is None:
            cos, sin = self.rope(tokens.shape[1], x.dtype)
            for block in self.blocks:
                x = block(x, cos, sin)
        else:
            cos, sin = self.rope(tokens.shape[1], x.dtype, document_positions(documents))
            mask = document_mask(documents)
            for block in self.blocks:
                x = block(x, cos, sin, mask)
        return self.head(self.norm(x))

    def fsdp_units(self) -> list[list[nn.Module]]:
        """The embedding, then final norm + head, as units of their own; all in the root when tied."""
        return [] if self.shape.tied else [[self.tok_emb], [self.norm, self.head]]

    def num_params(self) -> int:
        return num_params(self)

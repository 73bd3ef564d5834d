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
import typing as tp
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from hpc.core.models.decoder import FLEX, MASK, SEGMENTS, LlamaShape, document_kernel

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
                     mask: DocumentAttention | None = None, window: int = 0) -> torch.Tensor:
    """Causal attention over heads ([batch, heads, seq, head_dim]; fewer key/value heads than query heads
    share them, grouped-query attention), back to [batch, seq, heads·head_dim]. ``mask``: None is plain
    causal attention (SDPA's ``is_causal``, its fused kernels); else the packed documents of the batch
    (``DocumentAttention``: a query sees the keys of its own document up to itself) through its kernel.
    ``window`` > 0 shorter than the sequence: each query sees the last ``window`` keys, itself included
    (a banded causal mask, as transformers' sliding window: key > query - window), within its document
    when both are given."""
    if mask is not None:
        y = mask.attend(q, k, v, dropout, window)
    elif 0 < window < q.shape[2]:
        y = sdpa(q, k, v, dropout, sliding_window_mask(q.shape[2], window, q.device), repeat_kv=True)
    else:
        y = sdpa(q, k, v, dropout)
    b, _, s, _ = q.shape
    return y.transpose(1, 2).reshape(b, s, -1)


def native_gqa(device_type: str, dtype: torch.dtype, masked: bool) -> bool:
    """Whether SDPA's kernel for ``q`` takes fewer key/value heads itself (``enable_gqa``): the CPU's
    flash kernel does in every dtype, mask or not; on CUDA only the flash kernel does (bf16/fp16, no
    mask), and anything else with ``enable_gqa`` leaves SDPA its math kernel (every head's scores
    materialized), so there k and v are repeated for the memory-efficient kernel instead."""
    return device_type != "cuda" or (dtype in (torch.float16, torch.bfloat16) and not masked)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float,
         mask: torch.Tensor | None = None, repeat_kv: bool = False) -> torch.Tensor:
    """SDPA, causal (``mask`` None) or under a boolean ``mask`` (True: may attend), [batch, heads, seq,
    head_dim]; ``repeat_kv``: k and v repeated to every query head whatever the kernel (what the planner
    counts for a sliding window, ``hpc.core.models.decoder.block_activations``)."""
    if k.shape[1] != q.shape[1] and (repeat_kv or not native_gqa(q.device.type, q.dtype, mask is not None)):
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    gqa = k.shape[1] != q.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, enable_gqa=gqa)


@dataclass
class DocumentAttention:
    """How every layer of one forward attends within the packed documents of its micro-batch, prepared
    once (``document_attention``) and shared by the layers. The kernel (``hpc.core.models.decoder.document_kernel``):

    - ``flex``: ``flex_attention`` (compiled) over a BlockMask whose mask_mod is causal within a document
      id (torchtune's ``packed_block_causal_mask``, torchtitan's flex path): it skips the blocks no query
      may see, takes GQA without repeating k/v (``enable_gqa``), and holds O(seq²/128²) int32
      (``block_mask_bytes``) instead of a dense mask. Its backward runs on CUDA only (torch 2.13).
    - ``segments``: SDPA's causal kernel once per document span (rows × documents calls per layer), exact
      and fused on the CPU, with dropout too; it reads the spans on the host once per forward.
    - ``mask``: the dense boolean ``[batch, 1, seq, seq]`` (``document_mask``): kept for the meta device
      (``hpcx dryrun``, where no span can be read) and as the reference the others are tested against.
    """

    kernel: str
    documents: torch.Tensor
    block_mask: tp.Any = None  # flex
    spans: tuple[tuple[tuple[int, int], ...], ...] = ()  # segments: each row's (start, end) per document
    dense: torch.Tensor | None = None  # mask

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, window: int) -> torch.Tensor:
        """[batch, heads, seq, head_dim] attended within documents (and ``window``)."""
        if self.kernel == FLEX:
            return flex(q, k, v, self.block_mask if not 0 < window < q.shape[2] else self.windowed(window))
        if self.kernel == SEGMENTS:
            return segment_attention(q, k, v, self.spans, dropout, window)
        mask = self.dense
        assert mask is not None
        if 0 < window < q.shape[2]:
            mask = mask & sliding_window_mask(q.shape[2], window, q.device)
        return sdpa(q, k, v, dropout, mask)

    def windowed(self, window: int) -> tp.Any:
        """The BlockMask with a sliding window as well (made on first use, kept for the other layers)."""
        if getattr(self, "_windowed", None) is None:
            self._windowed = block_mask(self.documents, window)
        return self._windowed


def document_attention(documents: torch.Tensor, kernel: str | None = None, dropout: float = 0.0) -> DocumentAttention:
    """The packed documents of a micro-batch (``documents`` [batch, seq]: each position's document
    number, non-decreasing along a window) prepared for ``kernel`` (None: the device's,
    ``document_kernel``; always ``mask`` on the meta device)."""
    if documents.device.type == "meta":
        kernel = MASK
    elif kernel is None:
        kernel = document_kernel(documents.device.type == "cuda", dropout)
    if kernel == FLEX:
        return DocumentAttention(FLEX, documents, block_mask=block_mask(documents, 0))
    if kernel == SEGMENTS:
        return DocumentAttention(SEGMENTS, documents, spans=document_spans(documents))
    if kernel == MASK:
        return DocumentAttention(MASK, documents, dense=document_mask(documents))
    raise ValueError(f"document attention kernel {kernel!r}: expected {FLEX}, {SEGMENTS} or {MASK}")


def block_mask(documents: torch.Tensor, window: int) -> tp.Any:
    """flex_attention's BlockMask of packed documents: key ≤ query in the same document (and within
    ``window``). Built by evaluating the mask_mod block by block (compiled on CUDA, as torchtitan does:
    eager, ``create_block_mask`` materializes the dense mask once while it builds)."""
    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        keep = (documents[b, q_idx] == documents[b, kv_idx]) & (q_idx >= kv_idx)
        return keep & (q_idx - kv_idx < window) if window else keep

    batch, seq = documents.shape
    return create_block_mask(mask_mod, batch, None, seq, seq, device=documents.device,
                             _compile=documents.device.type == "cuda")


_COMPILED_FLEX: list[tp.Callable] = []


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: tp.Any) -> torch.Tensor:
    """``flex_attention`` under ``mask``, GQA by ``enable_gqa``: compiled on CUDA (eager it is a reference
    that materializes the scores); eager elsewhere (the CPU runs its forward only: tests, no-grad eval)."""
    gqa = k.shape[1] != q.shape[1]
    if q.device.type == "cuda":
        if not _COMPILED_FLEX:
            _COMPILED_FLEX.append(torch.compile(flex_attention, dynamic=False))
        return _COMPILED_FLEX[0](q, k, v, block_mask=mask, enable_gqa=gqa)
    with warnings.catch_warnings():  # "called without torch.compile()": meant, off CUDA
        warnings.simplefilter("ignore", UserWarning)
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)


def document_spans(documents: torch.Tensor) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Each row's documents as (start, end) position spans, read on the host (one copy per forward)."""
    seq = documents.shape[1]
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    rows = []
    for row in starts.cpu():
        first = row.nonzero().flatten().tolist()
        rows.append(tuple(zip(first, first[1:] + [seq])))
    return tuple(rows)


@torch.compiler.disable  # a compiled block breaks its graph here rather than specializing on every batch's spans
def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      spans: tuple[tuple[tuple[int, int], ...], ...], dropout: float, window: int) -> torch.Tensor:
    """SDPA's causal kernel over each document span of each row (a span longer than ``window`` under its
    band mask, the span's own), concatenated back to [batch, heads, seq, head_dim]. q, k and v are made
    contiguous in [batch, heads, seq, head_dim] first (one copy each, which SDPA keeps in place of the
    originals): the CPU's flash backward on the strided views of the projections is ~10× slower
    (bench/packing). Rows are unbound and spans split (one stack and one cat in backward, not a
    full-size gradient per slice); each output is [1, span, heads, head_dim] in memory, so the
    concatenation is the layout the output projection reads."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    rows = []
    for qr, kr, vr, row in zip(q.unbind(0), k.unbind(0), v.unbind(0), spans):
        lengths = [end - start for start, end in row]
        parts = []
        for qs, ks, vs in zip(qr.split(lengths, 1), kr.split(lengths, 1), vr.split(lengths, 1)):
            n = qs.shape[1]
            band = sliding_window_mask(n, window, q.device) if 0 < window < n else None
            parts.append(sdpa(qs[None], ks[None], vs[None], dropout, band).transpose(1, 2))
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows, dim=0).transpose(1, 2)


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """The block-diagonal causal mask of packed documents (the ``mask`` kernel): ``documents`` [batch,
    seq] numbers each position's document (non-decreasing along a window); a query sees the keys of its
    own document up to itself. Boolean [batch, 1, seq, seq], built once per forward and shared by every
    layer; every row sees at least its own key, so none is all -inf."""
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
                mask: DocumentAttention | None = None) -> torch.Tensor:
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
                mask: DocumentAttention | None = None) -> torch.Tensor:
        # the mask only when there is one: the tensor-parallel plan prepares (x, cos, sin) (``trainer.tp``)
        x = x + (self.attn(self.attn_norm(x), cos, sin) if mask is None else self.attn(self.attn_norm(x), cos, sin, mask))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """The Llama-block model of ``shape`` (Llama, Qwen2, Mistral); ``Llama(shape).num_params() == shape.n_params``."""

    document_kernel: str | None = None  # packed documents' attention kernel (None: the device's; ``DocumentAttention``)

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
        stays inside it (``DocumentAttention``, prepared once for every layer)."""
        x = self.tok_emb(tokens)
        if documents is None:
            cos, sin = self.rope(tokens.shape[1], x.dtype)
            for block in self.blocks:
                x = block(x, cos, sin)
        else:
            cos, sin = self.rope(tokens.shape[1], x.dtype, document_positions(documents))
            mask = document_attention(documents, self.document_kernel)
            for block in self.blocks:
                x = block(x, cos, sin, mask)
        return self.head(self.norm(x))

    def fsdp_units(self) -> list[list[nn.Module]]:
        """The embedding, then final norm + head, as units of their own; all in the root when tied."""
        return [] if self.shape.tied else [[self.tok_emb], [self.norm, self.head]]

    def num_params(self) -> int:
        return num_params(self)

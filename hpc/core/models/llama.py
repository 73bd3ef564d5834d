"""The Llama family without torch: its shape, exact parameter count, FLOPs, activation bytes, checks.

``model.arch = "llama"`` with a preset ``model.size`` (``LLAMA_PRESETS``: the published shapes of
Llama 2 and 3, whose counts here are exact, and tiny ones for tests) and any shape field of the
spec in its place, or every shape from a Hugging Face ``config.json`` (``model.hf_config``, see
``hpc.core.hf``). The trainer builds ``trainer.models.llama.Llama`` from the same ``LlamaShape``, so the
planner's counts hold by construction:

token embedding, ``n_layers`` blocks of (RMSNorm, grouped-query attention with rotary position
embeddings, RMSNorm, SwiGLU MLP), a final RMSNorm and an output head (its own matrix, or the
embedding's when tied). No biases, no learned positions, no dropout. The rotary embedding rotates
the two halves of each head (Hugging Face's layout, so q and k map to ``LlamaForCausalLM`` without
a permutation), with Llama 3's frequency scaling when ``rope_factor`` is above 1.
"""

from __future__ import annotations

import math
import typing as tp
from dataclasses import dataclass, replace

from hpc.core.config import field
from hpc.core.models import Counted, ModelFacts, compute_bytes, count_text, residual_bytes
from hpc.core.models.decoder import LOGIT_BYTES, Activations, decoder_activations

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.core.spec import Model

ARCH = "llama"


@dataclass
class Fields:
    """The ``[model]`` fields only the Llama reads (0 keeps the preset's value); joined into the spec's
    section by ``hpc.core.models.section_class``."""

    n_kv_heads: int = field(0, doc="Llama: key/value heads of grouped-query attention (0: the preset's); must "
                            "divide `n_heads`.", minimum=0)
    ffn_dim: int = field(0, doc="Llama: the SwiGLU MLP's hidden width (0: from `multiple_of` and "
                         "`ffn_dim_multiplier`, as Meta's code computes it).", minimum=0)
    multiple_of: int = field(0, doc="Llama: the MLP width is rounded up to a multiple of this (0: the preset's).",
                             minimum=0)
    ffn_dim_multiplier: float = field(0.0, doc="Llama: factor on 8/3·dim before rounding (0: the preset's).",
                                      minimum=0)
    rope_theta: float = field(0.0, doc="Llama: rotary embedding base (0: the preset's; 10000 for Llama 2, "
                              "500000 for Llama 3).", minimum=0, maximum=1e12)
    rope_factor: float = field(0.0, doc="Llama 3.1+: rotary frequency scaling factor (0: the preset's; 1: no "
                               "scaling).", minimum=0)
    rope_low_freq_factor: float = field(0.0, doc="Llama 3.1+: low-frequency factor of the scaling (0: 1).",
                                        minimum=0)
    rope_high_freq_factor: float = field(0.0, doc="Llama 3.1+: high-frequency factor of the scaling (0: 4).",
                                         minimum=0)
    rope_original_seq_len: int = field(0, doc="Llama 3.1+: the context the scaling starts from (0: 8192).",
                                       minimum=0)
    norm_eps: float = field(0.0, doc="Llama: RMSNorm epsilon (0: the preset's, 1e-5).", minimum=0)
    context_len: int = field(0, doc="Llama: the model's context, what an export records as "
                             "`max_position_embeddings` (0: `seq_len`); `hf_config` sets it, and `seq_len` "
                             "may be any length up to it.", minimum=0)


def swiglu_hidden(d_model: int, multiple_of: int, ffn_dim_multiplier: float = 0.0) -> int:
    """Meta's SwiGLU width: 2/3 of 4·d, times ``ffn_dim_multiplier`` (0: none), rounded up to
    ``multiple_of`` (llama2-7b: 11008; llama3-8b: 14336)."""
    hidden = int(2 * 4 * d_model / 3)
    if ffn_dim_multiplier:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)


@dataclass(frozen=True)
class LlamaShape:
    """Every number that fixes a Llama model (``ffn_dim`` already resolved)."""

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    seq_len: int
    vocab_size: int
    tied: bool = False
    rope_theta: float = 10000.0
    rope_factor: float = 1.0  # Llama 3 frequency scaling; 1: none
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_seq_len: int = 8192
    norm_eps: float = 1e-5
    context_len: int = 0  # the model's context when longer than the training's seq_len (0: seq_len)

    @property
    def context(self) -> int:
        """The model's context (``max_position_embeddings``): ``seq_len`` unless trained on shorter samples."""
        return max(self.context_len, self.seq_len)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def block_params(self) -> int:
        d, kv = self.d_model, self.kv_dim
        return 2 * d * d + 2 * d * kv + 3 * d * self.ffn_dim + 2 * d  # q, o; k, v; gate, up, down; 2 norms

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.d_model

    @property
    def head_params(self) -> int:
        """Final RMSNorm, plus the output head's own matrix unless it is tied to the embedding."""
        return self.d_model + (0 if self.tied else self.vocab_size * self.d_model)

    @property
    def n_params(self) -> int:
        return self.embedding_params + self.n_layers * self.block_params + self.head_params

    @property
    def matmul_params(self) -> int:
        """Weights that enter a matrix multiply: the blocks' linear layers and the head (tied or not)."""
        return self.n_layers * (self.block_params - 2 * self.d_model) + self.vocab_size * self.d_model

    def param_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Every parameter's shape, in the built model's order (FSDP2 shards each one on dim 0)."""
        d, kv, f, v = self.d_model, self.kv_dim, self.ffn_dim, self.vocab_size
        block = ((d,), (d, d), (kv, d), (kv, d), (d, d), (d,), (f, d), (d, f), (f, d))
        return ((v, d),) + block * self.n_layers + ((d,),) + (() if self.tied else ((v, d),))

    @property
    def largest_module_params(self) -> int:
        """The most parameters one module owns itself (the embedding or head, else an MLP matrix)."""
        return max(self.vocab_size * self.d_model, self.ffn_dim * self.d_model, self.d_model * self.d_model)

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6N over the non-embedding parameters (the head's matmul runs tied
        or not) plus 12·L·d·S for attention scores (the GPT's convention)."""
        non_embedding = self.n_layers * self.block_params + self.d_model + self.vocab_size * self.d_model
        return 6.0 * non_embedding + 12.0 * self.n_layers * self.d_model * self.seq_len


LLAMA3 = dict(rope_theta=500000.0)
LLAMA31 = dict(rope_theta=500000.0, rope_factor=8.0)
LLAMA32 = dict(tied=True, rope_theta=500000.0, rope_factor=32.0)
# name: (layers, dim, heads, kv heads, multiple_of, ffn_dim_multiplier, seq_len, vocab, the rest): the
# published shapes (params.json of each release); seq_len is the training context
PRESET_ARGS: dict[str, tuple[int, int, int, int, int, float, int, int, dict[str, tp.Any]]] = {
    "tiny": (2, 64, 4, 2, 32, 0.0, 64, 256, {}),
    "small": (4, 256, 8, 4, 64, 0.0, 256, 8192, {}),
    "llama2-7b": (32, 4096, 32, 32, 256, 0.0, 4096, 32000, {}),
    "llama2-13b": (40, 5120, 40, 40, 256, 0.0, 4096, 32000, {}),
    "llama2-70b": (80, 8192, 64, 8, 4096, 1.3, 4096, 32000, {}),
    "llama3-8b": (32, 4096, 32, 8, 1024, 1.3, 8192, 128256, LLAMA3),
    "llama3-70b": (80, 8192, 64, 8, 4096, 1.3, 8192, 128256, LLAMA3),
    "llama3.1-8b": (32, 4096, 32, 8, 1024, 1.3, 8192, 128256, LLAMA31),
    "llama3.1-70b": (80, 8192, 64, 8, 4096, 1.3, 8192, 128256, LLAMA31),
    "llama3.1-405b": (126, 16384, 128, 8, 4096, 1.2, 8192, 128256, LLAMA31),
    "llama3.2-1b": (16, 2048, 32, 8, 256, 1.5, 8192, 128256, LLAMA32),
    "llama3.2-3b": (28, 3072, 24, 8, 256, 1.0, 8192, 128256, LLAMA32),
}
LLAMA_PRESETS: dict[str, LlamaShape] = {
    name: LlamaShape(n, d, h, kv, swiglu_hidden(d, multiple, mult), seq, vocab, **rest)
    for name, (n, d, h, kv, multiple, mult, seq, vocab, rest) in PRESET_ARGS.items()}
PRESET_MULTIPLES = {name: (args[4], args[5]) for name, args in PRESET_ARGS.items()}


def llama_shape(model: Model) -> LlamaShape:
    """The preset's shape with every non-zero shape field of ``model`` (a ``[model]`` section) in its
    place; ``ffn_dim`` is the spec's, else recomputed when the width or the multiples change."""
    base = LLAMA_PRESETS[model.size]
    multiple, multiplier = PRESET_MULTIPLES[model.size]
    d = model.dim or base.d_model
    ffn = model.ffn_dim or base.ffn_dim
    if not model.ffn_dim and (model.dim or model.multiple_of or model.ffn_dim_multiplier):
        ffn = swiglu_hidden(d, model.multiple_of or multiple, model.ffn_dim_multiplier or multiplier)
    heads = model.n_heads or base.n_heads
    kv = model.n_kv_heads or (base.n_kv_heads if not model.n_heads else min(base.n_kv_heads, heads))
    seq_len = model.seq_len or model.context_len or base.seq_len
    return replace(base, n_layers=model.n_layers or base.n_layers, d_model=d, n_heads=heads, n_kv_heads=kv,
                   ffn_dim=ffn, seq_len=seq_len, context_len=model.context_len if model.context_len > seq_len else 0,
                   vocab_size=model.vocab_size or base.vocab_size,
                   tied=base.tied or model.tie_embeddings, rope_theta=model.rope_theta or base.rope_theta,
                   rope_factor=model.rope_factor or base.rope_factor,
                   rope_low_freq_factor=model.rope_low_freq_factor or base.rope_low_freq_factor,
                   rope_high_freq_factor=model.rope_high_freq_factor or base.rope_high_freq_factor,
                   rope_original_seq_len=model.rope_original_seq_len or base.rope_original_seq_len,
                   norm_eps=model.norm_eps or base.norm_eps)


def llama_label(model: Model, shape: LlamaShape) -> str:
    """``llama llama3-8b``, or the architecture when the spec (or its HF config) changes the shape."""
    changed = any(getattr(model, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"))
    text = (f"llama {model.size}" if not changed else
            f"llama {shape.n_layers} layers × dim {shape.d_model}, {shape.n_heads} heads / {shape.n_kv_heads} kv")
    return f"{text}{', tied' if shape.tied and changed else ''} ({count_text(shape.n_params)} params)"


def facts(model: Model, counted: Counted | None = None) -> ModelFacts:
    """What the planner and the trainer know about a Llama spec (``counted`` does not apply)."""
    s = llama_shape(model)
    return ModelFacts(label=llama_label(model, s), n_params=s.n_params, unit_params=s.block_params,
                      root_params=s.embedding_params + s.head_params, n_units=s.n_layers,
                      flops_per_token=s.flops_per_token(), seq_len=s.seq_len, vocab_size=s.vocab_size,
                      matmul_params=s.matmul_params, source="counted from the shape", param_shapes=s.param_shapes(),
                      largest_module_params=s.largest_module_params, shape=s, family=ARCH)


def problems(model: Model) -> list[str]:
    """What is wrong with a Llama ``[model]`` section (a known preset, shapes that divide)."""
    if model.size not in LLAMA_PRESETS:
        return [f"`model.size` = {model.size!r}: expected one of {', '.join(LLAMA_PRESETS)} for arch = 'llama'"]
    errors = [f"`model.{key}` = {getattr(model, key)!r} is not used by arch = 'llama' (no learned "
              f"{'parameter count' if key == 'n_params' else 'dropout'})" for key in ("n_params", "dropout")
              if getattr(model, key)]
    s = llama_shape(model)
    if s.d_model % s.n_heads:
        errors.append(f"`model.dim` = {s.d_model} is not divisible by `model.n_heads` = {s.n_heads}")
    elif s.head_dim % 2:
        errors.append(f"head size dim / n_heads = {s.head_dim} is odd: rotary embeddings rotate pairs")
    if s.n_heads % s.n_kv_heads:
        errors.append(f"`model.n_heads` = {s.n_heads} is not divisible by `model.n_kv_heads` = {s.n_kv_heads}")
    if model.context_len and s.seq_len > model.context_len:
        errors.append(f"`model.seq_len` = {s.seq_len} is longer than the model's context `model.context_len` = "
                      f"{model.context_len}: train at most {model.context_len} tokens a sample")
    if s.rope_factor > 1 and s.rope_high_freq_factor <= s.rope_low_freq_factor:
        errors.append(f"`model.rope_high_freq_factor` = {s.rope_high_freq_factor:g} must be above "
                      f"`model.rope_low_freq_factor` = {s.rope_low_freq_factor:g}")
    return errors


def code_notice(model: Model) -> str | None:
    """Built in: nothing of the user's is imported."""
    return None


def activation_bytes(facts: ModelFacts, micro_batch: int, checkpointing: bool, mixed_precision: str,
                     dropout: float = 0.0, autocast: bool = False) -> float:
    """``llama_activations(...).peak`` of the facts' shape (a Llama has no dropout)."""
    return llama_activations(facts.shape, micro_batch, checkpointing, mixed_precision, autocast).peak


def preset_counts() -> str:
    """``tiny (…), llama2-7b (6.74B) …``: the Llama presets with their parameter counts."""
    return ", ".join(f"{name} ({count_text(s.n_params)})" for name, s in LLAMA_PRESETS.items())


# ---------------------------------------------------------------- activations


def llama_activations(shape: LlamaShape, micro_batch: int, checkpointing: bool, mixed_precision: str,
                      autocast: bool = False) -> Activations:
    """Activation bytes of one micro-batch (``hpc.core.models.decoder.Activations``), as autograd saves
    them in ``trainer.models.llama`` (checked by tests/test_llama.py).

    Per block and token: each RMSNorm keeps an fp32 copy of its input, its normalised output (in the
    residual stream's dtype ``r``) and an fp32 reciprocal RMS; the linear layers keep their input in
    the compute dtype ``c`` (q, k and v share one; under autocast each casts its own copy, as do
    gate and up); SDPA keeps the rotated q and k, v, its output (``wo``'s input: CPU and CUDA
    kernels return it in [batch, seq, heads, head] memory order, so the reshape is a view) and an
    fp32 log-sum-exp per head; the SwiGLU keeps gate, up, silu(gate) and their
    product (4·ffn_dim). The cos/sin tables (per position) are shared by every block. The peak
    follows the GPT's reasoning (``hpc.core.models.gpt.gpt_activations``).
    """
    c, r = compute_bytes(mixed_precision), residual_bytes(mixed_precision, autocast)
    tokens, d, kv, f = micro_batch * shape.seq_len, shape.d_model, shape.kv_dim, shape.ffn_dim
    norm = d * (4 + r) + 4
    inputs = (3 + 2) * d * c if autocast and c < 4 else 2 * d * c  # autocast casts per layer
    block = tokens * (2 * norm + inputs + c * (2 * d + 2 * kv) + 4 * shape.n_heads + 4 * f * c)
    rope = 2 * shape.seq_len * shape.head_dim * r if shape.n_layers else 0
    head = tokens * (norm + d * c)  # final norm, the head's input
    logits = tokens * shape.vocab_size * c
    log_probs = tokens * shape.vocab_size * 4  # cross_entropy's fp32 log-softmax, saved for backward
    loss = tokens * shape.vocab_size * LOGIT_BYTES
    grads = tokens * (d * r + 3 * f * c)  # the MLP's backward: residual gradient + three ffn-wide gradients
    small = tokens * 16 + rope  # token ids and targets; cos/sin
    return decoder_activations(shape.n_layers, block, tokens * d * r, head, logits, log_probs, loss, grads, small,
                               checkpointing)


# ---------------------------------------------------------------- Hugging Face names

HF_BLOCK = (("attn_norm.weight", "input_layernorm.weight"), ("attn.wq.weight", "self_attn.q_proj.weight"),
            ("attn.wk.weight", "self_attn.k_proj.weight"), ("attn.wv.weight", "self_attn.v_proj.weight"),
            ("attn.wo.weight", "self_attn.o_proj.weight"), ("mlp_norm.weight", "post_attention_layernorm.weight"),
            ("mlp.w1.weight", "mlp.gate_proj.weight"), ("mlp.w2.weight", "mlp.down_proj.weight"),
            ("mlp.w3.weight", "mlp.up_proj.weight"))


def hf_tensor_plan(shape: LlamaShape) -> list[tp.Any]:
    """Every ``LlamaForCausalLM`` tensor and the hpcx parameter it is (copied as is)."""
    from hpc.core.hf import HfTensor

    return [HfTensor(hf, ours, "copy", dims) for ours, (hf, dims) in hf_names(shape).items()]


def hf_config(s: LlamaShape) -> dict[str, tp.Any]:
    """``config.json`` of a ``LlamaForCausalLM`` with this shape (fp32 weights)."""
    scaling = None if s.rope_factor <= 1 else {
        "rope_type": "llama3", "factor": s.rope_factor, "low_freq_factor": s.rope_low_freq_factor,
        "high_freq_factor": s.rope_high_freq_factor, "original_max_position_embeddings": s.rope_original_seq_len}
    return {"architectures": [HF_ARCH], "model_type": HF_MODEL_TYPE, "hidden_size": s.d_model,
            "intermediate_size": s.ffn_dim, "num_hidden_layers": s.n_layers, "num_attention_heads": s.n_heads,
            "num_key_value_heads": s.n_kv_heads, "head_dim": s.head_dim, "vocab_size": s.vocab_size,
            "max_position_embeddings": s.context, "rms_norm_eps": s.norm_eps, "rope_theta": s.rope_theta,
            "rope_scaling": scaling, "tie_word_embeddings": s.tied, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "torch_dtype": "float32"}


HF_ARCH = "LlamaForCausalLM"
HF_MODEL_TYPE = "llama"
# config.json key → [model] field
HF_KEYS = (("hidden_size", "dim"), ("num_hidden_layers", "n_layers"), ("num_attention_heads", "n_heads"),
           ("num_key_value_heads", "n_kv_heads"), ("intermediate_size", "ffn_dim"),
           ("vocab_size", "vocab_size"), ("max_position_embeddings", "context_len"), ("rms_norm_eps", "norm_eps"),
           ("rope_theta", "rope_theta"), ("tie_word_embeddings", "tie_embeddings"),
           ("factor", "rope_factor"), ("low_freq_factor", "rope_low_freq_factor"),
           ("high_freq_factor", "rope_high_freq_factor"), ("original_max_position_embeddings", "rope_original_seq_len"))
ROPE_KEYS = HF_KEYS[-4:]  # inside rope_scaling (transformers 4) or rope_parameters (5)
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def hf_spec_fields(path: tp.Any, doc: dict[str, tp.Any]) -> dict[str, tp.Any]:
    """The ``[model]`` shape fields of a ``LlamaForCausalLM`` config.json (``path``, for messages);
    ConfigError with one line per value hpcx's Llama does not implement. Rotary settings come from
    ``rope_theta`` / ``rope_scaling`` or transformers 5's ``rope_parameters``."""
    from hpc.core.errors import ConfigError

    problems = _unsupported(path, doc)
    if problems:
        raise ConfigError(problems)
    fields = {ours: doc[key] for key, ours in HF_KEYS[:-4] if doc.get(key) is not None}
    rope = _rope(doc)
    fields.update({ours: rope[key] for key, ours in ROPE_KEYS if key in rope})
    fields["rope_theta"] = float(rope.get("rope_theta", fields.get("rope_theta", 10000.0)))
    fields.setdefault("n_kv_heads", fields["n_heads"])
    fields.setdefault("rope_factor", 1.0)
    fields.setdefault("tie_embeddings", False)
    return fields


def _rope(doc: dict[str, tp.Any]) -> dict[str, tp.Any]:
    rope, scaling = doc.get("rope_parameters"), doc.get("rope_scaling")
    return {**(rope if isinstance(rope, dict) else {}), **(scaling if isinstance(scaling, dict) else {})}


POSITIVE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size", "vocab_size", "max_position_embeddings")
INT_MAX = 2**31 - 1


def _impossible(where: str, doc: dict[str, tp.Any]) -> list[str]:
    """config.json's own keys that no model has (0 layers, heads that do not divide): named as its keys,
    never as the spec's ``model.*`` (where 0 means "the preset's")."""
    out = []
    for key in POSITIVE_KEYS:
        value = doc.get(key)
        if key in doc and (not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= INT_MAX):
            out.append(f"{where}: {key} = {value!r}: expected a whole number from 1 to {INT_MAX}")
    if out:
        return out
    heads, kv, width = doc.get("num_attention_heads"), doc.get("num_key_value_heads"), doc.get("hidden_size")
    if heads and kv and heads % kv:
        out.append(f"{where}: num_key_value_heads = {kv}: expected a divisor of num_attention_heads = {heads}")
    if heads and width and "head_dim" not in doc and width % heads:
        out.append(f"{where}: hidden_size = {width}: expected a multiple of num_attention_heads = {heads}")
    eps = doc.get("rms_norm_eps")
    if "rms_norm_eps" in doc and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1):
        out.append(f"{where}: rms_norm_eps = {eps!r}: expected a number between 0 and 1")
    return out


def _unsupported(path: tp.Any, doc: dict[str, tp.Any]) -> list[str]:
    """One line per config.json value that hpcx's Llama does not implement."""
    where = f"`model.hf_config`: {path}"
    out = [f"{where}: {key} is missing" for key in REQUIRED if key not in doc]
    out += _impossible(where, doc)
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if doc.get(key, want) != want:
            out.append(f"{where}: {key} = {doc[key]!r}; hpcx's Llama has {want!r}")
    heads, width = doc.get("num_attention_heads"), doc.get("hidden_size")
    if isinstance(heads, int) and isinstance(width, int) and heads and doc.get("head_dim", width // heads) != width // heads:
        out.append(f"{where}: head_dim = {doc['head_dim']!r}; hpcx's Llama has hidden_size / num_attention_heads "
                   f"= {width // heads}")
    for key in ("rope_scaling", "rope_parameters"):
        rope = doc.get(key)
        kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else None
        if rope is not None and kind not in ("default", "llama3"):
            out.append(f"{where}: {key} = {rope!r}; hpcx implements rope_type 'default' and 'llama3'")
    return out


def hf_names(shape: LlamaShape) -> dict[str, tuple[str, tuple[int, ...]]]:
    """hpcx parameter name → (``LlamaForCausalLM``'s name, shape), in the built model's order. The
    layouts are the same (no q/k permutation: see the module docstring); a tied model has no
    ``lm_head.weight``."""
    shapes = iter(shape.param_shapes())
    names = {"tok_emb.weight": "model.embed_tokens.weight"}
    for i in range(shape.n_layers):
        names.update({f"blocks.{i}.{ours}": f"model.layers.{i}.{theirs}" for ours, theirs in HF_BLOCK})
    names["norm.weight"] = "model.norm.weight"
    if not shape.tied:
        names["head.weight"] = "lm_head.weight"
    return {ours: (theirs, next(shapes)) for ours, theirs in names.items()}


class Llama:
    """The built-in Llama as a ``hpc.core.models.Family`` (and ``HfReader``: ``LlamaForCausalLM``)."""

    name = ARCH
    phrase = "arch = 'llama'"
    fields = Fields
    builder = "trainer.models.llama"
    counted_by_building = False  # the count follows from the shape
    facts = staticmethod(facts)
    problems = staticmethod(problems)
    activation_bytes = staticmethod(activation_bytes)
    code_notice = staticmethod(code_notice)
    preset_counts = staticmethod(preset_counts)
    hf_config = staticmethod(hf_config)
    hf_tensor_plan = staticmethod(hf_tensor_plan)
    hf_spec_fields = staticmethod(hf_spec_fields)
    hf_arch = HF_ARCH
    hf_model_type = HF_MODEL_TYPE
    hf_keys = HF_KEYS
    lora_targets = (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"), ("w1", "gate_proj"),
                    ("w2", "down_proj"), ("w3", "up_proj"))


FAMILY = Llama()

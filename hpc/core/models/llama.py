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
from hpc.core.errors import ConfigError
from hpc.core.models import Counted, ModelFacts, count_text
from hpc.core.models.tp_plan import tp_facts
from hpc.core.models.decoder import (BLOCK_LORA_TARGETS, BLOCK_TP_PLAN, REQUIRED, BlockFields, block_problems, LlamaShape, block_activations, hf_names,  # noqa: F401
                                     hf_tensor_plan, impossible, rope_doc)

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.core.spec import Model

ARCH = "llama"


@dataclass
class Fields(BlockFields):
    """The ``[model]`` fields the Llama reads (0 keeps the preset's value): those of every Llama-block
    family (``hpc.core.models.decoder.BlockFields``), then its own; joined into the spec's section by
    ``hpc.core.models.section_class``."""

    multiple_of: int = field(0, doc="Llama: the MLP width is rounded up to a multiple of this (0: the preset's).",
                             minimum=0)
    ffn_dim_multiplier: float = field(0.0, doc="Llama: factor on 8/3·dim before rounding (0: the preset's).",
                                      minimum=0)
    rope_factor: float = field(0.0, doc="Llama 3.1+: rotary frequency scaling factor (0: the preset's; 1: no "
                               "scaling).", minimum=0)
    rope_low_freq_factor: float = field(0.0, doc="Llama 3.1+: low-frequency factor of the scaling (0: 1).",
                                        minimum=0)
    rope_high_freq_factor: float = field(0.0, doc="Llama 3.1+: high-frequency factor of the scaling (0: 4).",
                                         minimum=0)
    rope_original_seq_len: int = field(0, doc="Llama 3.1+: the context the scaling starts from (0: 8192).",
                                       minimum=0)


def swiglu_hidden(d_model: int, multiple_of: int, ffn_dim_multiplier: float = 0.0) -> int:
    """Meta's SwiGLU width: 2/3 of 4·d, times ``ffn_dim_multiplier`` (0: none), rounded up to
    ``multiple_of`` (llama2-7b: 11008; llama3-8b: 14336)."""
    hidden = int(2 * 4 * d_model / 3)
    if ffn_dim_multiplier:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)


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
                      root_params=s.embedding_params + s.head_params,
                      kept_params=s.embedding_params + s.head_params if s.tied else s.head_params, n_units=s.n_layers,
                      flops_per_token=s.flops_per_token(), seq_len=s.seq_len, vocab_size=s.vocab_size,
                      matmul_params=s.matmul_params, source="counted from the shape", param_shapes=s.param_shapes(),
                      largest_module_params=s.largest_module_params, shape=s, family=ARCH,
                      **tp_facts(BLOCK_TP_PLAN, s, hf_names(s)))


def problems(model: Model) -> list[str]:
    """What is wrong with a Llama ``[model]`` section (a known preset, shapes that divide: the block's
    checks, ``block_problems``), and Llama 3's rope scaling factors in order."""
    errors = block_problems("arch = 'llama'", model, LLAMA_PRESETS, llama_shape, "head size dim / n_heads =")
    if model.size not in LLAMA_PRESETS:
        return errors
    s = llama_shape(model)
    if s.rope_factor > 1 and s.rope_high_freq_factor <= s.rope_low_freq_factor:
        errors.append(f"`model.rope_high_freq_factor` = {s.rope_high_freq_factor:g} must be above "
                      f"`model.rope_low_freq_factor` = {s.rope_low_freq_factor:g}")
    return errors


def code_notice(model: Model) -> str | None:
    """Built in: nothing of the user's is imported."""
    return None


def activation_bytes(facts: ModelFacts, micro_batch: int, checkpointing: bool, mixed_precision: str,
                     dropout: float = 0.0, autocast: bool = False, tp: int = 1) -> float:
    """``llama_activations(...).peak`` of the facts' shape (a Llama has no dropout)."""
    return llama_activations(facts.shape, micro_batch, checkpointing, mixed_precision, autocast, tp).peak


def preset_counts() -> str:
    """``tiny (…), llama2-7b (6.74B) …``: the Llama presets with their parameter counts."""
    return ", ".join(f"{name} ({count_text(s.n_params)})" for name, s in LLAMA_PRESETS.items())


llama_activations = block_activations  # the Llama block's (``hpc.core.models.decoder``)


# ---------------------------------------------------------------- Hugging Face


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


def hf_spec_fields(path: tp.Any, doc: dict[str, tp.Any]) -> dict[str, tp.Any]:
    """The ``[model]`` shape fields of a ``LlamaForCausalLM`` config.json (``path``, for messages);
    ConfigError with one line per value hpcx's Llama does not implement. Rotary settings come from
    ``rope_theta`` / ``rope_scaling`` or transformers 5's ``rope_parameters``."""
    problems = _unsupported(path, doc)
    if problems:
        raise ConfigError(problems)
    fields = {ours: doc[key] for key, ours in HF_KEYS[:-4] if doc.get(key) is not None}
    rope = rope_doc(doc)
    fields.update({ours: rope[key] for key, ours in ROPE_KEYS if key in rope})
    fields["rope_theta"] = float(rope.get("rope_theta", fields.get("rope_theta", 10000.0)))
    fields.setdefault("n_kv_heads", fields["n_heads"])
    fields.setdefault("rope_factor", 1.0)
    fields.setdefault("tie_embeddings", False)
    return fields


def _unsupported(path: tp.Any, doc: dict[str, tp.Any]) -> list[str]:
    """One line per config.json value that hpcx's Llama does not implement."""
    where = f"`model.hf_config`: {path}"
    out = [f"{where}: {key} is missing" for key in REQUIRED if key not in doc]
    out += impossible(where, doc)
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
    lora_targets = BLOCK_LORA_TARGETS
    tp_plan = BLOCK_TP_PLAN


FAMILY = Llama()

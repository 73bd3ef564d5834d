"""Hugging Face's side of a model, without torch: ``config.json`` both ways, and the tensor mapping.

- ``hf_config(arch, shape)``: the ``config.json`` of an hpcx model (``LlamaForCausalLM`` for the
  Llama family, ``GPT2LMHeadModel`` for the built-in GPT);
- ``spec_fields(path)``: the ``[model]`` fields a ``config.json`` sets (``model.hf_config``), refused
  with one line naming the file when hpcx does not implement what it describes;
- ``tensor_plan(arch, shape)``: for every Hugging Face tensor, the hpcx parameter it comes from and
  how (copied, transposed: GPT-2's ``Conv1D`` stores ``[in, out]``, or zeros: GPT-2's biases, which
  hpcx's GPT does not have). Export and ``checkpoint.init_from`` both read it, so the two agree.

The Llama mapping is name for name: hpcx's rotary embedding already uses Hugging Face's
half-rotation layout (``hpc.llama``), so q and k need no permutation.
"""

from __future__ import annotations

import json
import os
import typing as tp
from dataclasses import dataclass
from pathlib import Path

from hpc.errors import ConfigError
from hpc.llama import LlamaShape, hf_names

CONFIG_FILE = "config.json"
LLAMA_ARCH = "LlamaForCausalLM"
GPT2_ARCH = "GPT2LMHeadModel"
MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True)
class HfTensor:
    """One tensor of the Hugging Face checkpoint and where it comes from in hpcx's model."""

    name: str  # Hugging Face's name
    source: str  # hpcx's parameter name ("" for zeros)
    op: str  # "copy", "transpose" (2-D) or "zeros"
    shape: tuple[int, ...]  # Hugging Face's shape


def hf_config(arch: str, shape: tp.Any) -> dict[str, tp.Any]:
    """``config.json`` of an hpcx model (``arch`` "llama" or "gpt"), fp32 weights."""
    if arch == "llama":
        return _llama_config(shape)
    if arch == "gpt":
        return _gpt2_config(shape)
    raise ConfigError([f"model.arch = {arch!r}: only the built-in 'llama' and 'gpt' export to Hugging Face"])


def _llama_config(s: LlamaShape) -> dict[str, tp.Any]:
    scaling = None if s.rope_factor <= 1 else {
        "rope_type": "llama3", "factor": s.rope_factor, "low_freq_factor": s.rope_low_freq_factor,
        "high_freq_factor": s.rope_high_freq_factor, "original_max_position_embeddings": s.rope_original_seq_len}
    return {"architectures": [LLAMA_ARCH], "model_type": "llama", "hidden_size": s.d_model,
            "intermediate_size": s.ffn_dim, "num_hidden_layers": s.n_layers, "num_attention_heads": s.n_heads,
            "num_key_value_heads": s.n_kv_heads, "head_dim": s.head_dim, "vocab_size": s.vocab_size,
            "max_position_embeddings": s.seq_len, "rms_norm_eps": s.norm_eps, "rope_theta": s.rope_theta,
            "rope_scaling": scaling, "tie_word_embeddings": s.tied, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "torch_dtype": "float32"}


def _gpt2_config(s: tp.Any) -> dict[str, tp.Any]:
    return {"architectures": [GPT2_ARCH], "model_type": "gpt2", "vocab_size": s.vocab_size,
            "n_positions": s.seq_len, "n_embd": s.d_model, "n_layer": s.n_layers, "n_head": s.n_heads,
            "n_inner": 4 * s.d_model, "activation_function": "gelu",  # exact erf GELU, as hpcx's F.gelu
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "layer_norm_epsilon": 1e-5,
            "scale_attn_weights": True, "tie_word_embeddings": s.tied, "torch_dtype": "float32"}


def tensor_plan(arch: str, shape: tp.Any) -> list[HfTensor]:
    """Every Hugging Face tensor of the model, in hpcx's parameter order."""
    if arch == "llama":
        return [HfTensor(hf, ours, "copy", dims) for ours, (hf, dims) in hf_names(shape).items()]
    return _gpt2_plan(shape)


def _gpt2_plan(s: tp.Any) -> list[HfTensor]:
    d, v = s.d_model, s.vocab_size
    plan = [HfTensor("transformer.wte.weight", "tok_emb.weight", "copy", (v, d)),
            HfTensor("transformer.wpe.weight", "pos_emb.weight", "copy", (s.seq_len, d))]
    for i in range(s.n_layers):
        for ours, hf, d_in, d_out in (("ln1", "ln_1", d, 0), ("attn.qkv", "attn.c_attn", d, 3 * d),
                                      ("attn.proj", "attn.c_proj", d, d), ("ln2", "ln_2", d, 0),
                                      ("mlp.fc", "mlp.c_fc", d, 4 * d), ("mlp.proj", "mlp.c_proj", 4 * d, d)):
            plan += _gpt2_layer(f"blocks.{i}.{ours}", f"transformer.h.{i}.{hf}", d_in, d_out)
    plan += _gpt2_layer("ln_f", "transformer.ln_f", d, 0)
    if not s.tied:
        plan.append(HfTensor("lm_head.weight", "head.weight", "copy", (v, d)))
    return plan


def _gpt2_layer(ours: str, hf: str, d_in: int, d_out: int) -> list[HfTensor]:
    """A LayerNorm (``d_out`` 0: weight and bias copied) or a Conv1D (weight transposed, zero bias)."""
    if not d_out:
        return [HfTensor(f"{hf}.{p}", f"{ours}.{p}", "copy", (d_in,)) for p in ("weight", "bias")]
    return [HfTensor(f"{hf}.weight", f"{ours}.weight", "transpose", (d_in, d_out)),
            HfTensor(f"{hf}.bias", "", "zeros", (d_out,))]


# ---------------------------------------------------------------- config.json → spec fields

# config.json key → [model] field (Llama)
LLAMA_KEYS = (("hidden_size", "dim"), ("num_hidden_layers", "n_layers"), ("num_attention_heads", "n_heads"),
              ("num_key_value_heads", "n_kv_heads"), ("intermediate_size", "ffn_dim"),
              ("vocab_size", "vocab_size"), ("max_position_embeddings", "seq_len"), ("rms_norm_eps", "norm_eps"),
              ("rope_theta", "rope_theta"), ("tie_word_embeddings", "tie_embeddings"))
ROPE_KEYS = (("factor", "rope_factor"), ("low_freq_factor", "rope_low_freq_factor"),
             ("high_freq_factor", "rope_high_freq_factor"), ("original_max_position_embeddings", "rope_original_seq_len"))
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def config_path(path: str) -> Path:
    """The ``config.json`` that ``model.hf_config`` names (a folder holding one, or the file), absolute."""
    p = Path(os.path.expandvars(os.path.expanduser(path))).absolute()
    return p / CONFIG_FILE if p.is_dir() else p


def read_config(path: Path) -> dict[str, tp.Any]:
    """A ``config.json``, bounded; ConfigError naming the file when it is not a JSON object."""
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError([f"{path}: {path.stat().st_size} bytes; a config.json is under 1 MiB"])
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError([f"`model.hf_config`: {path}: cannot read ({exc.strerror})"]) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ConfigError([f"`model.hf_config`: {path}: not JSON ({exc})"]) from None
    if not isinstance(doc, dict):
        raise ConfigError([f"`model.hf_config`: {path}: expected a JSON object"])
    return doc


def spec_fields(path: Path, doc: dict[str, tp.Any]) -> dict[str, tp.Any]:
    """The ``[model]`` fields ``doc`` (``path``'s config.json) sets; ConfigError for what hpcx lacks.
    The architecture is ``architectures`` (or, where a bare config has none, ``model_type``); rotary
    settings come from ``rope_theta`` / ``rope_scaling`` or transformers 5's ``rope_parameters``."""
    archs = doc.get("architectures") or ([LLAMA_ARCH] if doc.get("model_type") == "llama" else [])
    if archs != [LLAMA_ARCH]:
        raise ConfigError([f"`model.hf_config`: {path}: architectures = {archs!r}; hpcx implements "
                           f"[{LLAMA_ARCH!r}] only"])
    problems = _unsupported(path, doc)
    if problems:
        raise ConfigError(problems)
    fields: dict[str, tp.Any] = {"arch": "llama"}
    fields.update({ours: doc[key] for key, ours in LLAMA_KEYS if doc.get(key) is not None})
    rope = _rope(doc)
    fields.update({ours: rope[key] for key, ours in ROPE_KEYS if key in rope})
    fields["rope_theta"] = float(rope.get("rope_theta", fields.get("rope_theta", 10000.0)))
    fields.setdefault("n_kv_heads", fields["n_heads"])
    fields.setdefault("rope_factor", 1.0)
    fields.setdefault("tie_embeddings", False)
    return fields


def _rope(doc: dict[str, tp.Any]) -> dict[str, tp.Any]:
    """The rotary settings of a config: ``rope_scaling`` (transformers 4) or ``rope_parameters`` (5)."""
    rope = doc.get("rope_parameters") if isinstance(doc.get("rope_parameters"), dict) else {}
    scaling = doc.get("rope_scaling") if isinstance(doc.get("rope_scaling"), dict) else {}
    return {**rope, **scaling}


def _unsupported(path: Path, doc: dict[str, tp.Any]) -> list[str]:
    """One line per config.json value that hpcx's Llama does not implement."""
    where = f"`model.hf_config`: {path}"
    out = [f"{where}: {key} is missing" for key in REQUIRED if not isinstance(doc.get(key), int)]
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


def apply_hf_config(model_doc: dict[str, tp.Any]) -> list[str]:
    """Fill a spec's ``[model]`` table from its ``hf_config`` in place (the path made absolute); one
    line per value of the spec that contradicts the file. Nothing to do without ``hf_config``."""
    raw = model_doc.get("hf_config")
    if not isinstance(raw, str) or not raw:
        return []
    path = config_path(raw)
    fields = spec_fields(path, read_config(path))
    errors = [f"`model.{key}` = {model_doc[key]!r} contradicts {path}: {_hf_key(key)} = {value!r}"
              for key, value in fields.items() if key in model_doc and not _same(model_doc[key], value)]
    model_doc.update(fields)
    model_doc["hf_config"] = str(path.parent if path.name == CONFIG_FILE else path)
    return errors


def _same(a: tp.Any, b: tp.Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b


def _hf_key(field_name: str) -> str:
    names = dict((ours, theirs) for theirs, ours in LLAMA_KEYS + ROPE_KEYS)
    return {"arch": "architectures"}.get(field_name, names.get(field_name, field_name))

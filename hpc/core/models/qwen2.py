"""The Qwen2 family without torch (``model.arch = "qwen2"``): Qwen2 and Qwen2.5, ``Qwen2ForCausalLM``.

The Llama block (``hpc.core.models.decoder``) with biases on the q, k and v projections (none on o),
its own rotary base and RMSNorm epsilon (1e6 and 1e-6 in Qwen2.5), a tied head in the small models. A
preset ``model.size`` (``QWEN2_PRESETS``: published shapes, exact counts, and a tiny one for tests) with
the spec's shape fields in its place, or every shape from a ``config.json`` (``model.hf_config``).

Honoured from a config.json: ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
``num_key_value_heads``, ``intermediate_size``, ``vocab_size``, ``max_position_embeddings``,
``rms_norm_eps``, ``rope_theta`` (or ``rope_parameters.rope_theta``), ``tie_word_embeddings``,
``head_dim``. Refused with one line naming the key: ``use_sliding_window = true`` or a
``layer_types`` entry other than ``full_attention`` (hpcx's Qwen2 attends to every earlier token),
``rope_scaling`` / ``rope_parameters`` of any type but ``default`` (YaRN is not implemented), another
``hidden_act``. ``sliding_window`` and ``max_window_layers`` are read only with ``use_sliding_window``.
"""

from __future__ import annotations

import typing as tp
from dataclasses import dataclass

from hpc.core.errors import ConfigError
from hpc.core.models.decoder import (BLOCK_HF_KEYS, BlockFamily, HeadFields, LlamaShape, block_spec_fields, block_unsupported, hf_block_config)

if tp.TYPE_CHECKING:  # pragma: no cover
    pass

ARCH = "qwen2"
PHRASE = "arch = 'qwen2'"


@dataclass
class Fields(HeadFields):
    """The ``[model]`` fields the Qwen2 reads: the Llama block's (``decoder.HeadFields``), none of its own."""


QWEN: dict[str, tp.Any] = dict(qkv_bias=True, rope_theta=1e6, norm_eps=1e-6)
# name: the published shapes (config.json of each release); seq_len is the pre-training context
QWEN2_PRESETS: dict[str, LlamaShape] = {
    "tiny": LlamaShape(2, 64, 4, 2, 192, 64, 256, **QWEN),
    "qwen2.5-0.5b": LlamaShape(24, 896, 14, 2, 4864, 32768, 151936, tied=True, **QWEN),
    "qwen2.5-1.5b": LlamaShape(28, 1536, 12, 2, 8960, 32768, 151936, tied=True, **QWEN),
    "qwen2.5-3b": LlamaShape(36, 2048, 16, 2, 11008, 32768, 151936, tied=True, **QWEN),
    "qwen2.5-7b": LlamaShape(28, 3584, 28, 4, 18944, 32768, 152064, **QWEN),
    "qwen2.5-14b": LlamaShape(48, 5120, 40, 8, 13824, 32768, 152064, **QWEN),
    "qwen2.5-32b": LlamaShape(64, 5120, 40, 8, 27648, 32768, 152064, **QWEN),
    "qwen2.5-72b": LlamaShape(80, 8192, 64, 8, 29568, 32768, 152064, **QWEN),
}












# ---------------------------------------------------------------- Hugging Face

HF_ARCH = "Qwen2ForCausalLM"
HF_MODEL_TYPE = "qwen2"
HF_KEYS = BLOCK_HF_KEYS  # config.json key → [model] field
DEFAULTS = {"rope_theta": 10000.0, "norm_eps": 1e-6, "tie_embeddings": False}  # Qwen2Config's, for absent keys


def hf_config(s: LlamaShape) -> dict[str, tp.Any]:
    """``config.json`` of a ``Qwen2ForCausalLM`` with this shape (fp32 weights; no sliding window)."""
    return {**hf_block_config(s, HF_ARCH, HF_MODEL_TYPE), "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": s.n_layers}


def hf_spec_fields(path: tp.Any, doc: dict[str, tp.Any]) -> dict[str, tp.Any]:
    """The ``[model]`` shape fields of a ``Qwen2ForCausalLM`` config.json (``path``, for messages);
    ConfigError with one line per value hpcx's Qwen2 does not implement."""
    problems = _unsupported(path, doc)
    if problems:
        raise ConfigError(problems)
    return block_spec_fields(doc, DEFAULTS)


def _unsupported(path: tp.Any, doc: dict[str, tp.Any]) -> list[str]:
    """One line per config.json value that hpcx's Qwen2 does not implement."""
    where = f"`model.hf_config`: {path}"
    out = block_unsupported(where, doc, "hpcx's Qwen2")
    if doc.get("use_sliding_window"):
        out.append(f"{where}: use_sliding_window = {doc['use_sliding_window']!r}; hpcx's Qwen2 attends to every "
                   f"earlier token (its per-layer sliding window is not implemented)")
    types = doc.get("layer_types")
    if types is not None and (not isinstance(types, list) or any(t != "full_attention" for t in types)):
        out.append(f"{where}: layer_types = {str(types)[:200]}; hpcx's Qwen2 has 'full_attention' in every layer")
    return out


class Qwen2(BlockFamily):
    """The built-in Qwen2 as a ``hpc.core.models.Family`` (and ``HfReader``: ``Qwen2ForCausalLM``)."""

    name = ARCH
    phrase = PHRASE
    presets = QWEN2_PRESETS
    fields = Fields
    builder = "trainer.models.qwen2"
    hf_config = staticmethod(hf_config)
    hf_spec_fields = staticmethod(hf_spec_fields)
    hf_arch = HF_ARCH
    hf_model_type = HF_MODEL_TYPE
    hf_keys = HF_KEYS


FAMILY = Qwen2()

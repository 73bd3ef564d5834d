"""The Mistral family without torch (``model.arch = "mistral"``): Mistral 7B and NeMo, ``MistralForCausalLM``.

The Llama block (``hpc.core.models.decoder``) with a sliding window where the model has one (Mistral 7B
v0.1: each token attends to the last 4096; v0.2 and later: every earlier token) and a head width of
its own where ``head_dim`` says so (NeMo: 128 with dim 5120 over 32 heads). A preset ``model.size``
(``MISTRAL_PRESETS``: published shapes, exact counts, and a tiny one for tests) with the spec's shape
fields in its place, or every shape from a ``config.json`` (``model.hf_config``).

Honoured from a config.json: ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
``num_key_value_heads``, ``intermediate_size``, ``vocab_size``, ``max_position_embeddings``,
``rms_norm_eps``, ``rope_theta`` (or ``rope_parameters.rope_theta``), ``tie_word_embeddings``,
``head_dim``, ``sliding_window`` (null: none; a file without it gets ``MistralConfig``'s 4096, as
transformers does). The window is a banded causal mask in attention (``trainer.models.decoder``), exact
and as transformers computes it; one no shorter than ``seq_len`` changes nothing. Refused with one line
naming the key: ``rope_scaling`` / ``rope_parameters`` of any type but ``default``, another
``hidden_act``, a ``sliding_window`` that is not a positive whole number.
"""

from __future__ import annotations

import typing as tp
from dataclasses import dataclass, replace

from hpc.core.config import field
from hpc.core.errors import ConfigError
from hpc.core.models.decoder import (BLOCK_HF_KEYS, INT_MAX, BlockFamily, HeadFields, LlamaShape, block_shape,
                                     block_spec_fields, block_unsupported, hf_block_config)

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.core.spec import Model

ARCH = "mistral"
PHRASE = "arch = 'mistral'"
NO_WINDOW = -1  # ``model.sliding_window``: the preset's is kept at 0; this turns a preset's window off


@dataclass
class Fields(HeadFields):
    """The ``[model]`` fields the Mistral reads: the Llama block's (``decoder.HeadFields``), then its own."""

    sliding_window: int = field(0, doc="Mistral: sliding-window attention, each token attending to the last this "
                                "many (0: the preset's; -1: none, every earlier token).", minimum=-1)


V01: dict[str, tp.Any] = dict(window=4096)
V03: dict[str, tp.Any] = dict(rope_theta=1e6)
# name: the published shapes (config.json of each release); seq_len is the training context
MISTRAL_PRESETS: dict[str, LlamaShape] = {
    "tiny": LlamaShape(2, 64, 4, 2, 192, 64, 256),
    "mistral-7b-v0.1": LlamaShape(32, 4096, 32, 8, 14336, 8192, 32000, **V01),
    "mistral-7b-v0.3": LlamaShape(32, 4096, 32, 8, 14336, 32768, 32768, **V03),
    "mistral-nemo-12b": LlamaShape(40, 5120, 32, 8, 14336, 131072, 131072, head_size=128, **V03),
}


def mistral_shape(model: Model) -> LlamaShape:
    """The preset's shape with every non-zero shape field of ``model`` in its place (``sliding_window``
    -1: none)."""
    s = block_shape(model, MISTRAL_PRESETS[model.size])
    return replace(s, window=s.window if not model.sliding_window else max(0, model.sliding_window))










# ---------------------------------------------------------------- Hugging Face

HF_ARCH = "MistralForCausalLM"
HF_MODEL_TYPE = "mistral"
HF_KEYS = (*BLOCK_HF_KEYS, ("sliding_window", "sliding_window"))  # config.json key → [model] field
DEFAULTS = {"rope_theta": 10000.0, "norm_eps": 1e-6, "tie_embeddings": False}  # MistralConfig's, for absent keys
DEFAULT_WINDOW = 4096  # MistralConfig's sliding_window when config.json has no such key


def hf_config(s: LlamaShape) -> dict[str, tp.Any]:
    """``config.json`` of a ``MistralForCausalLM`` with this shape (fp32 weights)."""
    return {**hf_block_config(s, HF_ARCH, HF_MODEL_TYPE), "sliding_window": s.window or None}


def hf_spec_fields(path: tp.Any, doc: dict[str, tp.Any]) -> dict[str, tp.Any]:
    """The ``[model]`` shape fields of a ``MistralForCausalLM`` config.json (``path``, for messages);
    ConfigError with one line per value hpcx's Mistral does not implement."""
    problems = _unsupported(path, doc)
    if problems:
        raise ConfigError(problems)
    fields = block_spec_fields(doc, DEFAULTS)
    window = doc.get("sliding_window", DEFAULT_WINDOW)
    fields["sliding_window"] = NO_WINDOW if window is None else window
    return fields


def _unsupported(path: tp.Any, doc: dict[str, tp.Any]) -> list[str]:
    """One line per config.json value that hpcx's Mistral does not implement."""
    where = f"`model.hf_config`: {path}"
    out = block_unsupported(where, doc, "hpcx's Mistral")
    window = doc.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or not 1 <= window <= INT_MAX):
        out.append(f"{where}: sliding_window = {window!r}: expected null or a whole number from 1 to {INT_MAX}")
    return out


class Mistral(BlockFamily):
    """The built-in Mistral as a ``hpc.core.models.Family`` (and ``HfReader``: ``MistralForCausalLM``)."""

    name = ARCH
    phrase = PHRASE
    presets = MISTRAL_PRESETS
    fields = Fields
    builder = "trainer.models.mistral"
    hf_config = staticmethod(hf_config)
    hf_spec_fields = staticmethod(hf_spec_fields)
    hf_arch = HF_ARCH
    hf_model_type = HF_MODEL_TYPE
    hf_keys = HF_KEYS

    def shape(self, model: Model) -> LlamaShape:
        """The preset with the spec's fields, and its sliding window (``mistral_shape``)."""
        return mistral_shape(model)


FAMILY = Mistral()

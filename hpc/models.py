"""What hpcx knows about a spec's model, without torch: ``model_facts(spec.model)``.

One description per model family answers every question the login side and the trainer ask
(parameter count, the largest FSDP unit, FLOPs per token, context length, vocabulary, activation
memory source, a label for people), so no other module branches on ``model.arch``:

- the built-in GPT (``arch = "gpt"``): presets of ``GPTShape``; the trainer builds its model from
  the same shape, so the planner's counts hold by construction. A pre-LN GPT: token + learned
  position embeddings, ``n_layers`` blocks of (LayerNorm, causal self-attention, LayerNorm, 4× MLP),
  a final LayerNorm and an untied output head; linear layers have no bias;
- a user model (``arch = "pkg.mod:function"``): what the spec states (``seq_len`` and
  ``vocab_size`` are required; the parameter count is unknown to a login node).
"""

from __future__ import annotations

import re
import typing as tp
from dataclasses import dataclass

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.spec import Model


@dataclass(frozen=True)
class GPTShape:
    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    vocab_size: int

    @property
    def block_params(self) -> int:
        d = self.d_model
        return 12 * d * d + 4 * d  # qkv 3d², proj d², mlp 8d², two LayerNorms 4d

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.d_model + self.seq_len * self.d_model

    @property
    def head_params(self) -> int:
        return 2 * self.d_model + self.vocab_size * self.d_model  # final LayerNorm + output head

    @property
    def n_params(self) -> int:
        return self.embedding_params + self.n_layers * self.block_params + self.head_params

    def param_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Every parameter's shape, in the built model's order (FSDP2 shards each one on dim 0)."""
        d, v, s = self.d_model, self.vocab_size, self.seq_len
        block = ((d,), (d,), (3 * d, d), (d, d), (d,), (d,), (4 * d, d), (d, 4 * d))  # ln1, attn, ln2, mlp
        return ((v, d), (s, d)) + block * self.n_layers + ((d,), (d,), (v, d))

    @property
    def largest_module_params(self) -> int:
        """The most parameters one module owns itself (the embedding or head, else the MLP's fc):
        the full tensors the trainer initialises at once."""
        d = self.d_model
        return max(self.vocab_size * d, self.seq_len * d, 4 * d * d)

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6N for the matmuls plus 12·L·d·S for attention scores."""
        non_embedding = self.n_params - self.embedding_params
        return 6.0 * non_embedding + 12.0 * self.n_layers * self.d_model * self.seq_len


USER_ARCH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")  # package.module:function

# name: (layers, d_model, heads, seq_len, vocab)
GPT_PRESETS: dict[str, GPTShape] = {
    "tiny": GPTShape(2, 64, 4, 64, 256),
    "small": GPTShape(6, 384, 6, 256, 8192),
    "125m": GPTShape(12, 768, 12, 2048, 50304),
    "350m": GPTShape(24, 1024, 16, 2048, 50304),
    "760m": GPTShape(24, 1536, 16, 2048, 50304),
    "1.3b": GPTShape(24, 2048, 32, 2048, 50304),
    "2.7b": GPTShape(32, 2560, 32, 2048, 50304),
    "6.7b": GPTShape(32, 4096, 32, 2048, 50304),
    "13b": GPTShape(40, 5120, 40, 2048, 50304),
    "30b": GPTShape(60, 6656, 52, 2048, 50304),
    "70b": GPTShape(80, 8192, 64, 2048, 50304),
}


def gpt_shape(size: str, seq_len: int = 0, vocab_size: int = 0) -> GPTShape:
    """The preset's shape with the spec's optional overrides applied."""
    base = GPT_PRESETS[size]
    return GPTShape(base.n_layers, base.d_model, base.n_heads, seq_len or base.seq_len,
                    vocab_size or base.vocab_size)


@dataclass(frozen=True)
class ModelFacts:
    """What the planner and the trainer know about a model; None where it cannot know."""

    label: str
    n_params: int | None
    unit_params: int | None  # the largest FSDP unit (a block)
    root_params: int | None  # parameters outside the blocks (embeddings, final norm, head)
    n_units: int
    flops_per_token: float | None
    seq_len: int
    vocab_size: int
    gpt: GPTShape | None = None  # the built-in GPT's shape; None for user models
    activation_gb_per_sample: float = 0.0  # measured, for user models (0: unknown)
    param_shapes: tuple[tuple[int, ...], ...] = ()  # every parameter's shape; empty when unknown
    largest_module_params: int | None = None  # the most parameters one module owns (init granularity)

    @property
    def builtin(self) -> bool:
        return self.gpt is not None


def gpt_facts(label: str, shape: GPTShape) -> ModelFacts:
    return ModelFacts(label=label, n_params=shape.n_params, unit_params=shape.block_params,
                      root_params=shape.embedding_params + shape.head_params, n_units=shape.n_layers,
                      flops_per_token=shape.flops_per_token(), seq_len=shape.seq_len, vocab_size=shape.vocab_size,
                      gpt=shape, param_shapes=shape.param_shapes(), largest_module_params=shape.largest_module_params)


def model_facts(model: Model) -> ModelFacts:
    """The description of ``spec.model`` (a checked spec: a known preset, or a user model with
    ``seq_len`` and ``vocab_size`` set)."""
    if model.arch == "gpt":
        return gpt_facts(f"gpt {model.size}", gpt_shape(model.size, model.seq_len, model.vocab_size))
    return ModelFacts(label=model.arch, n_params=None, unit_params=None, root_params=None, n_units=0,
                      flops_per_token=None, seq_len=model.seq_len, vocab_size=model.vocab_size,
                      activation_gb_per_sample=model.activation_gb)


def model_problems(model: Model) -> list[str]:
    """What is wrong with ``spec.model`` for its family (checked at load, on the login node)."""
    if model.arch == "gpt":
        if model.size not in GPT_PRESETS:
            return [f"`model.size` = {model.size!r}: expected one of {', '.join(GPT_PRESETS)}"]
        return []
    if not USER_ARCH.match(model.arch):
        return [f"`model.arch` = {model.arch!r}: expected 'gpt' or 'package.module:function'"]
    return [f"`model.{key}` must be set for the user model {model.arch!r} (0 means the preset's, and a user "
            f"model has none)" for key in ("seq_len", "vocab_size") if not getattr(model, key)]

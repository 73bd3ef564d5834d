"""What hpcx knows about a spec's model, without torch: ``model_facts(spec.model)``.

One description per model family answers every question the login side and the trainer ask
(parameter count, the largest FSDP unit, FLOPs per token, context length, vocabulary, activation
memory source, a label for people), so no other module branches on ``model.arch``:

- the built-in GPT (``arch = "gpt"``): a preset ``GPTShape`` (``model.size``) with any of
  ``dim``, ``n_layers``, ``n_heads``, ``seq_len``, ``vocab_size``, ``tie_embeddings`` from the
  spec in its place; the trainer builds its model from the same shape, so the planner's counts
  hold by construction. A pre-LN GPT: token + learned position embeddings, ``n_layers`` blocks of
  (LayerNorm, causal self-attention, LayerNorm, 4× MLP), a final LayerNorm and an output head
  (its own matrix, or the token embedding's when tied); linear layers have no bias;
- a user model (``arch = "pkg.mod:function"``): what the spec states (``seq_len`` and
  ``vocab_size`` are required; ``n_params`` with ``n_layers`` and ``dim`` make it plannable;
  without them the parameter count is unknown to a login node).
"""

from __future__ import annotations

import math
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
    tied: bool = False  # the output head uses the token embedding's matrix

    @property
    def block_params(self) -> int:
        d = self.d_model
        return 12 * d * d + 4 * d  # qkv 3d², proj d², mlp 8d², two LayerNorms 4d

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.d_model + self.seq_len * self.d_model

    @property
    def head_params(self) -> int:
        """Final LayerNorm, plus the output head's own matrix unless it is tied to the embedding."""
        return 2 * self.d_model + (0 if self.tied else self.vocab_size * self.d_model)

    @property
    def n_params(self) -> int:
        return self.embedding_params + self.n_layers * self.block_params + self.head_params

    @property
    def matmul_params(self) -> int:
        """Weights that enter a matrix multiply: the blocks' linear layers and the head (tied or not).
        These are what autocast copies to bf16/fp16; embeddings and LayerNorms stay fp32."""
        return self.n_layers * 12 * self.d_model ** 2 + self.vocab_size * self.d_model

    def param_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Every parameter's shape, in the built model's order (FSDP2 shards each one on dim 0)."""
        d, v, s = self.d_model, self.vocab_size, self.seq_len
        block = ((d,), (d,), (3 * d, d), (d, d), (d,), (d,), (4 * d, d), (d, 4 * d))  # ln1, attn, ln2, mlp
        return ((v, d), (s, d)) + block * self.n_layers + ((d,), (d,)) + (() if self.tied else ((v, d),))

    @property
    def largest_module_params(self) -> int:
        """The most parameters one module owns itself (the embedding or head, else the MLP's fc):
        the full tensors the trainer initialises at once."""
        d = self.d_model
        return max(self.vocab_size * d, self.seq_len * d, 4 * d * d)

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6N over the non-embedding parameters (blocks, final norm and the head,
        whose matmul runs tied or not) plus 12·L·d·S for attention scores."""
        non_embedding = self.n_layers * self.block_params + 2 * self.d_model + self.vocab_size * self.d_model
        return 6.0 * non_embedding + 12.0 * self.n_layers * self.d_model * self.seq_len


USER_ARCH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")  # package.module:function

# name: (layers, d_model, heads, seq_len, vocab); untied head, learned positions (see n_params for
# the real counts, which differ from the names: "125m" has 164M parameters)
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


def gpt_shape(size: str, seq_len: int = 0, vocab_size: int = 0, *, dim: int = 0, n_layers: int = 0,
              n_heads: int = 0, tied: bool = False) -> GPTShape:
    """The preset's shape with the spec's overrides applied (0 keeps the preset's value)."""
    base = GPT_PRESETS[size]
    return GPTShape(n_layers or base.n_layers, dim or base.d_model, n_heads or base.n_heads,
                    seq_len or base.seq_len, vocab_size or base.vocab_size, tied)


def spec_shape(model: Model) -> GPTShape:
    """The built-in GPT's shape as ``model`` (a ``[model]`` section) describes it."""
    return gpt_shape(model.size, model.seq_len, model.vocab_size, dim=model.dim, n_layers=model.n_layers,
                     n_heads=model.n_heads, tied=model.tie_embeddings)


def preset_counts() -> str:
    """``tiny (136K), small (…), 125m (164M) …``: the presets with their real parameter counts."""
    return ", ".join(f"{name} ({count_text(shape.n_params)})" for name, shape in GPT_PRESETS.items())


def count_text(n: int) -> str:
    """A parameter count for people: 136K, 164M, 1.42B."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            value = n / scale
            return f"{value:.3g}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return str(n)


@dataclass(frozen=True)
class ModelFacts:
    """What the planner and the trainer know about a model; None where it cannot know."""

    label: str  # for people, with the real parameter count: "gpt 125m (164M params)"
    n_params: int | None
    unit_params: int | None  # the largest FSDP unit (a block)
    root_params: int | None  # parameters outside the blocks (embeddings, final norm, head)
    n_units: int
    flops_per_token: float | None
    seq_len: int
    vocab_size: int
    gpt: GPTShape | None = None  # the built-in GPT's shape; None for user models
    activation_gb_per_sample: float = 0.0  # measured, for user models (0: unknown)
    matmul_params: int | None = None  # weights autocast copies to bf16/fp16 (None: assume all)
    source: str = ""  # where the parameter count comes from
    param_shapes: tuple[tuple[int, ...], ...] = ()  # every parameter's shape; empty when unknown
    largest_module_params: int | None = None  # the most parameters one module owns (init granularity)
    llama: tp.Any = None  # the Llama family's shape (hpc.llama.LlamaShape); None for other families

    @property
    def builtin(self) -> bool:
        return self.gpt is not None or self.llama is not None


@dataclass(frozen=True)
class Counted:
    """A user model's parameters, counted by building it (``trainer.count``, on the meta device)."""

    n_params: int
    unit_params: int  # the largest block under ``model.blocks``
    n_units: int
    embedding_params: int  # nn.Embedding weights that no linear layer shares


def gpt_facts(label: str, shape: GPTShape) -> ModelFacts:
    return ModelFacts(label=f"{label} ({count_text(shape.n_params)} params)", n_params=shape.n_params,
                      unit_params=shape.block_params, root_params=shape.embedding_params + shape.head_params,
                      n_units=shape.n_layers, flops_per_token=shape.flops_per_token(), seq_len=shape.seq_len,
                      vocab_size=shape.vocab_size, gpt=shape, matmul_params=shape.matmul_params,
                      source="counted from the shape", param_shapes=shape.param_shapes(),
                      largest_module_params=shape.largest_module_params)


def gpt_label(model: Model) -> str:
    """``gpt 125m``, or the architecture when the spec changes the preset's layers, width or heads."""
    if not (model.dim or model.n_layers or model.n_heads):
        return f"gpt {model.size}" + (" tied" if model.tie_embeddings else "")
    shape = spec_shape(model)
    return (f"gpt {shape.n_layers} layers × dim {shape.d_model}, {shape.n_heads} heads"
            + (", tied" if shape.tied else ""))


def model_facts(model: Model, counted: Counted | None = None) -> ModelFacts:
    """The description of ``spec.model`` (a checked spec: a known preset, or a user model with
    ``seq_len`` and ``vocab_size`` set). ``counted`` replaces a user model's stated numbers."""
    if model.arch == "gpt":
        return gpt_facts(gpt_label(model), spec_shape(model))
    if model.arch == "llama":
        from hpc.llama import llama_facts

        return llama_facts(model)
    if counted is not None:
        return _counted_facts(model, counted)
    if model.n_params:
        return _stated_facts(model)
    return ModelFacts(label=f"{model.arch} (parameters unknown)", n_params=None, unit_params=None,
                      root_params=None, n_units=0, flops_per_token=None, seq_len=model.seq_len,
                      vocab_size=model.vocab_size, activation_gb_per_sample=model.activation_gb, source="unknown")


def _attention_flops(model: Model, n_layers: int) -> float:
    return 12.0 * n_layers * model.dim * model.seq_len if model.dim else 0.0


def _stated_facts(model: Model) -> ModelFacts:
    """A user model's stated ``n_params``, ``n_layers`` and ``dim``: the embedding (and an untied head)
    are vocab_size × dim each, the blocks share the rest evenly."""
    n, embed = model.n_params, model.vocab_size * model.dim
    root = embed * (1 if model.tie_embeddings else 2)
    matmul = n - (0 if model.tie_embeddings else embed)
    return ModelFacts(label=f"{model.arch} ({count_text(n)} params, stated)", n_params=n,
                      unit_params=math.ceil((n - root) / model.n_layers), root_params=root,
                      n_units=model.n_layers, flops_per_token=6.0 * matmul + _attention_flops(model, model.n_layers),
                      seq_len=model.seq_len, vocab_size=model.vocab_size,
                      activation_gb_per_sample=model.activation_gb, source="stated in the spec")


def _counted_facts(model: Model, c: Counted) -> ModelFacts:
    return ModelFacts(label=f"{model.arch} ({count_text(c.n_params)} params, counted)", n_params=c.n_params,
                      unit_params=c.unit_params, root_params=c.n_params - c.unit_params * c.n_units,
                      n_units=c.n_units,
                      flops_per_token=6.0 * (c.n_params - c.embedding_params) + _attention_flops(model, c.n_units),
                      seq_len=model.seq_len, vocab_size=model.vocab_size,
                      activation_gb_per_sample=model.activation_gb, source="counted on the meta device")


def model_problems(model: Model) -> list[str]:
    """What is wrong with ``spec.model`` for its family (checked at load, on the login node)."""
    from hpc import llama

    if model.arch == "llama":
        return llama.llama_problems(model)
    foreign = llama.foreign_field_problems(model)
    if foreign:
        return foreign
    if model.arch == "gpt":
        if model.size not in GPT_PRESETS:
            return [f"`model.size` = {model.size!r}: expected one of {', '.join(GPT_PRESETS)}"]
        if model.n_params:
            return [f"`model.n_params` = {model.n_params} is for user models: the built-in GPT's count follows "
                    f"from its shape ({count_text(spec_shape(model).n_params)} here)"]
        return _shape_problems(spec_shape(model))
    if not USER_ARCH.match(model.arch):
        return [f"`model.arch` = {model.arch!r}: expected 'gpt', 'llama' or 'package.module:function'"]
    errors = [f"`model.{key}` must be set for the user model {model.arch!r} (0 means the preset's, and a user "
              f"model has none)" for key in ("seq_len", "vocab_size") if not getattr(model, key)]
    return errors + _stated_problems(model)


def _shape_problems(shape: GPTShape) -> list[str]:
    if shape.d_model % shape.n_heads:
        return [f"`model.dim` = {shape.d_model} is not divisible by `model.n_heads` = {shape.n_heads} "
                f"(head size {shape.d_model / shape.n_heads:g})"]
    return []


def _stated_problems(model: Model) -> list[str]:
    """A stated parameter count needs the number of blocks and the width (FSDP unit sizes, FLOPs)."""
    if not model.n_params:
        return []
    missing = [f"`model.{k}`" for k in ("n_layers", "dim") if not getattr(model, k)]
    if missing:
        return [f"`model.n_params` = {model.n_params} is set for {model.arch!r} but {' and '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not: the planner needs the number of blocks and the "
                "width to size the FSDP units"]
    root = model.vocab_size * model.dim * (1 if model.tie_embeddings else 2)
    if model.n_params <= root:
        return [f"`model.n_params` = {model.n_params} is not more than the embedding"
                f"{'' if model.tie_embeddings else ' and head'} alone (vocab_size {model.vocab_size} × dim "
                f"{model.dim}{'' if model.tie_embeddings else ' × 2'} = {root})"]
    return []

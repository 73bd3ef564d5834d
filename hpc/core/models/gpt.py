"""The built-in GPT (``arch = "gpt"``), torch-free: its shape, counts, FLOPs, activation bytes, checks.

A preset ``GPTShape`` (``model.size``) with any of ``dim``, ``n_layers``, ``n_heads``, ``seq_len``,
``vocab_size``, ``tie_embeddings`` from the spec in its place; the trainer builds its model from the
same shape (``trainer.models.gpt``), so the planner's counts hold by construction. A pre-LN GPT: token
+ learned position embeddings, ``n_layers`` blocks of (LayerNorm, causal self-attention, LayerNorm, 4×
MLP), a final LayerNorm and an output head (its own matrix, or the token embedding's when tied);
linear layers have no bias.
"""

from __future__ import annotations

import typing as tp
from dataclasses import dataclass

from hpc.core.models import Counted, ModelFacts, compute_bytes, count_text, residual_bytes
from hpc.core.models.decoder import LOGIT_BYTES, Activations, decoder_activations, loss_terms  # noqa: F401  (re-exported)
from hpc.core.models.tp_plan import BlockTp, TpPlan, tp_facts

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.core.spec import Model



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

    def param_names(self) -> list[str]:
        """Every parameter's name, in ``param_shapes`` order."""
        block = ("ln1.weight", "ln1.bias", "attn.qkv.weight", "attn.proj.weight", "ln2.weight", "ln2.bias",
                 "mlp.fc.weight", "mlp.proj.weight")
        names = ["tok_emb.weight", "pos_emb.weight"] + [f"blocks.{i}.{p}" for i in range(self.n_layers) for p in block]
        return names + ["ln_f.weight", "ln_f.bias"] + ([] if self.tied else ["head.weight"])

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


# The GPT's tensor-parallel plan: its attention has one fused qkv matrix whose rows are [q | k | v] (a column
# split would give a rank all of q and none of v), so it is computed whole on each rank of the group; the MLP
# splits as the Llama's. The planner does not count it yet (its activations have no tp term): ``planned``.
TP_PLAN = TpPlan(BlockTp(column=("mlp.fc",), row=("mlp.proj",), norms=("ln1", "ln2"), gathered=(("mlp", 1),),
                         whole=("attn",)), final_norm="ln_f", positions="pos_emb", planned=False)

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


def gpt_facts(label: str, shape: GPTShape) -> ModelFacts:
    return ModelFacts(label=f"{label} ({count_text(shape.n_params)} params)", n_params=shape.n_params,
                      unit_params=shape.block_params, root_params=shape.embedding_params + shape.head_params,
                      kept_params=shape.embedding_params + shape.head_params if shape.tied else shape.head_params,
                      n_units=shape.n_layers, flops_per_token=shape.flops_per_token(), seq_len=shape.seq_len,
                      vocab_size=shape.vocab_size, shape=shape, matmul_params=shape.matmul_params,
                      source="counted from the shape", param_shapes=shape.param_shapes(),
                      largest_module_params=shape.largest_module_params, family="gpt",
                      **tp_facts(TP_PLAN, shape, shape.param_names()))


def gpt_label(model: Model) -> str:
    """``gpt 125m``, or the architecture when the spec changes the preset's layers, width or heads."""
    if not (model.dim or model.n_layers or model.n_heads):
        return f"gpt {model.size}" + (" tied" if model.tie_embeddings else "")
    shape = spec_shape(model)
    return (f"gpt {shape.n_layers} layers × dim {shape.d_model}, {shape.n_heads} heads"
            + (", tied" if shape.tied else ""))


def facts(model: Model, counted: Counted | None = None) -> ModelFacts:
    """The built-in GPT of ``model`` (a checked ``[model]``); ``counted`` does not apply."""
    return gpt_facts(gpt_label(model), spec_shape(model))


def problems(model: Model) -> list[str]:
    """A known preset, no stated count (it follows from the shape), heads that divide the width."""
    if model.size not in GPT_PRESETS:
        return [f"`model.size` = {model.size!r}: expected one of {', '.join(GPT_PRESETS)}"]
    if model.n_params:
        return [f"`model.n_params` = {model.n_params} is for user models: the built-in GPT's count follows "
                f"from its shape ({count_text(spec_shape(model).n_params)} here)"]
    return _shape_problems(spec_shape(model))


def code_notice(model: Model) -> str | None:
    return None


def activation_bytes(facts: ModelFacts, micro_batch: int, checkpointing: bool, mixed_precision: str,
                     dropout: float = 0.0, autocast: bool = False) -> float:
    """``gpt_activation_bytes`` of the facts' shape."""
    return gpt_activation_bytes(facts.shape, micro_batch, checkpointing, mixed_precision, dropout, autocast)


def gpt_activations(shape: GPTShape, micro_batch: int, checkpointing: bool, mixed_precision: str,
                    dropout: float = 0.0, autocast: bool = False) -> Activations:
    """The built-in GPT's activation bytes of one micro-batch.

    Per block and token, Korthikanti et al. (2022) count 16 elements of h (two LayerNorm inputs,
    the attention's and MLP's matmul inputs and outputs), two 1-byte dropout masks and 5·a·s bytes
    for the attention matrix; fused SDPA stores no s×s matrix, only an fp32 log-sum-exp per head.
    The two LayerNorm inputs are the residual stream (fp32 under autocast, ``residual_bytes``);
    LayerNorm also keeps a mean and a reciprocal std per token. The peak is at the loss's backward
    (all blocks' activations, the logits the loop holds, fp32 log-softmax and its gradient in and
    out) or, when that is smaller, inside the last block's backward. With checkpointing, each block
    keeps its input and one block is recomputed at a time. ``held`` is checked against autograd's
    saved tensors (tests/test_plan_activations.py), ``peak`` against the CPU allocator
    (bench/activation_memory).
    """
    c, r = compute_bytes(mixed_precision), residual_bytes(mixed_precision, autocast)
    tokens, d = micro_batch * shape.seq_len, shape.d_model
    masks = 2 if dropout > 0 else 0
    block = tokens * d * (14 * c + 2 * r + masks) + tokens * 4 * r + tokens * shape.n_heads * 4
    head = tokens * d * (r + c) + 2 * tokens * r  # ln_f input (residual) and output (the head's input)
    logits, log_probs, loss = loss_terms(tokens, shape.vocab_size, c)  # the chunked cross-entropy's
    grads = tokens * d * (r + 4 * c)  # the MLP's backward: residual gradient + 4h-wide input gradient
    small = tokens * 16 + (tokens * d if dropout > 0 else 0)  # token ids and targets; embedding dropout mask
    return decoder_activations(shape.n_layers, block, tokens * d * r, head, logits, log_probs, loss, grads, small,
                               checkpointing)


def gpt_activation_bytes(shape: GPTShape, micro_batch: int, checkpointing: bool, mixed_precision: str,
                         dropout: float = 0.0, autocast: bool = False) -> float:
    """Activation memory of one micro-batch at its peak (``gpt_activations(...).peak``)."""
    return gpt_activations(shape, micro_batch, checkpointing, mixed_precision, dropout, autocast).peak


def _shape_problems(shape: GPTShape) -> list[str]:
    if shape.d_model % shape.n_heads:
        return [f"`model.dim` = {shape.d_model} is not divisible by `model.n_heads` = {shape.n_heads} "
                f"(head size {shape.d_model / shape.n_heads:g})"]
    return []


# ---------------------------------------------------------------- Hugging Face: GPT2LMHeadModel


def hf_config(s: GPTShape) -> dict[str, tp.Any]:
    """``config.json`` of the ``GPT2LMHeadModel`` that computes what this GPT computes (fp32 weights)."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": s.vocab_size,
            "n_positions": s.seq_len, "n_embd": s.d_model, "n_layer": s.n_layers, "n_head": s.n_heads,
            "n_inner": 4 * s.d_model, "activation_function": "gelu",  # exact erf GELU, as hpcx's F.gelu
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "layer_norm_epsilon": 1e-5,
            "scale_attn_weights": True, "tie_word_embeddings": s.tied, "torch_dtype": "float32"}


def hf_tensor_plan(s: GPTShape) -> list[tp.Any]:
    """Every ``GPT2LMHeadModel`` tensor: GPT-2's ``Conv1D`` stores ``[in, out]`` (transposed), and its
    biases, which hpcx's GPT does not have, are zeros."""
    d, v = s.d_model, s.vocab_size
    plan = [_hf("transformer.wte.weight", "tok_emb.weight", "copy", (v, d)),
            _hf("transformer.wpe.weight", "pos_emb.weight", "copy", (s.seq_len, d))]
    for i in range(s.n_layers):
        for ours, hf, d_in, d_out in (("ln1", "ln_1", d, 0), ("attn.qkv", "attn.c_attn", d, 3 * d),
                                      ("attn.proj", "attn.c_proj", d, d), ("ln2", "ln_2", d, 0),
                                      ("mlp.fc", "mlp.c_fc", d, 4 * d), ("mlp.proj", "mlp.c_proj", 4 * d, d)):
            plan += _hf_layer(f"blocks.{i}.{ours}", f"transformer.h.{i}.{hf}", d_in, d_out)
    plan += _hf_layer("ln_f", "transformer.ln_f", d, 0)
    if not s.tied:
        plan.append(_hf("lm_head.weight", "head.weight", "copy", (v, d)))
    return plan


def _hf(name: str, source: str, op: str, shape: tuple[int, ...]) -> tp.Any:
    from hpc.core.hf import HfTensor  # lazy: startup

    return HfTensor(name, source, op, shape)


def _hf_layer(ours: str, hf: str, d_in: int, d_out: int) -> list[tp.Any]:
    """A LayerNorm (``d_out`` 0: weight and bias copied) or a Conv1D (weight transposed, zero bias)."""
    if not d_out:
        return [_hf(f"{hf}.{p}", f"{ours}.{p}", "copy", (d_in,)) for p in ("weight", "bias")]
    return [_hf(f"{hf}.weight", f"{ours}.weight", "transpose", (d_in, d_out)),
            _hf(f"{hf}.bias", "", "zeros", (d_out,))]


@dataclass
class Fields:
    """The GPT reads only the fields every family has (``hpc.core.spec.CommonModel``)."""


class Gpt:
    """The built-in GPT as a ``hpc.core.models.Family`` (and ``HfMapped``: ``GPT2LMHeadModel``)."""

    name = "gpt"
    phrase = "arch = 'gpt'"
    fields = Fields
    builder = "trainer.models.gpt"
    counted_by_building = False  # the count follows from the shape: nothing to build
    facts = staticmethod(facts)
    problems = staticmethod(problems)
    activation_bytes = staticmethod(activation_bytes)
    code_notice = staticmethod(code_notice)
    preset_counts = staticmethod(preset_counts)
    hf_config = staticmethod(hf_config)
    hf_tensor_plan = staticmethod(hf_tensor_plan)
    lora_targets = (("qkv", "c_attn"), ("proj", "c_proj"), ("fc", "c_fc"))
    tp_plan = TP_PLAN


FAMILY = Gpt()

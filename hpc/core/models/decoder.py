"""What the built-in decoder families share, torch-free: the activation bookkeeping of a stack of blocks
under a language-model head (``gpt``, ``llama``, ``qwen2``, ``mistral``), and the Llama block the last
three are built of (``LlamaShape``, its ``[model]`` fields, counts, activations, Hugging Face names and
config reading). A family module imports this, never another family's module (tests/test_layers.py).
"""

from __future__ import annotations

import typing as tp
from dataclasses import dataclass, replace

from hpc.core.config import field
from hpc.core.models import ModelFacts, compute_bytes, count_text, residual_bytes
from hpc.core.models.tp_plan import BlockTp, TpPlan, tp_facts

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.core.spec import Model

# LoRA's targets of a Llama-block model (``hpc.core.lora``): hpcx's module name, Hugging Face's
BLOCK_LORA_TARGETS = (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"), ("w1", "gate_proj"),
                      ("w2", "down_proj"), ("w3", "up_proj"))
# The Llama block's tensor-parallel plan (torchtitan's): q/k/v and gate/up split by heads and hidden units,
# o and down by their inputs, the norms sequence-parallel; attention takes (x, cos, sin), x gathered
BLOCK_TP_PLAN = TpPlan(BlockTp(column=("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3"), row=("attn.wo", "mlp.w2"),
                               norms=("attn_norm", "mlp_norm"), gathered=(("attn", 3), ("mlp", 1))),
                       divides=("n_heads", "n_kv_heads"))
LOGIT_BYTES = 12  # per logit at the loss's backward: fp32 log-probs + their gradient in and out
# The trainer's cross-entropy runs over chunks of at most this many logits (``trainer.objective``): the
# fp32 log-softmax and its gradients exist for one chunk at a time, never for the whole micro-batch.
LOSS_CHUNK_LOGITS = 2**26


# Packed documents (``data.packing = "document"``) attend through one of three kernels
# (``trainer.models.decoder.DocumentAttention``), chosen by ``document_kernel`` on both sides:
FLEX = "flex"  # a GPU: torch's compiled flex_attention over a document BlockMask (no dense mask)
SEGMENTS = "segments"  # a CPU (or dropout): SDPA's causal kernel once per document span
MASK = "mask"  # the dense [batch, 1, seq, seq] boolean mask: the meta device (hpcx dryrun) and the reference
FLEX_BLOCK = 128  # flex_attention's BlockMask block (queries and keys per block)
BLOCK_MASK_TENSORS = 4  # kv and q blocks, partial and full: each a count [b, 1, n] and an index [b, 1, n, n]


def document_kernel(gpu: bool, dropout: float) -> str:
    """The kernel packed documents attend through: flex_attention on a GPU (its backward runs on CUDA
    only in torch 2.13, and it has no dropout), SDPA per document span otherwise."""
    return FLEX if gpu and dropout == 0 else SEGMENTS


def block_mask_bytes(micro_batch: int, seq_len: int) -> int:
    """What flex_attention's document BlockMask of one micro-batch holds: int32 counts [b, 1, n] and
    indices [b, 1, n, n] of n = seq/128 blocks, for the kv and q directions, partial and full blocks
    (``create_block_mask``'s eight tensors): O(seq²/128²), 4 MB at 8 × 16k tokens."""
    n = -(-seq_len // FLEX_BLOCK)
    return BLOCK_MASK_TENSORS * 4 * micro_batch * (n + n * n)


def dense_mask_bytes(micro_batch: int, seq_len: int) -> int:
    """The dense boolean document mask of one micro-batch (the ``mask`` kernel): ``micro_batch × seq²``."""
    return micro_batch * seq_len * seq_len


def loss_chunk_tokens(tokens: int, vocab: int) -> int:
    """Tokens per chunk of the trainer's chunked cross-entropy (at least one, at most ``tokens``)."""
    return max(1, min(tokens, LOSS_CHUNK_LOGITS // max(1, vocab)))


def loss_terms(tokens: int, vocab: int, c: int, tp: int = 1) -> tuple[float, float, float]:
    """(logits, log_probs, loss) bytes of one micro-batch's loss on one rank: the logits the loop holds
    (compute dtype ``c``); what the loss saves for backward beyond them; what its backward adds. The
    trainer's chunked cross-entropy (``trainer.objective.ChunkedCrossEntropy``) saves nothing beyond
    the logits and, in backward, holds the logits' gradient (``c`` bytes each) and one chunk's fp32
    log-softmax with its gradient in and out (``LOGIT_BYTES`` each). Under tensor parallelism (loss
    parallel: the vocabulary split over ``tp`` ranks) the whole fp32 log-softmax of the rank's share
    is saved and its backward takes ``LOGIT_BYTES`` per logit."""
    logits = tokens * vocab * c / tp
    if tp > 1:
        return logits, tokens * vocab * 4 / tp, tokens * vocab * LOGIT_BYTES / tp
    return logits, 0.0, tokens * vocab * c + loss_chunk_tokens(tokens, vocab) * vocab * LOGIT_BYTES


@dataclass(frozen=True)
class Activations:
    """Activation bytes of one micro-batch."""

    held: float  # at the end of forward: what autograd saved, plus the logits the training loop holds
    peak: float  # the most alive at once, during backward


def decoder_activations(layers: int, block: float, block_input: float, head: float, logits: float,
                        log_probs: float, loss: float, grads: float, small: float, checkpointing: bool) -> Activations:
    """``Activations`` of a stack of ``layers`` decoder blocks from one micro-batch's parts: ``block``
    what one block saves, ``block_input`` what it keeps under checkpointing, ``head`` the final norm's
    and the head's inputs, the loss's ``logits``, fp32 ``log_probs`` and gradient ``loss``, ``grads``
    the widest gradients inside one block's backward, ``small`` ids, targets and shared tables. The
    peak is at the loss's backward or inside the last block's (recomputed first under checkpointing)."""
    kept = layers * (block_input if checkpointing else block)
    inner = block + grads if checkpointing else grads
    return Activations(kept + head + logits + log_probs + small, kept + logits + max(head + loss, inner) + small)


# ---------------------------------------------------------------- the Llama block, shared by its families
#
# ``llama``, ``qwen2`` and ``mistral`` are one block (RMSNorm, grouped-query attention with rotary
# embeddings, RMSNorm, SwiGLU MLP) with different settings: what they share is here, each family's module
# has its presets, its checks and its Hugging Face class.


@dataclass
class BlockFields:
    """The ``[model]`` fields every Llama-block family reads (0 keeps the preset's value); each family's
    ``Fields`` subclasses this, so they are declared once and shared (``hpc.core.models.section_class``)."""

    n_kv_heads: int = field(0, doc="Llama, Qwen2, Mistral: key/value heads of grouped-query attention (0: the "
                            "preset's); must divide `n_heads`.", minimum=0)
    ffn_dim: int = field(0, doc="Llama, Qwen2, Mistral: the SwiGLU MLP's hidden width (0: the preset's; a Llama "
                         "computes it from `multiple_of` and `ffn_dim_multiplier` as Meta's code does).", minimum=0)
    rope_theta: float = field(0.0, doc="Llama, Qwen2, Mistral: rotary embedding base (0: the preset's; 10000 for "
                              "Llama 2, 500000 for Llama 3, 1000000 for Qwen2.5 and Mistral v0.3).",
                              minimum=0, maximum=1e12)
    norm_eps: float = field(0.0, doc="Llama, Qwen2, Mistral: RMSNorm epsilon (0: the preset's: 1e-5, 1e-6 for "
                            "Qwen2).", minimum=0)
    context_len: int = field(0, doc="Llama, Qwen2, Mistral: the model's context, what an export records as "
                             "`max_position_embeddings` (0: `seq_len`); `hf_config` sets it, and `seq_len` "
                             "may be any length up to it.", minimum=0)


@dataclass
class HeadFields(BlockFields):
    """``BlockFields`` and a head width of its own (Qwen2's and Mistral's ``head_dim``)."""

    head_dim: int = field(0, doc="Qwen2, Mistral: the width of one attention head (0: `dim` / `n_heads`; "
                          "Mistral NeMo's differs).", minimum=0)


@dataclass(frozen=True)
class LlamaShape:
    """Every number that fixes a Llama-block model (``ffn_dim`` already resolved)."""

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
    qkv_bias: bool = False  # q, k and v projections with biases (Qwen2); o has none
    head_size: int = 0  # one head's width when not d_model / n_heads (Mistral's head_dim); 0: d_model / n_heads
    window: int = 0  # sliding-window attention: a token sees the last ``window`` tokens, itself included; 0: all

    @property
    def context(self) -> int:
        """The model's context (``max_position_embeddings``): ``seq_len`` unless trained on shorter samples."""
        return max(self.context_len, self.seq_len)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_heads

    @property
    def q_dim(self) -> int:
        """Width of the queries (and of attention's output, ``wo``'s input): ``d_model`` unless ``head_size``."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def bias_params(self) -> int:
        """One block's q, k and v biases (0 without them)."""
        return self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0

    @property
    def block_params(self) -> int:
        d, q, kv = self.d_model, self.q_dim, self.kv_dim
        return 2 * d * q + 2 * d * kv + 3 * d * self.ffn_dim + 2 * d + self.bias_params  # q, o; k, v; MLP; norms

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
        return self.n_layers * (self.block_params - 2 * self.d_model - self.bias_params) + self.vocab_size * self.d_model

    def param_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Every parameter's shape, in the built model's order (FSDP2 shards each one on dim 0)."""
        d, q, kv, f, v = self.d_model, self.q_dim, self.kv_dim, self.ffn_dim, self.vocab_size
        bq, bkv = ((q,),) if self.qkv_bias else (), ((kv,),) if self.qkv_bias else ()
        block = ((d,), (q, d), *bq, (kv, d), *bkv, (kv, d), *bkv, (d, q), (d,), (f, d), (d, f), (f, d))
        return ((v, d),) + block * self.n_layers + ((d,),) + (() if self.tied else ((v, d),))

    @property
    def largest_module_params(self) -> int:
        """The most parameters one module owns itself (the embedding or head, else an MLP matrix or ``wq``)."""
        return max(self.vocab_size * self.d_model, self.ffn_dim * self.d_model,
                   self.d_model * self.q_dim + (self.q_dim if self.qkv_bias else 0))

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6N over the non-embedding parameters (the head's matmul runs tied
        or not) plus 12·L·q_dim·S for attention scores (the GPT's convention; a sliding window's mask
        still computes every score)."""
        non_embedding = self.n_layers * self.block_params + self.d_model + self.vocab_size * self.d_model
        return 6.0 * non_embedding + 12.0 * self.n_layers * self.q_dim * self.seq_len


def block_activations(shape: LlamaShape, micro_batch: int, checkpointing: bool, mixed_precision: str,
                      autocast: bool = False, tp: int = 1) -> Activations:
    """Activation bytes of one micro-batch of a Llama-block model (``Activations``), as autograd saves
    them in ``trainer.models.decoder.LlamaBlock`` (checked by tests/test_llama.py).

    Per block and token: each RMSNorm keeps an fp32 copy of its input, its normalised output (in the
    residual stream's dtype ``r``) and an fp32 reciprocal RMS; the linear layers keep their input in
    the compute dtype ``c`` (q, k and v share one; under autocast each casts its own copy, as do
    gate and up); SDPA keeps the rotated q and k, v, its output (``wo``'s input: CPU and CUDA
    kernels return it in [batch, seq, heads, head] memory order, so the reshape is a view) and an
    fp32 log-sum-exp per head; the SwiGLU keeps gate, up, silu(gate) and their
    product (4·ffn_dim). The cos/sin tables (per position) are shared by every block. A sliding window
    shorter than the sequence adds the [seq, seq] mask SDPA keeps, in the compute dtype, and k and v
    repeated to every query head (``trainer.models.decoder.causal_attention``). The peak
    follows the GPT's reasoning (``hpc.core.models.gpt.gpt_activations``).

    With ``tp`` > 1 (tensor + sequence parallelism, torchtitan's plan): the norms, the residual stream
    and a checkpointed block's input hold ``tokens / tp`` tokens; q/k/v, attention, the SwiGLU and
    the logits (loss parallel: the vocabulary split) ``1/tp`` of the heads, ffn columns and
    vocabulary; the inputs of the column-wise layers (one all-gathered tensor for q/k/v, one for
    gate/up, the head's) are kept whole, as DTensor's autograd saves the gathered input.
    """
    c, r = compute_bytes(mixed_precision), residual_bytes(mixed_precision, autocast)
    tokens, d, q, kv, f = micro_batch * shape.seq_len, shape.d_model, shape.q_dim, shape.kv_dim, shape.ffn_dim
    norm = d * (4 + r) + 4
    inputs = (3 + 2) * d * c if autocast and c < 4 else 2 * d * c  # autocast casts per layer
    windowed = 0 < shape.window < shape.seq_len
    kept_kv = q if windowed else kv  # under a window SDPA keeps k and v repeated to every query head
    inner = c * (2 * q + 2 * kept_kv) + 4 * shape.n_heads + 4 * f * c  # split by heads / ffn columns under tp
    block = tokens * (2 * norm / tp + inputs + inner / tp)
    if windowed:  # and the banded mask, as an additive one in the compute dtype
        block += shape.seq_len * shape.seq_len * c
    rope = 2 * shape.seq_len * shape.head_dim * r if shape.n_layers else 0
    head = tokens * (norm / tp + d * c)  # final norm (sequence-parallel), the head's (gathered) input
    logits, log_probs, loss = loss_terms(tokens, shape.vocab_size, c, tp)  # the chunked cross-entropy's
    grads = tokens * (d * r / tp + 3 * f * c / tp)  # the MLP's backward: residual gradient + three ffn-wide
    small = tokens * 16 + rope  # token ids and targets; cos/sin
    return decoder_activations(shape.n_layers, block, tokens * d * r / tp, head, logits, log_probs, loss, grads,
                               small, checkpointing)


# ---------------------------------------------------------------- a family of the block: shape, facts, checks


def block_shape(model: Model, base: LlamaShape) -> LlamaShape:
    """The preset ``base`` with every non-zero ``BlockFields`` / ``HeadFields`` field and shape field of
    ``model`` in its place (the Qwen2's and the Mistral's; the Llama's adds Meta's MLP rounding)."""
    heads = model.n_heads or base.n_heads
    kv = model.n_kv_heads or (base.n_kv_heads if not model.n_heads else min(base.n_kv_heads, heads))
    seq_len = model.seq_len or model.context_len or base.seq_len
    return replace(base, n_layers=model.n_layers or base.n_layers, d_model=model.dim or base.d_model, n_heads=heads,
                   n_kv_heads=kv, ffn_dim=model.ffn_dim or base.ffn_dim, seq_len=seq_len,
                   context_len=model.context_len if model.context_len > seq_len else 0,
                   vocab_size=model.vocab_size or base.vocab_size, tied=base.tied or model.tie_embeddings,
                   rope_theta=model.rope_theta or base.rope_theta, norm_eps=model.norm_eps or base.norm_eps,
                   head_size=getattr(model, "head_dim", 0) or base.head_size)


def block_label(arch: str, model: Model, shape: LlamaShape) -> str:
    """``qwen2 qwen2.5-7b (7.62B params)``, or the architecture when the spec (or its HF config) changes it."""
    changed = any(getattr(model, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"))
    text = (f"{arch} {model.size}" if not changed else
            f"{arch} {shape.n_layers} layers × dim {shape.d_model}, {shape.n_heads} heads / {shape.n_kv_heads} kv")
    window = f", window {shape.window}" if shape.window and changed else ""
    return f"{text}{', tied' if shape.tied and changed else ''}{window} ({count_text(shape.n_params)} params)"


def block_facts(arch: str, label: str, s: LlamaShape) -> ModelFacts:
    """The ``ModelFacts`` of a Llama-block model of family ``arch``."""
    return ModelFacts(label=label, n_params=s.n_params, unit_params=s.block_params,
                      root_params=s.embedding_params + s.head_params,
                      kept_params=s.embedding_params + s.head_params if s.tied else s.head_params, n_units=s.n_layers,
                      flops_per_token=s.flops_per_token(), seq_len=s.seq_len, vocab_size=s.vocab_size,
                      matmul_params=s.matmul_params, source="counted from the shape", param_shapes=s.param_shapes(),
                      largest_module_params=s.largest_module_params, shape=s, family=arch,
                      **tp_facts(BLOCK_TP_PLAN, s, hf_names(s)))


def block_problems(phrase: str, model: Model, presets: tp.Mapping[str, LlamaShape],
                   shape_of: tp.Callable[[Model], LlamaShape] | None = None,
                   head_words: str = "head size") -> list[str]:
    """What is wrong with the ``[model]`` of a Llama-block family (``phrase``: "arch = 'qwen2'"): a known
    preset, no learned parameter count or dropout, shapes that divide, ``seq_len`` within the context.
    ``shape_of``: the family's shape of the spec (default ``block_shape`` of its preset)."""
    if model.size not in presets:
        return [f"`model.size` = {model.size!r}: expected one of {', '.join(presets)} for {phrase}"]
    errors = [f"`model.{key}` = {getattr(model, key)!r} is not used by {phrase} (no learned "
              f"{'parameter count' if key == 'n_params' else 'dropout'})" for key in ("n_params", "dropout")
              if getattr(model, key)]
    s = shape_of(model) if shape_of is not None else block_shape(model, presets[model.size])
    if not s.head_size and s.d_model % s.n_heads:
        errors.append(f"`model.dim` = {s.d_model} is not divisible by `model.n_heads` = {s.n_heads}")
    elif s.head_dim % 2:
        errors.append(f"{head_words} {s.head_dim} is odd: rotary embeddings rotate pairs")
    if s.n_heads % s.n_kv_heads:
        errors.append(f"`model.n_heads` = {s.n_heads} is not divisible by `model.n_kv_heads` = {s.n_kv_heads}")
    if model.context_len and s.seq_len > model.context_len:
        errors.append(f"`model.seq_len` = {s.seq_len} is longer than the model's context `model.context_len` = "
                      f"{model.context_len}: train at most {model.context_len} tokens a sample")
    return errors


def block_activation_bytes(facts: ModelFacts, micro_batch: int, checkpointing: bool, mixed_precision: str,
                           dropout: float = 0.0, autocast: bool = False, tp: int = 1) -> float:
    """``block_activations(...).peak`` of the facts' shape (the block has no dropout)."""
    return block_activations(facts.shape, micro_batch, checkpointing, mixed_precision, autocast, tp).peak


def preset_text(presets: tp.Mapping[str, LlamaShape]) -> str:
    """``tiny (…), qwen2.5-7b (7.62B) …``: presets with their parameter counts."""
    return ", ".join(f"{name} ({count_text(s.n_params)})" for name, s in presets.items())


# ---------------------------------------------------------------- Hugging Face names and config.json

HF_BLOCK = (("attn_norm.weight", "input_layernorm.weight"), ("attn.wq.weight", "self_attn.q_proj.weight"),
            ("attn.wk.weight", "self_attn.k_proj.weight"), ("attn.wv.weight", "self_attn.v_proj.weight"),
            ("attn.wo.weight", "self_attn.o_proj.weight"), ("mlp_norm.weight", "post_attention_layernorm.weight"),
            ("mlp.w1.weight", "mlp.gate_proj.weight"), ("mlp.w2.weight", "mlp.down_proj.weight"),
            ("mlp.w3.weight", "mlp.up_proj.weight"))
BIASED = ("attn.wq.weight", "attn.wk.weight", "attn.wv.weight")  # their biases follow them (Qwen2)


def hf_block(shape: LlamaShape) -> list[tuple[str, str]]:
    """(hpcx name, Hugging Face name) of one block's tensors, in the built block's order."""
    out = []
    for ours, theirs in HF_BLOCK:
        out.append((ours, theirs))
        if shape.qkv_bias and ours in BIASED:
            out.append((ours.replace(".weight", ".bias"), theirs.replace(".weight", ".bias")))
    return out


def hf_names(shape: LlamaShape) -> dict[str, tuple[str, tuple[int, ...]]]:
    """hpcx parameter name → (the ``*ForCausalLM``'s name, shape), in the built model's order. The
    layouts are the same (no q/k permutation: rotary embeddings rotate halves, as transformers does); a
    tied model has no ``lm_head.weight``."""
    shapes = iter(shape.param_shapes())
    names = {"tok_emb.weight": "model.embed_tokens.weight"}
    block = hf_block(shape)
    for i in range(shape.n_layers):
        names.update({f"blocks.{i}.{ours}": f"model.layers.{i}.{theirs}" for ours, theirs in block})
    names["norm.weight"] = "model.norm.weight"
    if not shape.tied:
        names["head.weight"] = "lm_head.weight"
    return {ours: (theirs, next(shapes)) for ours, theirs in names.items()}


def hf_tensor_plan(shape: LlamaShape) -> list[tp.Any]:
    """Every Hugging Face tensor and the hpcx parameter it is (copied as is)."""
    from hpc.core.hf import HfTensor  # lazy: startup

    return [HfTensor(hf, ours, "copy", dims) for ours, (hf, dims) in hf_names(shape).items()]


POSITIVE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size", "vocab_size", "max_position_embeddings")
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
INT_MAX = 2**31 - 1


def rope_doc(doc: dict[str, tp.Any]) -> dict[str, tp.Any]:
    """The rotary settings of a config.json: ``rope_parameters`` (transformers 5) under ``rope_scaling`` (4)."""
    rope, scaling = doc.get("rope_parameters"), doc.get("rope_scaling")
    return {**(rope if isinstance(rope, dict) else {}), **(scaling if isinstance(scaling, dict) else {})}


def impossible(where: str, doc: dict[str, tp.Any]) -> list[str]:
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
    if heads and width and doc.get("head_dim") is None and width % heads:
        out.append(f"{where}: hidden_size = {width}: expected a multiple of num_attention_heads = {heads}")
    eps = doc.get("rms_norm_eps")
    if "rms_norm_eps" in doc and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1):
        out.append(f"{where}: rms_norm_eps = {eps!r}: expected a number between 0 and 1")
    return out


def block_unsupported(where: str, doc: dict[str, tp.Any], name: str) -> list[str]:
    """One line per config.json value a Qwen2 or Mistral (``name``: "hpcx's Qwen2") does not implement:
    the keys it needs, impossible shapes, another activation, a head width that is not a whole positive
    number, rotary scaling of any type (only the plain rotary embedding is implemented)."""
    out = [f"{where}: {key} is missing" for key in REQUIRED if key not in doc]
    out += impossible(where, doc)
    if doc.get("hidden_act", "silu") != "silu":
        out.append(f"{where}: hidden_act = {doc['hidden_act']!r}; {name} has 'silu'")
    head = doc.get("head_dim")
    if head is not None and (not isinstance(head, int) or isinstance(head, bool) or not 2 <= head <= 65536 or head % 2):
        out.append(f"{where}: head_dim = {head!r}: expected an even whole number from 2 to 65536")
    for key in ("rope_scaling", "rope_parameters"):
        rope = doc.get(key)
        kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else None
        if rope is not None and kind != "default":
            out.append(f"{where}: {key} = {rope!r}; {name} implements rope_type 'default' only")
    return out


BLOCK_HF_KEYS = (("hidden_size", "dim"), ("num_hidden_layers", "n_layers"), ("num_attention_heads", "n_heads"),
                 ("num_key_value_heads", "n_kv_heads"), ("intermediate_size", "ffn_dim"),
                 ("vocab_size", "vocab_size"), ("max_position_embeddings", "context_len"),
                 ("rms_norm_eps", "norm_eps"), ("rope_theta", "rope_theta"),
                 ("tie_word_embeddings", "tie_embeddings"), ("head_dim", "head_dim"))


def block_spec_fields(doc: dict[str, tp.Any], defaults: dict[str, tp.Any]) -> dict[str, tp.Any]:
    """The ``[model]`` fields of a checked Qwen2 / Mistral config.json: each ``BLOCK_HF_KEYS`` key it
    sets, ``rope_theta`` from ``rope_parameters`` too, and ``defaults`` (what the transformers class
    assumes for a key the file lacks). A ``head_dim`` equal to dim / n_heads is no field (0: the same)."""
    fields = {ours: doc[key] for key, ours in BLOCK_HF_KEYS if doc.get(key) is not None}
    rope = rope_doc(doc)
    fields["rope_theta"] = float(rope.get("rope_theta", fields.get("rope_theta", defaults["rope_theta"])))
    fields.setdefault("n_kv_heads", fields["n_heads"])
    fields.setdefault("norm_eps", defaults["norm_eps"])
    fields.setdefault("tie_embeddings", defaults["tie_embeddings"])
    if fields.get("head_dim") == fields["dim"] // fields["n_heads"] and not fields["dim"] % fields["n_heads"]:
        fields["head_dim"] = 0
    fields.setdefault("head_dim", 0)
    return fields


def hf_block_config(s: LlamaShape, arch: str, model_type: str) -> dict[str, tp.Any]:
    """The ``config.json`` keys every Llama-block class reads, for this shape (fp32 weights)."""
    return {"architectures": [arch], "model_type": model_type, "hidden_size": s.d_model,
            "intermediate_size": s.ffn_dim, "num_hidden_layers": s.n_layers, "num_attention_heads": s.n_heads,
            "num_key_value_heads": s.n_kv_heads, "head_dim": s.head_dim, "vocab_size": s.vocab_size,
            "max_position_embeddings": s.context, "rms_norm_eps": s.norm_eps, "rope_theta": s.rope_theta,
            "tie_word_embeddings": s.tied, "hidden_act": "silu", "attention_dropout": 0.0, "torch_dtype": "float32"}


class BlockFamily:
    """What the families of the Llama block that add no shape rule of their own (Qwen2, Mistral) share as
    a ``hpc.core.models.Family``: facts, problems and preset counts from their ``presets`` and ``shape``,
    the block's activations, LoRA targets and Hugging Face tensor plan. A subclass names the rest (``name``,
    ``phrase``, ``fields``, ``builder``, its config.json mapping)."""

    name: str
    phrase: str
    presets: tp.Mapping[str, LlamaShape]
    counted_by_building = False  # the count follows from the shape
    activation_bytes = staticmethod(block_activation_bytes)
    hf_tensor_plan = staticmethod(hf_tensor_plan)
    lora_targets = BLOCK_LORA_TARGETS
    tp_plan = BLOCK_TP_PLAN

    def shape(self, model: Model) -> LlamaShape:
        """The preset with the spec's shape fields in its place (``block_shape``)."""
        return block_shape(model, self.presets[model.size])

    def facts(self, model: Model, counted: tp.Any = None) -> ModelFacts:
        """What the planner and the trainer know about the spec (``counted`` does not apply)."""
        s = self.shape(model)
        return block_facts(self.name, block_label(self.name, model, s), s)

    def problems(self, model: Model) -> list[str]:
        """What is wrong with the ``[model]`` section (a known preset, shapes that divide)."""
        return block_problems(self.phrase, model, self.presets)

    def code_notice(self, model: Model) -> str | None:
        """Built in: nothing of the user's is imported."""
        return None

    def preset_counts(self) -> str:
        """The presets with their parameter counts."""
        return preset_text(self.presets)


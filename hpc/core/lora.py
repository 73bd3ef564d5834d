"""Low-rank adaptation without torch: the spec's ``[lora]`` section, its checks, and what it trains.

``lora.rank`` > 0 fine-tunes by LoRA (Hu et al. 2021, as PEFT does it): every linear layer named by
``lora.targets`` gets two small matrices beside its frozen weight, ``A`` (rank × in) and ``B``
(out × rank), and computes ``W x + (alpha / rank) · B A dropout(x)``. ``A`` starts as PEFT's
(kaiming-uniform, ``a = sqrt(5)``), ``B`` as zeros, so step 0 computes exactly the base model. The
base weights are frozen: no gradients, no optimizer state, not written again by each checkpoint.

A family offers LoRA by declaring its projections (``LoraMapped.lora_targets``: hpcx's module name,
the Hugging Face one); ``targets`` takes either name (``wq`` or ``q_proj`` for the Llama), and a
target names every module of that name (the GPT's ``proj`` is both the attention's and the MLP's,
as PEFT's ``c_proj`` is). ``trainable`` names other parameters that train in full (norms, the
embedding), by ``fnmatch`` patterns over hpcx's parameter names (``*norm*``, ``tok_emb.weight``).

The frozen base is kept at ``base_dtype`` (``rest_dtype``, ``is_nf4``): `auto` is bf16 when the run computes in
bf16 (``parallel.mixed_precision``), else fp32; `bf16` needs bf16 compute; `nf4` stores every projection
the family declares (``lora_targets``, targeted or not; QLoRA's "all linear layers" of the blocks) in
4-bit NormalFloat with double-quantized scales (torchao's ``NF4Tensor``, Dettmers et al. 2023), the
rest of the frozen base (embeddings, head, norms) as `auto` would. Adapters and ``trainable``
parameters stay fp32 whatever the base is.

What the planner counts (``with_lora``): the adapters join the parameters, and only adapters and
``trainable`` parameters have gradients and optimizer state (``ModelFacts.trainable_params``); the
frozen base's bytes per parameter follow ``base_dtype`` (``base_bytes``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import typing as tp
from dataclasses import dataclass

from hpc.core.config import field

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.core.models import ModelFacts
    from hpc.core.spec import JobSpec

ADAPTERS = ("lora_A", "lora_B")  # the adapter modules' names under each target (PEFT's)
MAX_RANK = 65536
BASE_DTYPES = ("auto", "fp32", "bf16", "nf4")
NF4_BLOCK = 64  # torchao's to_nf4 defaults (QLoRA's): one int8 scale per 64 weights,
NF4_SCALER_BLOCK = 256  # and one scale of those scales (in the base's dtype) per 256 blocks
SHARDED = ("fsdp", "hsdp")  # strategies whose parameters are DTensor shards
# bytes per weight torchao 0.18's NF4 dequantization holds at once for the matmul it feeds (two int64
# index halves, the looked-up and scaled halves, their interleaving): 15.07 measured on CPU, a bf16 4096²
NF4_DEQUANT_BYTES = 15


def nf4_bytes(dtype_bytes: int) -> float:
    """Bytes per weight of torchao's NF4: 4 bits of data, an int8 block scale per ``NF4_BLOCK`` weights,
    a ``dtype_bytes`` factor per ``NF4_SCALER_BLOCK`` blocks (≈ 0.5157 from bf16)."""
    return 0.5 + 1 / NF4_BLOCK + dtype_bytes / (NF4_BLOCK * NF4_SCALER_BLOCK)


@dataclass
class Lora:
    rank: int = field(0, doc="LoRA rank r (0: off, every weight trains). Above 0 the base weights are frozen and "
                      "each target gets adapters A (r × in) and B (out × r).", minimum=0, maximum=MAX_RANK)
    alpha: float = field(16.0, doc="LoRA scale numerator: the adapters add (alpha / rank) · B A x.", minimum=0)
    dropout: float = field(0.0, doc="Dropout on the adapters' input (PEFT's `lora_dropout`).", minimum=0,
                           maximum=1)
    targets: list[str] = field(doc="The linear layers that get adapters, by the family's module names or Hugging "
                               "Face's (Llama: `wq` `wk` `wv` `wo` `w1` `w2` `w3`, or `q_proj` `k_proj` `v_proj` "
                               "`o_proj` `gate_proj` `down_proj` `up_proj`; GPT: `qkv` `proj` `fc`). Empty: the "
                               "attention's query and value projections.", factory=list)
    trainable: list[str] = field(doc="Other parameters trained in full beside the adapters (with gradients and "
                                 "optimizer state), as patterns over hpcx's parameter names: `*norm*`, "
                                 "`tok_emb.weight`.", factory=list)
    base_dtype: str = field("auto", doc="How the frozen base is stored: `auto` (bf16 when "
                            "`parallel.mixed_precision` is bf16, else fp32), `fp32`, `bf16` (needs bf16 mixed "
                            "precision), or `nf4` (QLoRA: the blocks' projections in torchao's 4-bit NormalFloat, "
                            "the rest as `auto`; strategies none and ddp, needs the `qlora` extra). The adapters "
                            "and `trainable` stay fp32.", choices=BASE_DTYPES)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


DEFAULT_TARGETS = ("q_proj", "v_proj", "c_attn")  # PEFT's defaults for Llama-like models and GPT-2


def family_targets(arch: str) -> tuple[tuple[str, str], ...]:
    """(hpcx module name, Hugging Face module name) of every projection ``arch``'s family offers; () when
    it offers none."""
    from hpc.core.models import family  # lazy: startup

    return tuple(getattr(family(arch), "lora_targets", ()))


def resolved_targets(lora: Lora, arch: str) -> list[str]:
    """``lora.targets`` as hpcx module names (a Hugging Face name mapped), in the family's order;
    empty targets: the query and value projections (PEFT's defaults)."""
    pairs = family_targets(arch)
    wanted = set(lora.targets) or {ours for ours, hf in pairs if hf in DEFAULT_TARGETS}
    return [ours for ours, hf in pairs if ours in wanted or hf in wanted]


def hf_targets(lora: Lora, arch: str) -> list[str]:
    """The targets by Hugging Face's names (PEFT's ``target_modules``)."""
    chosen = set(resolved_targets(lora, arch))
    return [hf for ours, hf in family_targets(arch) if ours in chosen]


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's (``….lora_A.weight``, ``….lora_B.weight``)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in ADAPTERS


def base_name(name: str) -> str:
    """The target weight an adapter belongs to: ``blocks.0.attn.wq.lora_A.weight`` → ``blocks.0.attn.wq.weight``."""
    parts = name.split(".")
    return ".".join(parts[:-2] + parts[-1:])


def trains_in_full(name: str, lora: Lora) -> bool:
    """Whether a base parameter is one of ``lora.trainable``."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in lora.trainable)


def rest_dtype(lora: Lora, mixed_precision: str) -> str:
    """The dtype of the frozen base outside the NF4 projections, for a run computing in
    ``mixed_precision`` (decided: bf16, fp16 or none): bf16 under bf16 compute unless `fp32` is asked."""
    if lora.base_dtype == "fp32":
        return "fp32"
    return "bf16" if lora.base_dtype == "bf16" or mixed_precision == "bf16" else "fp32"


def is_nf4(name: str, lora: Lora, arch: str) -> bool:
    """Whether a frozen base parameter is stored in NF4: a projection's weight under `nf4`."""
    parts = name.split(".")
    projections = {ours for ours, _ in family_targets(arch)}
    return (lora.base_dtype == "nf4" and len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in projections
            and not trains_in_full(name, lora))


def base_dtype_problems(lora: Lora, strategy: str, mixed_precision: str) -> list[str]:
    """``lora.base_dtype`` against the run's strategy and compute dtype (`auto` ones pass here; the
    trainer asks again with the decided ones)."""
    out = []
    if lora.base_dtype == "bf16" and mixed_precision in ("none", "fp16"):
        out.append(f"`lora.base_dtype` = 'bf16' with `parallel.mixed_precision` = {mixed_precision!r}: the "
                   "base's matmuls would mix bf16 weights with fp32/fp16 inputs; expected mixed_precision 'bf16' "
                   "(or base_dtype 'fp32' or 'nf4')")
    if lora.base_dtype == "nf4" and strategy in SHARDED + ("dp",):
        out.append(f"`lora.base_dtype` = 'nf4' with `parallel.strategy` = {strategy!r}: hpcx keeps an NF4 base "
                   "whole on each rank (strategies none and ddp; NF4 under FSDP2 sharding is not supported); "
                   "expected strategy 'none' or 'ddp', or base_dtype 'bf16'")
    return out


def lora_problems(spec: JobSpec) -> list[str]:
    """What is wrong with ``[lora]`` for the spec's model (checked at load, on the login node)."""
    lora = spec.lora
    if not lora.enabled:
        return []
    if lora.base_dtype != "auto":
        base = base_dtype_problems(lora, spec.parallel.strategy, spec.parallel.mixed_precision)
        if base:
            return base
    pairs = family_targets(spec.model.arch)
    if not pairs:
        from hpc.core.models import family  # lazy: startup

        return [f"`lora.rank` = {lora.rank}: {family(spec.model.arch).phrase} declares no projections for LoRA"]
    names = {n for pair in pairs for n in pair}
    errors = [f"`lora.targets`: {t!r} is not a projection of {spec.model.arch!r}; expected any of "
              f"{', '.join(ours for ours, _ in pairs)} (or {', '.join(hf for _, hf in pairs)})"
              for t in lora.targets if t not in names]
    ours = [next((o for o, h in pairs if t in (o, h)), t) for t in lora.targets]
    twice = sorted({t for t, o in zip(lora.targets, ours) if ours.count(o) > 1})
    if twice:  # `wq` and `q_proj` are one module: a second name adds nothing (and hides a typo meant elsewhere)
        errors.append(f"`lora.targets` = {lora.targets}: {', '.join(twice)} name the same module more than once: "
                      "expected each projection once (hpcx's name or Hugging Face's)")
    shapes = _base_shapes(spec.model)
    errors += [f"`lora.trainable`: {p!r} matches no parameter of the model (e.g. {next(iter(shapes), '?')})"
               for p in lora.trainable if shapes and not any(fnmatch.fnmatchcase(n, p) for n in shapes)]
    return errors + nf4_problems(lora, spec.model.arch, shapes)


def nf4_problems(lora: Lora, arch: str, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """One line for the first projection NF4 cannot hold: torchao quantizes whole blocks of scales, so
    each weight's count must be a multiple of ``NF4_BLOCK × NF4_SCALER_BLOCK``."""
    unit = NF4_BLOCK * NF4_SCALER_BLOCK
    bad = next(((n, s) for n, s in shapes.items() if is_nf4(n, lora, arch) and math.prod(s) % unit), None)
    if bad is None:
        return []
    return [f"`lora.base_dtype` = 'nf4': {bad[0]} has {math.prod(bad[1]):,} weights {bad[1]}, not a multiple of "
            f"{unit:,} (NF4 blocks of {NF4_BLOCK} weights, their scales in blocks of {NF4_SCALER_BLOCK}); expected a "
            "wider model, or base_dtype 'bf16'"]


def without_rank(doc: dict[str, tp.Any]) -> list[str]:
    """``[lora]`` keys written while ``lora.rank`` is 0 or absent: LoRA is off and they mean nothing (one
    line; a rank of the wrong type is its own problem)."""
    given: dict[str, tp.Any] = doc["lora"] if isinstance(doc.get("lora"), dict) else {}
    keys = [k for k in given if k != "rank"]
    rank = given.get("rank", 0)
    if not keys or type(rank) is not int or rank != 0:
        return []
    return [f"`lora.{keys[0]}` is set but `lora.rank` = 0: LoRA is off, so "
            f"{', '.join(f'`lora.{k}`' for k in keys)} would mean nothing: set `lora.rank` above 0 (or remove them)"]


def _base_shapes(model: tp.Any) -> dict[str, tuple[int, ...]]:
    """hpcx parameter name → shape of a family with a tensor plan (``HfMapped``); {} otherwise."""
    from hpc.core.models import HfMapped, family, model_facts  # lazy: startup

    fam, facts = family(model.arch), model_facts(model)
    if not isinstance(fam, HfMapped) or facts.shape is None:
        return {}
    return {t.source: (t.shape[::-1] if t.op == "transpose" else t.shape)
            for t in fam.hf_tensor_plan(facts.shape) if t.source}


def adapter_shapes(model: tp.Any, lora: Lora) -> dict[str, tuple[int, ...]]:
    """Every adapter parameter's name and shape, in the model's order (A: rank × in, B: out × rank)."""
    chosen = set(resolved_targets(lora, model.arch))
    out: dict[str, tuple[int, ...]] = {}
    for name, (d_out, d_in) in ((n, s) for n, s in _base_shapes(model).items() if len(s) == 2):
        parts = name.split(".")
        if parts[-1] == "weight" and len(parts) >= 2 and parts[-2] in chosen:
            stem = ".".join(parts[:-1])
            out[f"{stem}.lora_A.weight"] = (lora.rank, d_in)
            out[f"{stem}.lora_B.weight"] = (d_out, lora.rank)
    return out


def with_lora(facts: ModelFacts, spec: JobSpec) -> ModelFacts:
    """``facts`` of the model ``[lora]`` trains: the adapters added to the parameters, and the trainable
    part (adapters and ``lora.trainable``) named for gradients and optimizer state. ``facts`` itself
    when LoRA is off."""
    lora = spec.lora
    if not lora.enabled or facts.n_params is None:
        return facts
    adapters = adapter_shapes(spec.model, lora)
    extra = [s for n, s in _base_shapes(spec.model).items() if trains_in_full(n, lora)]
    added = sum(math.prod(s) for s in adapters.values())
    trainable = tuple(adapters.values()) + tuple(extra)
    quantized = [math.prod(s) for n, s in _base_shapes(spec.model).items() if is_nf4(n, lora, spec.model.arch)]
    return dataclasses.replace(facts, n_params=facts.n_params + added, param_shapes=facts.param_shapes + tuple(
        adapters.values()), trainable_params=sum(math.prod(s) for s in trainable), trainable_shapes=trainable,
        label=f"{facts.label}, LoRA r={lora.rank}" + ("" if lora.base_dtype == "auto" else f" {lora.base_dtype}"),
        base_dtype=lora.base_dtype, nf4_params=sum(quantized), nf4_largest=max(quantized, default=0))


def base_bytes(base_dtype: str, mixed_precision: str) -> tuple[int, float]:
    """(bytes per frozen parameter, bytes per NF4 one) of a LoRA base stored at ``base_dtype`` in a run
    computing in ``mixed_precision`` (what ``trainer.lora.keep_base`` allocates)."""
    rest = 2 if rest_dtype(Lora(base_dtype=base_dtype), mixed_precision) == "bf16" else 4
    return rest, nf4_bytes(rest)

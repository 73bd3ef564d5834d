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

What the planner counts (``with_lora``): the adapters join the parameters, and only adapters and
``trainable`` parameters have gradients and optimizer state (``ModelFacts.trainable_params``).
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
    from hpc.core.models import family

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


def lora_problems(spec: JobSpec) -> list[str]:
    """What is wrong with ``[lora]`` for the spec's model (checked at load, on the login node)."""
    lora = spec.lora
    if not lora.enabled:
        return []
    pairs = family_targets(spec.model.arch)
    if not pairs:
        from hpc.core.models import family

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
    return errors


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
    from hpc.core.models import HfMapped, family, model_facts

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
    return dataclasses.replace(facts, n_params=facts.n_params + added, param_shapes=facts.param_shapes + tuple(
        adapters.values()), trainable_params=sum(math.prod(s) for s in trainable), trainable_shapes=trainable,
        label=f"{facts.label}, LoRA r={lora.rank}")

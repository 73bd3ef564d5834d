"""What hpcx knows about a spec's model, without torch: ``model_facts(spec.model)``.

One description per model family answers every question the login side and the trainer ask
(parameter count, the largest FSDP unit, FLOPs per token, context length, vocabulary, activation
bytes, a label for people), so no other module branches on ``model.arch``. A family is one module
here and one in ``trainer/models/``, and a line in ``FAMILIES``; each module here gives:

- ``facts(model, counted)`` -> ``ModelFacts`` (``family`` set to its name, ``shape`` to its own shape);
- ``problems(model)``: what is wrong with the spec's ``[model]`` for this family;
- ``activation_bytes(facts, micro_batch, checkpointing, mixed_precision, dropout, autocast)``;
- ``code_notice(model)``: what running it imports (user code), or None;
- ``COUNTED_BY_BUILDING``: whether a login node learns its size only by building it (``--count-params``).

Families: ``gpt`` (the built-in GPT, ``arch = "gpt"``) and ``user`` (``arch = "pkg.mod:function"``,
every arch no other family names).
"""

from __future__ import annotations

import importlib
import typing as tp
from dataclasses import dataclass
from types import ModuleType

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.core.spec import Model




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
    shape: tp.Any = None  # the family's own shape (``gpt.GPTShape``); None for user models
    activation_gb_per_sample: float = 0.0  # measured, for user models (0: unknown)
    matmul_params: int | None = None  # weights autocast copies to bf16/fp16 (None: assume all)
    source: str = ""  # where the parameter count comes from
    param_shapes: tuple[tuple[int, ...], ...] = ()  # every parameter's shape; empty when unknown
    largest_module_params: int | None = None  # the most parameters one module owns (init granularity)
    family: str = "user"  # the module of ``FAMILIES`` that describes it

    @property
    def builtin(self) -> bool:
        """A family hpcx ships (its counts follow from its shape), not a user's ``pkg.mod:function``."""
        return self.family != USER


@dataclass(frozen=True)
class Counted:
    """A user model's parameters, counted by building it (``trainer.count``, on the meta device)."""

    n_params: int
    unit_params: int  # the largest block under ``model.blocks``
    n_units: int
    embedding_params: int  # nn.Embedding weights that no linear layer shares


# arch -> the module describing that family; any other arch is a user model (``pkg.mod:function``)
FAMILIES = {"gpt": "hpc.core.models.gpt"}
USER = "user"


def family(arch: str) -> ModuleType:
    """The module of the family ``arch`` belongs to (``FAMILIES``, else ``hpc.core.models.user``)."""
    return importlib.import_module(FAMILIES.get(arch, f"hpc.core.models.{USER}"))


def family_of(facts: ModelFacts) -> ModuleType:
    """The family module that described ``facts``."""
    return importlib.import_module(f"hpc.core.models.{facts.family}")


def model_facts(model: Model, counted: Counted | None = None) -> ModelFacts:
    """The description of ``spec.model`` (a checked spec: a known preset, or a user model with
    ``seq_len`` and ``vocab_size`` set). ``counted`` replaces a user model's stated numbers."""
    return family(model.arch).facts(model, counted)


def model_problems(model: Model) -> list[str]:
    """What is wrong with ``spec.model`` for its family (checked at load, on the login node)."""
    return family(model.arch).problems(model)


def activation_bytes(facts: ModelFacts, micro_batch: int, checkpointing: bool, mixed_precision: str,
                     dropout: float = 0.0, autocast: bool = False) -> float | None:
    """Activation memory of one micro-batch at its peak, by the model's family; None when unknown."""
    return family_of(facts).activation_bytes(facts, micro_batch, checkpointing, mixed_precision, dropout, autocast)


def code_notice(model: Model) -> str | None:
    """What running the model imports, for people (a user model's module), or None."""
    return family(model.arch).code_notice(model)


def counted_by_building(model: Model) -> bool:
    """Whether only a build (``trainer.count``, torch) tells this model's size (``--count-params``)."""
    return family(model.arch).COUNTED_BY_BUILDING


def compute_bytes(mixed_precision: str) -> int:
    """Bytes per element of compute tensors: 2 under bf16/fp16, 4 in fp32."""
    return 4 if mixed_precision == "none" else 2


def residual_bytes(mixed_precision: str, autocast: bool) -> int:
    """Bytes per element of the residual stream and the LayerNorm inputs. Under autocast (ddp, none)
    the embeddings and the residual adds stay fp32 and LayerNorm runs in fp32; only the matmuls
    and attention run in bf16/fp16. FSDP2's ``param_dtype`` makes every weight, so every tensor,
    bf16/fp16."""
    return 4 if autocast else compute_bytes(mixed_precision)

"""What hpcx knows about a spec's model, without torch: ``model_facts(spec.model)``.

One description per model family answers every question the login side and the trainer ask
(parameter count, the largest FSDP unit, FLOPs per token, context length, vocabulary, activation
bytes, a label for people), so no other module branches on ``model.arch``. A family is one object,
``FAMILY`` in its module ``hpc/core/models/<family>.py``, that implements ``Family`` (checked over the
registry by tests/test_models_family.py); the registry is ``FAMILIES`` (arch → module). It names its
own ``[model]`` fields (``fields``, a dataclass joined into the spec's section by ``section_class``, as
each scheduler kind's fields are joined into a site's ``[scheduler]``) and its torch half
(``builder``, a module of ``trainer/models/`` that ``trainer.models.family`` imports in the job).
A family that maps onto a ``transformers`` class also implements ``HfMapped`` (export,
``checkpoint.init_from``) and, when hpcx reads that class's ``config.json``, ``HfReader``
(``hpc.core.hf``). A family that runs under ``parallel.tp`` declares its tensor-parallel plan as data
(``TpPlanned``: ``tp_plan``, a ``hpc.core.models.tp_plan.TpPlan``), read by the planner and the trainer.

Families: ``gpt`` (the built-in GPT, ``arch = "gpt"``), ``llama``, ``qwen2`` and ``mistral`` (the
built-in Llama, Qwen2 and Mistral, one block with different settings) and ``user`` (``arch =
"pkg.mod:function"``, every arch no other family names); docs/models.md lists them. What the built-in
decoders share (activation bookkeeping, the Llama block and its fields) is ``hpc.core.models.decoder``.
"""

from __future__ import annotations

import dataclasses
import importlib
import typing as tp
from dataclasses import dataclass

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.core.spec import Model

# arch -> the module whose ``FAMILY`` describes it; any other arch is a user model (``pkg.mod:function``)
FAMILIES = {
    "gpt": "hpc.core.models.gpt",
    "llama": "hpc.core.models.llama",
    "qwen2": "hpc.core.models.qwen2",
    "mistral": "hpc.core.models.mistral",
}
USER = "user"
USER_MODULE = "hpc.core.models.user"
TASK = "task-model"  # the arch a spec with ``[task]`` records: the task's own model (``hpc.core.tasks``)
TASK_MODULE = "hpc.core.models.task"
DEFAULT_ARCH = next(iter(FAMILIES))  # ``model.arch`` when a spec names none


@tp.runtime_checkable
class Family(tp.Protocol):
    """What every model family gives, torch-free (torchtitan's ``ModelSpec``, login side): its spec
    fields, its facts and checks, and where its torch half is."""

    name: str  # ``ModelFacts.family``; the arch of a built-in family
    phrase: str  # for messages: "arch = 'llama'", "user models"
    fields: type  # a dataclass of the ``[model]`` fields only this family reads (it may have none)
    builder: str  # its torch half: a module with ``build(spec.model)`` (``trainer.models.Builder``)
    counted_by_building: bool  # a login node learns its size only by building it (``--count-params``)

    def facts(self, model: Model, counted: Counted | None = None) -> ModelFacts:
        """What the planner and the trainer know about ``model`` (a checked ``[model]``)."""

    def problems(self, model: Model) -> list[str]:
        """What is wrong with the spec's ``[model]`` for this family (its own fields, shapes, presets)."""

    def activation_bytes(self, facts: ModelFacts, micro_batch: int, checkpointing: bool, mixed_precision: str,
                         dropout: float = 0.0, autocast: bool = False) -> float | None:
        """Activation memory of one micro-batch at its peak; None when unknown."""

    def code_notice(self, model: Model) -> str | None:
        """What running the model imports (user code), for people, or None."""

    def preset_counts(self) -> str:
        """Its presets of ``model.size`` with their parameter counts, for people ("" when it has none)."""


@tp.runtime_checkable
class HfMapped(tp.Protocol):
    """A family with a ``transformers`` class (torchtitan's state-dict adapter): the export and
    ``checkpoint.init_from`` (``hpc.core.hf``)."""

    def hf_config(self, shape: tp.Any) -> dict[str, tp.Any]:
        """The ``config.json`` of the ``transformers`` model that computes what ``shape``'s model computes."""

    def hf_tensor_plan(self, shape: tp.Any) -> list[tp.Any]:
        """Every Hugging Face tensor (``hpc.core.hf.HfTensor``), in hpcx's parameter order."""


@tp.runtime_checkable
class LoraMapped(HfMapped, tp.Protocol):
    """A family whose projections take LoRA adapters (``hpc.core.lora``): the export to PEFT names them."""

    lora_targets: tuple[tuple[str, str], ...]  # (hpcx module name, Hugging Face module name) of each projection


@tp.runtime_checkable
class HfReader(HfMapped, tp.Protocol):
    """A family whose class's ``config.json`` a spec may name (``model.hf_config``)."""

    hf_arch: str  # the class in ``architectures`` ("LlamaForCausalLM")
    hf_model_type: str  # its ``model_type``, for a config that names no class
    hf_keys: tuple[tuple[str, str], ...]  # config.json key → [model] field

    def hf_spec_fields(self, path: tp.Any, doc: dict[str, tp.Any]) -> dict[str, tp.Any]:
        """The ``[model]`` fields the ``config.json`` ``doc`` (read from ``path``) sets."""


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
    family: str = USER  # the ``Family.name`` of the family that describes it
    # tensor parallelism, derived from the family's declared plan (``tp_plan.tp_facts``), one entry per
    # ``param_shapes`` entry: the dimension TP splits (0 column-wise, 1 row-wise) or -1 (replicated over tp:
    # norms); empty: no plan the planner counts
    tp_split: tuple[int, ...] = ()
    tp_divides: tuple[int, ...] = ()  # what a tp degree must divide (attention heads, kv heads)
    trainable_params: int | None = None  # what has gradients and optimizer state (None: every parameter; LoRA)
    trainable_shapes: tuple[tuple[int, ...], ...] = ()  # their shapes (``hpc.core.lora.with_lora``)
    base_dtype: str = "fp32"  # how the frozen parameters are stored: LoRA's ``lora.base_dtype`` (auto: by compute)
    nf4_params: int = 0  # of the frozen ones, those stored in NF4 (``lora.base_dtype = "nf4"``)
    nf4_largest: int = 0  # the largest of them: torchao dequantizes one whole per matmul (``NF4_DEQUANT_BYTES``)
    # of ``root_params``, those FSDP keeps gathered from forward through backward (final norm + head, the
    # unit backward needs first; all of them when a tied head keeps them in the root unit); the embedding
    # unit is resharded after forward and gathered again in backward. None: all of ``root_params``
    kept_params: int | None = None

    @property
    def builtin(self) -> bool:
        """A family hpcx ships (its counts follow from its shape), not a user's ``pkg.mod:function`` or task."""
        return self.family not in (USER, TASK)


@dataclass(frozen=True)
class Counted:
    """A user model's parameters, counted by building it (``trainer.count``, on the meta device)."""

    n_params: int
    unit_params: int  # the largest block under ``model.blocks``
    n_units: int
    embedding_params: int  # nn.Embedding weights that no linear layer shares
    # forward FLOPs of one sample (2 per multiply-add): a task's declared ``task.flops_per_sample``, or counted on the
    # meta device (``trainer.count.forward_flops``); None: unknown (the planner then takes 6 per parameter per position)
    flops_per_sample: float | None = None
    flops_source: str = ""
    units_params: int | None = None  # all blocks together (they may differ in size: a ResNet's stages); None: unknown


def _load(module: str) -> Family:
    return importlib.import_module(module).FAMILY


def family(arch: str) -> Family:
    """The family ``arch`` belongs to (``FAMILIES``, a task's, else the user family)."""
    return _load(FAMILIES.get(arch, TASK_MODULE if arch == TASK else USER_MODULE))


def family_of(facts: ModelFacts) -> Family:
    """The family that described ``facts`` (by ``ModelFacts.family``)."""
    return _load(FAMILIES.get(facts.family, TASK_MODULE if facts.family == TASK else USER_MODULE))


def families() -> list[Family]:
    """Every family: the registry's, then the user family (a task's model, ``TASK``, has no fields to join)."""
    return [_load(module) for module in (*FAMILIES.values(), USER_MODULE)]


def section_class(common: type) -> type:
    """The spec's ``[model]`` section: a dataclass with ``common``'s fields (every family's), then each
    family's own ``fields`` in ``families()`` order. ``FAMILY_FIELDS`` on it says which family reads
    which field (for the reference docs). Families may share a field by sharing its declaration (their
    ``fields`` subclass one dataclass, as the Llama-block families' ``decoder.BlockFields``); two
    declaring one name apart is a programming error."""
    owners: dict[str, tuple[str, tp.Any]] = {f.name: ("", f) for f in dataclasses.fields(common)}
    family_fields: dict[str, tuple[str, ...]] = {}
    for fam in families():
        declared = dataclasses.fields(fam.fields)
        clash = [f.name for f in declared if f.name in owners and owners[f.name][1] is not f]
        if clash:
            raise TypeError(f"the {fam.name} family declares {clash}, already declared by "
                            f"{owners[clash[0]][0] or common.__qualname__}")
        owners.update({f.name: owners.get(f.name, (fam.name, f)) for f in declared})
        family_fields[fam.name] = tuple(f.name for f in declared)
    # a dataclass collects fields from its bases last to first: common's come first
    bases = tuple(fam.fields for fam in reversed(families())) + (common,)
    cls = dataclasses.make_dataclass(common.__name__.removeprefix("Common"), [], bases=bases)
    cls.__module__, cls.__doc__ = common.__module__, common.__doc__
    cls.FAMILY_FIELDS = family_fields  # type: ignore[attr-defined]
    return cls


def _default(f: dataclasses.Field) -> tp.Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[operator]


def model_facts(model: Model, counted: Counted | None = None) -> ModelFacts:
    """The description of ``spec.model`` (a checked spec: a known preset, or a user model with
    ``seq_len`` and ``vocab_size`` set). ``counted`` replaces a user model's stated numbers."""
    return family(model.arch).facts(model, counted)


def model_problems(model: Model) -> list[str]:
    """What is wrong with ``spec.model`` for its family (checked at load, on the login node); then
    another family's own fields set on it."""
    return family(model.arch).problems(model) or foreign_field_problems(model)


def foreign_field_problems(model: Model) -> list[str]:
    """The fields other families declare (``Family.fields``) and ``model``'s does not, set away from their
    defaults on ``model``: one line each, naming every family that reads it."""
    own = {f.name for f in dataclasses.fields(family(model.arch).fields)}
    readers: dict[str, list[str]] = {}
    for other in families():
        for f in dataclasses.fields(other.fields):
            if f.name not in own and getattr(model, f.name) != _default(f):
                readers.setdefault(f.name, []).append(other.phrase)
    return [f"`model.{name}` = {getattr(model, name)!r} is for {_either(phrases)}, not {model.arch!r}"
            for name, phrases in readers.items()]


def _either(phrases: list[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return phrases[0] if len(phrases) == 1 else f"{', '.join(phrases[:-1])} or {phrases[-1]}"


def activation_bytes(facts: ModelFacts, micro_batch: int, checkpointing: bool, mixed_precision: str,
                     dropout: float = 0.0, autocast: bool = False, tp: int = 1) -> float | None:
    """Activation memory of one micro-batch at its peak on one rank, by the model's family; None when
    unknown. ``tp`` > 1 (tensor and sequence parallelism) only for a family with a TP plan (``tp_split``)."""
    fam = family_of(facts)
    if tp > 1 and facts.tp_split:  # without a counted split (the GPT's): the unsplit figure, an upper bound
        return fam.activation_bytes(facts, micro_batch, checkpointing, mixed_precision, dropout, autocast,
                                    tp=tp)  # type: ignore[call-arg]
    return fam.activation_bytes(facts, micro_batch, checkpointing, mixed_precision, dropout, autocast)


def code_notice(model: Model) -> str | None:
    """What running the model imports, for people (a user model's module), or None."""
    return family(model.arch).code_notice(model)


def counted_by_building(model: Model) -> bool:
    """Whether only a build (``trainer.count``, torch) tells this model's size (``--count-params``)."""
    return family(model.arch).counted_by_building


def compute_bytes(mixed_precision: str) -> int:
    """Bytes per element of compute tensors: 2 under bf16/fp16, 4 in fp32."""
    return 4 if mixed_precision == "none" else 2


def residual_bytes(mixed_precision: str, autocast: bool) -> int:
    """Bytes per element of the residual stream and the LayerNorm inputs. Under autocast (ddp, none)
    the embeddings and the residual adds stay fp32 and LayerNorm runs in fp32; only the matmuls
    and attention run in bf16/fp16. FSDP2's ``param_dtype`` makes every weight, so every tensor,
    bf16/fp16."""
    return 4 if autocast else compute_bytes(mixed_precision)

"""User models (``arch = "pkg.mod:function"``), torch-free: what the spec states about them.

``seq_len`` and ``vocab_size`` are required; ``n_params`` with ``n_layers`` and ``dim`` make one
plannable; without them the parameter count is unknown to a login node (``hpcx plan --count-params``
builds it on the meta device, ``trainer.count``). The trainer side is ``trainer.models.user``.
"""

from __future__ import annotations

import math
import os
import re
import sys
import typing as tp
from dataclasses import dataclass
from importlib.machinery import PathFinder

from hpc.core.config import field
from hpc.core.models import FAMILIES, USER, Counted, ModelFacts, count_text
from hpc.core.validate import check_model_arch

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.core.spec import Model

GB = 1e9
USER_ARCH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")  # package.module:function


@dataclass
class Fields:
    """The ``[model]`` fields only a user model reads; joined into the spec's section by
    ``hpc.core.models.section_class``."""

    n_params: int = field(0, doc="A user model's parameter count, for the planner (0: unknown; then "
                          "`hpcx plan --count-params` can count it where torch is installed). Needs "
                          "`n_layers` and `dim`.", minimum=0, maximum=10**15)
    blocks: str = field("", doc="For user models: attribute path of the nn.ModuleList whose children "
                        "are the units to shard and checkpoint, e.g. `transformer.h` (names and indices "
                        "joined by `.`; default: `blocks`).")
    kwargs: dict[str, tp.Any] = field(doc="Keyword arguments for a `module:function` model (each key a Python "
                                      "identifier): strings, finite "
                                      "numbers, booleans, arrays, tables; no credential-looking keys or values "
                                      "(they are written to resolved.json).", factory=dict)
    activation_gb: float = field(0.0, doc="Measured activation memory per micro-batch sample in GB, for "
                                 "the planner on user models (0: unknown).", minimum=0)


def facts(model: Model, counted: Counted | None = None) -> ModelFacts:
    """The user model's counted numbers, else the stated ones, else unknown."""
    if counted is not None:
        return _counted_facts(model, counted)
    if model.n_params:
        return _stated_facts(model)
    return ModelFacts(label=f"{model.arch} (parameters unknown)", n_params=None, unit_params=None,
                      root_params=None, n_units=0, flops_per_token=None, seq_len=model.seq_len,
                      vocab_size=model.vocab_size, activation_gb_per_sample=model.activation_gb, source="unknown")


def problems(model: Model) -> list[str]:
    """A ``package.module:function`` arch of the user's (``check_model_arch``), the context and vocabulary
    set, a stated count that fits."""
    if not USER_ARCH.match(model.arch) or check_model_arch(model.arch):
        built_in = ", ".join(repr(arch) for arch in FAMILIES)
        return check_model_arch(model.arch) or [f"`model.arch` = {model.arch!r}: expected {built_in} or "
                                                "'package.module:function'"]
    errors = [f"`model.{key}` must be set for the user model {model.arch!r} (0 means the preset's, and a user "
              f"model has none)" for key in ("seq_len", "vocab_size") if not getattr(model, key)]
    return errors + _stated_problems(model)


def code_notice(model: Model) -> str | None:
    """What a `module:function` model means: that code is imported and called in every task."""
    module, function = model.arch.split(":", 1)
    kwargs = ", ".join(model.kwargs) or "no kwargs"
    found = module_file(module)
    where = f"from {found}" if found else "which is not importable here: every task must find it on its sys.path"
    return (f"user code: every task will import the Python module {module!r} ({where}) and call "
            f"{function}({kwargs}) (model.arch); it runs with your permissions, so check it is the code you mean")


def module_file(module: str, folder: str | None = None) -> str | None:
    """The file ``import module`` would load, found without importing anything (no package's
    ``__init__`` runs): searched on ``sys.path``, then from ``folder`` (default: the current one, where
    each task starts; it comes after hpcx's own paths, ``hpc.core.imports.submit_folder_last``). None
    when it is not found."""
    search: list[str] | None = [*sys.path, folder or os.getcwd()]
    spec = None
    parts = module.split(".")
    for n in range(1, len(parts) + 1):
        spec = PathFinder.find_spec(".".join(parts[:n]), search)
        if spec is None:
            return None
        search = list(spec.submodule_search_locations or [])
        if not search and n < len(parts):
            return None  # a module, not a package: it has no submodules
    assert spec is not None  # a name has one part at least, so the loop ran
    if spec.origin and spec.origin not in ("namespace", "built-in", "frozen"):
        return spec.origin
    return next(iter(spec.submodule_search_locations or []), None)


def activation_bytes(facts: ModelFacts, micro_batch: int, checkpointing: bool, mixed_precision: str,
                     dropout: float = 0.0, autocast: bool = False) -> float | None:
    """The measured figure the spec states (``model.activation_gb``), else None."""
    if facts.activation_gb_per_sample:
        return facts.activation_gb_per_sample * GB * micro_batch
    return None


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


def preset_counts() -> str:
    """A user model has no presets."""
    return ""


class User:
    """User models (``arch = "pkg.mod:function"``) as a ``hpc.core.models.Family``."""

    name = USER
    phrase = "user models"
    fields = Fields
    builder = "trainer.models.user"
    counted_by_building = True  # its size is known only by building it (or stated in the spec)
    facts = staticmethod(facts)
    problems = staticmethod(problems)
    activation_bytes = staticmethod(activation_bytes)
    code_notice = staticmethod(code_notice)
    preset_counts = staticmethod(preset_counts)


FAMILY = User()

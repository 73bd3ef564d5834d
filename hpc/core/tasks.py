"""The ``[task]`` section, torch-free: a user's ``package.module:Class`` that brings its own model, data
and loss (the protocol is ``trainer.tasks.Task``), and what the spec loader checks of it.

A spec with ``task.target`` set hands ``[model]`` to the task: the section must be left alone, and the
loader records ``model.arch = "task-model"`` (``hpc.core.models.TASK``, with ``model.seq_len`` the task's
``tokens_per_sample``), the family whose facts are counted
by building the task's model on the meta device (``hpc.core.models.task``; ``hpcx plan`` counts it,
``trainer.count.count_task``). ``[data]`` is the task's too (its datasets), and ``checkpoint.init_from``
reads Hugging Face or hpcx checkpoints of the built-in families only: a task loads its own weights.
Everything else (strategy, precision, AC, compile, batch, optimizer, schedule, checkpoints,
preemption, requeue) is the spec's as for any run.
"""

from __future__ import annotations

import keyword
import re
import typing as tp
from dataclasses import dataclass

from hpc.core import validate as v
from hpc.core.config import field

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.core.spec import JobSpec

TASK_TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")  # package.module:Class


@dataclass
class Task:
    """The spec's ``[task]`` section (``docs/tasks.md``)."""

    target: str = field("", doc="A task of your own, `package.module:Class` (dotted Python identifiers, not a "
                        "module of the standard library): imported in every rank (from `sys.path`, then the folder "
                        "the job was submitted from) and called with `task.kwargs`; it gives the model, its "
                        "units, the datasets, the loss and its metrics (the protocol: docs/tasks.md). Empty: "
                        "the built-in language-model task of `[model]` and `[data]`.", max_len=v.NAME_MAX)
    kwargs: dict[str, tp.Any] = field(doc="Keyword arguments of the task's class (each key a Python identifier): "
                                      "strings, finite numbers, booleans, arrays, tables; no credential-looking "
                                      "keys or values (they are written to resolved.json).", factory=dict)
    tokens_per_sample: int = field(1, doc="Positions one sample holds (a sequence's tokens; 1 for an image): the "
                                   "planner's FLOPs are 6 × parameters × these per sample, and `tokens_per_s` counts "
                                   "them.", minimum=1, maximum=1 << 24)
    sync_batchnorm: bool = field(False, doc="Convert every BatchNorm of the task's model to torch's "
                                 "`SyncBatchNorm` (batch statistics over all ranks' samples, so every rank's running "
                                 "statistics stay equal): under ddp, fsdp and hsdp, on GPUs and on CPU (gloo; hpcx's "
                                 "own forward there, torch's needs a GPU). Refused under `none` and `dp` and for a "
                                 "model without BatchNorm.")


def task_problems(spec: JobSpec, doc: dict[str, tp.Any]) -> list[str]:
    """What is wrong with ``[task]`` and the sections a task owns, as written in ``doc``."""
    from hpc.core.models import TASK

    task = spec.task
    model_doc: dict[str, tp.Any] = doc["model"] if isinstance(doc.get("model"), dict) else {}
    if not task.target:
        return ([f"`model.arch` = {TASK!r} is set by `[task]`: set `task.target` = 'package.module:Class'"]
                if model_doc.get("arch") == TASK else []) + (
            ["`task.sync_batchnorm` = true, but there is no task: the built-in language models have no BatchNorm "
             "(set `task.target`, or remove it)"] if task.sync_batchnorm else [])
    errors = target_problems(task.target) + kwargs_problems(task.kwargs)
    errors += [f"`model.{name}` = {value!r} is set, but `[model]` is the task's ({task.target!r} builds the "
               "model): remove it" for name, value in changed_model_fields(spec, model_doc)]
    data_doc: dict[str, tp.Any] = doc["data"] if isinstance(doc.get("data"), dict) else {}
    errors += [f"`data.{key}` = {data_doc[key]!r} is for the built-in language models: the task "
               f"{task.target!r} gives its own datasets" for key in ("source", "val_source")
               if data_doc.get(key) not in (None, "synthetic", "", "none")]
    if spec.checkpoint.init_from:
        errors.append(f"`checkpoint.init_from` is for the built-in families: the task {task.target!r} loads "
                      "pretrained weights in its `build_model` (or `load_state_dict`)")
    return errors


SYNC_BATCHNORM_STRATEGIES = ("ddp", "fsdp", "hsdp")


def sync_batchnorm_problems(spec: JobSpec, strategy: str) -> list[str]:
    """``task.sync_batchnorm`` under a strategy that has no process group to synchronize over."""
    if not spec.task.sync_batchnorm or strategy in SYNC_BATCHNORM_STRATEGIES:
        return []
    chosen = "" if spec.parallel.strategy == strategy else " (the planner's choice for `auto`)"
    return [f"`task.sync_batchnorm` = true needs strategy ddp, fsdp or hsdp, but the strategy is {strategy!r}{chosen}: "
            "it synchronizes across processes, and that strategy runs one"]


def changed_model_fields(spec: JobSpec, model_doc: dict[str, tp.Any]) -> list[tuple[str, tp.Any]]:
    """(name, value) of each ``[model]`` field a task's spec sets: ``arch`` other than the task family's
    (as a run's resolved.json records it), any other field away from its default."""
    import dataclasses

    from hpc.core.models import TASK

    out = [("arch", model_doc["arch"])] if model_doc.get("arch", TASK) != TASK else []
    recorded = {"arch": None, "seq_len": spec.task.tokens_per_sample}  # what ``apply_task`` sets
    for f in dataclasses.fields(spec.model):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[operator]
        value = getattr(spec.model, f.name)
        if f.name != "arch" and value != default and value != recorded.get(f.name):
            out.append((f.name, getattr(spec.model, f.name)))
    return out


def target_problems(target: str) -> list[str]:
    """``package.module:Class`` of the user's: dotted identifiers, one `:`, not the standard library."""
    label = f"`task.target` = {v.shown(target)!r}"
    if not TASK_TARGET.match(target) or any(keyword.iskeyword(part) for part in re.split(r"[.:]", target)):
        return [f"{label}: expected 'package.module:Class' (dotted Python identifiers, one `:` before the class)"]
    top = target.split(".")[0].split(":")[0]
    if top in v.NOT_MODEL_MODULES:
        return [f"{label}: `{top}` is Python's own, not a task: expected a class of your own package"]
    return []


def kwargs_problems(kwargs: tp.Mapping[str, tp.Any]) -> list[str]:
    """Keys of ``task.kwargs`` are keyword arguments: identifiers, not keywords (``check_model_kwargs``)."""
    return [m.replace("`model.kwargs`", "`task.kwargs`").replace("model function", "task's class")
            for m in v.check_model_kwargs(kwargs)]


def apply_task(spec: JobSpec) -> None:
    """A spec with a task: ``model.arch`` becomes the task family's (its facts are the counted model's) and
    ``model.seq_len`` the task's ``tokens_per_sample`` (the planner's FLOPs and the trainer's tokens/s)."""
    from hpc.core.models import TASK

    if spec.task.target:
        spec.model.arch, spec.model.seq_len = TASK, spec.task.tokens_per_sample


def code_notice(spec: JobSpec) -> str | None:
    """What a task means: its code is imported and called in every task (as a user model's)."""
    if not spec.task.target:
        return None
    from hpc.core.models.user import module_file

    module, cls = spec.task.target.split(":", 1)
    found = module_file(module)
    where = f"from {found}" if found else "which is not importable here: every task must find it on its sys.path"
    return (f"user code: every task will import the Python module {module!r} ({where}) and call "
            f"{cls}({', '.join(spec.task.kwargs) or 'no kwargs'}) (task.target); it runs with your permissions, "
            "so check it is the code you mean")


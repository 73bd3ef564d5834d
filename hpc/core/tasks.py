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

import ast
import dataclasses
import keyword
import re
import typing as tp
from dataclasses import dataclass

from hpc.core import validate as v
from hpc.core.config import field
from hpc.core.errors import ConfigError
from hpc.core.models import TASK
from hpc.core.workload import TaskWorkload

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.core.spec import JobSpec

TASK_TARGET = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")  # package.module:Class (no `..`)


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
    flops_per_sample: float = field(0.0, doc="Forward FLOPs of one sample (2 per multiply-add; a ResNet-50 at "
                                    "224²: 8.2e9), for the planner's compute time (training: 3 × this). 0: counted "
                                    "by `hpcx plan` on the meta device from a forward pass on the task's first sample "
                                    "(torch's FlopCounterMode).", minimum=0, maximum=1e18)  # 405B × 128k tokens: 1e17
    sync_batchnorm: bool = field(False, doc="Convert every BatchNorm of the task's model to torch's "
                                 "`SyncBatchNorm` (batch statistics over all ranks' samples, so every rank's running "
                                 "statistics stay equal): under ddp, fsdp and hsdp, on GPUs and on CPU (gloo; hpcx's "
                                 "own forward there, torch's needs a GPU). Refused under `none` and `dp` and for a "
                                 "model without BatchNorm.")


def task_problems(spec: JobSpec, doc: dict[str, tp.Any]) -> list[str]:
    """What is wrong with ``[task]`` and the sections a task owns, as written in ``doc``."""
    task = spec.task
    model_doc: dict[str, tp.Any] = doc["model"] if isinstance(doc.get("model"), dict) else {}
    if not task.target:
        return ([f"`model.arch` = {TASK!r} is set by `[task]`: set `task.target` = 'package.module:Class'"]
                if model_doc.get("arch") == TASK else []) + (
            ["`task.sync_batchnorm` = true, but there is no task: the built-in language models have no BatchNorm "
             "(set `task.target`, or remove it)"] if task.sync_batchnorm else [])
    errors = target_problems(task.target) + kwargs_problems(task.kwargs)
    if spec.lora.enabled:
        errors.append(f"`lora.rank` = {spec.lora.rank} with the task {task.target!r}: hpcx adds LoRA adapters to the "
                      "projections of its built-in families only, and a task builds its own model: remove `[lora]` "
                      "(a task adapts its model in its `build_model`)")
    changed = [f"`model.{name}` = {value!r}" for name, value in changed_model_fields(spec, model_doc)]
    if changed:  # one problem: the section is the task's, however many of its fields are set
        also = f" (and {', '.join(changed[1:])})" if len(changed) > 1 else ""
        errors.append(f"{changed[0]}{also} is set, but `[model]` is the task's ({task.target!r} builds the model): "
                      f"remove {'them' if also else 'it'}")
    data_doc: dict[str, tp.Any] = doc["data"] if isinstance(doc.get("data"), dict) else {}
    errors += [f"`data.{key}` = {data_doc[key]!r} is for the built-in language models: the task "
               f"{task.target!r} gives its own datasets" for key in ("source", "val_source")
               if data_doc.get(key) not in (None, "synthetic", "", "none")]
    if spec.checkpoint.init_from:
        errors.append(f"`checkpoint.init_from` is for the built-in families: the task {task.target!r} loads "
                      "pretrained weights in its `build_model` (or `load_state_dict`)")
    return errors


def without_target(doc: dict[str, tp.Any]) -> list[str]:
    """``[task]`` keys other than ``target`` given without one: they configure no task (one line)."""
    given: dict[str, tp.Any] = doc["task"] if isinstance(doc.get("task"), dict) else {}
    keys = [k for k in given if k != "target"]
    if not keys or given.get("target"):
        return []
    return [f"`task.{keys[0]}` is set but `task.target` is not: {', '.join(f'`task.{k}`' for k in keys)} configure "
            "a task of your own, and without `task.target` = 'package.module:Class' the run trains the built-in "
            "language model: set `task.target` or remove them"]
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
    if isinstance(spec.workload, TaskWorkload):
        spec.model.arch, spec.model.seq_len = TASK, spec.workload.tokens_per_sample


def code_notice(spec: JobSpec) -> str | None:
    """What a task means: its code is imported and called in every task (as a user model's)."""
    workload = spec.workload
    if not isinstance(workload, TaskWorkload):
        return None
    from hpc.core.models.user import module_file  # lazy: startup (a spec's load joins no family)

    found = module_file(workload.module)
    where = f"from {found}" if found else "which is not importable here: every task must find it on its sys.path"
    return (f"user code: every task will import the Python module {workload.module!r} ({where}) and call "
            f"{workload.cls}({', '.join(workload.kwargs) or 'no kwargs'}) (task.target); it runs with your permissions, "
            "so check it is the code you mean")



# ---------------------------------------------------------------- the class, read without importing it

TASK_METHODS = ("build_model", "units", "train_dataset", "loss")  # trainer.tasks.REQUIRED, torch-free
MAX_MODULE_BYTES = 4 << 20  # a task's module is source code of some KB


def class_problems(workload: TaskWorkload) -> list[str]:
    """The user's ``task.target`` class read from its source without importing it (its module imports
    torch, and importing runs the user's code on the login node): the module must define the class,
    ``task.kwargs`` must fit its ``__init__``, and a class of no base must define the protocol's
    methods. One line, naming the user's file and class; nothing when the module is not found here (the
    notice says so) or the class is made in ways a parse cannot follow (a base class, an import)."""
    from hpc.core.models.user import module_file  # lazy: startup

    path = module_file(workload.module)
    if path is None or not path.endswith(".py"):
        return []
    label = f"`task.target` = {workload.target!r}"
    try:
        tree = ast.parse(_module_source(path, label), path)
    except SyntaxError as exc:
        return [f"{label}: {path}:{exc.lineno}: {exc.msg}: expected Python source"]
    except (ConfigError, ValueError, RecursionError) as exc:
        return list(getattr(exc, "messages", [f"{label}: {path}: cannot parse: {exc}"]))[:1]
    return _class_problems(tree, workload.cls, path, label, workload.kwargs)


def _module_source(path: str, label: str) -> bytes:
    with v.open_regular(path, f"{label}: {path}", "the task's Python module") as f:
        data = f.read(MAX_MODULE_BYTES + 1)
    if len(data) > MAX_MODULE_BYTES:
        raise ConfigError([f"{label}: {path}: over {MAX_MODULE_BYTES >> 20} MiB: expected a Python module"])
    return data


def _class_problems(tree: tp.Any, name: str, path: str, label: str, kwargs: tp.Mapping[str, tp.Any]) -> list[str]:
    bound = _top_level_bindings(tree)
    if name not in bound and not bound.get("*") and "__getattr__" not in bound:
        classes = sorted(n for n, node in bound.items() if isinstance(node, ast.ClassDef))
        return [f"{label}: {path} defines no {name!r}"
                + (f" (its classes: {', '.join(classes[:5])})" if classes else " (it defines no class)")]
    node = bound.get(name)
    if not isinstance(node, ast.ClassDef):
        return []  # a function or an assignment: what it makes is known only when it runs
    if node.bases and not all(isinstance(b, ast.Name) and b.id == "object" for b in node.bases) or node.decorator_list:
        return []  # methods and __init__ may come from a base, or a decorator may change the class
    members: dict[str, tp.Any] = {n.name: n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    members.update({t.id: n for n in node.body if isinstance(n, ast.Assign) for t in n.targets
                    if isinstance(t, ast.Name)})
    where = f"{label}: class {name} ({path}:{node.lineno})"
    problems = _init_problems(members.get("__init__"), kwargs)
    if problems:
        return [f"{where}: {problems}"]
    missing = [m for m in TASK_METHODS if m not in members]
    if missing:
        return [f"{where} has no {', '.join(f'{m}()' for m in missing)}: a task defines "
                f"{', '.join(f'{m}()' for m in TASK_METHODS)} (docs/tasks.md)"]
    return []


def _top_level_bindings(tree: tp.Any) -> dict[str, tp.Any]:
    """Name → the statement that binds it at the module's top level (inside ``if``/``try`` blocks too);
    ``"*"`` for a star import, which may bind anything."""
    out: dict[str, tp.Any] = {}
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out.update({n.id: node for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)})
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            todo += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                     *(s for h in getattr(node, "handlers", []) for s in h.body)]
    return out


def _init_problems(init: tp.Any, kwargs: tp.Mapping[str, tp.Any]) -> str:
    """What ``Class(**kwargs)`` would raise TypeError for, from ``__init__``'s signature; "" when it fits."""
    if not isinstance(init, ast.FunctionDef):
        given = ", ".join(kwargs)
        return (f"takes no keyword arguments (it defines no __init__), but `task.kwargs` gives {given}"
                if kwargs and init is None else "")
    a = init.args
    positional = [x.arg for x in [*a.posonlyargs, *a.args][1:]]  # after self
    named = [x.arg for x in a.args[1:] if x not in a.posonlyargs] + [x.arg for x in a.kwonlyargs]
    unknown = [k for k in kwargs if k not in named]
    if unknown and a.kwarg is None:
        return (f"__init__ takes no keyword argument {unknown[0]!r} (it takes "
                f"{', '.join(named) or 'none'}), but `task.kwargs` gives it")
    with_default = positional[len(positional) - len(a.defaults):] if a.defaults else []
    required = [p for p in positional if p not in with_default]
    required += [x.arg for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
    missing = [p for p in required if p not in kwargs]
    if missing:
        return f"__init__ requires {', '.join(missing)}, which `task.kwargs` does not give"
    return ""

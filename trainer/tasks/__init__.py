"""The task seam: what a run trains, behind one interface the loop calls (``LoopTask``).

A run trains a ``LoopTask``: the built-in language models' (``trainer.tasks.lm.LanguageModelTask``,
the spec's ``[model]`` and ``[data]``), or a user's ``[task] target = "pkg.mod:Class"`` (``Task``, the
protocol below, adapted and checked by ``UserTask``). Both go through the same calls of the loop, the
evaluator, the checkpoint and ``hpcx plan``/``dryrun``; everything else (strategy, precision, AC,
compile, gradient accumulation, clipping, optimizer, schedule, DCP checkpoints, the sampler,
preemption, requeue) is hpcx's. docs/tasks.md is the user's page.

The user's ``Task`` (a class; ``task.kwargs`` are its keyword arguments):

- ``build_model() -> nn.Module``: called under ``torch.device("meta")``; every module that owns
  parameters or buffers defines ``reset_parameters()`` (torch's layers do), so each rank initialises its
  part (``trainer.model.WeightInit``); the root may define ``fsdp_units()`` (``trainer.model``).
- ``units(model) -> nn.ModuleList``: the repeated units, each activation-checkpointed, compiled and
  ``fully_shard``-ed on its own.
- ``train_dataset() -> Dataset``: map-style (``__len__``, ``__getitem__``): hpcx's ``GlobalSampler``
  draws its indices, so a resume at any world size continues with the same samples; or iterable (no
  ``__len__``): read as a stream (``trainer.data.StreamSampler``), resumed exactly through its
  ``state_dict()``/``load_state_dict()`` when it has them.
- ``loss(model, batch) -> Tensor``: the mean loss of a micro-batch (a float scalar with a gradient), or
  ``(loss, {name: scalar})``: the scalars are logged per step as ``train_<name>``.

Optional: ``eval_dataset() -> Dataset | None`` (for ``train.eval_every``), ``sampler(dataset)`` (the order of
the indices for the whole job, ``trainer.data.epoch_order``), ``collate(samples)`` (default:
torch's ``default_collate``), ``metrics(model, batch) -> {name: (sum, count)}`` (summed over the
evaluation on every rank, written as ``eval_<name>`` = sum / count), ``pretrained(model) -> {name:
tensor}`` (the bare model's state to start from at step 0: a fine-tune's weights), and
``state_dict()`` / ``load_state_dict(state)`` (plain data, saved in every checkpoint).

A task that lacks a required method or returns the wrong thing fails with a ``ConfigError`` naming it; an
exception raised in the task's own code fails the job naming its file and line (``hpc.core.failures.
user_code_error``): neither would change on a restart, so neither is requeued.
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import importlib
import inspect
import math
import numbers
import typing as tp

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.utils.data import Dataset, default_collate

from hpc.core.errors import ConfigError
from hpc.core.failures import code_roots, looks_like_infrastructure, one_line, traceback_frames, user_code_error
from hpc.core.imports import submit_folder_last
from hpc.core.workload import TaskWorkload
from trainer.evaluate import Evaluator, build_evaluator
from trainer.tasks.lm import LanguageModelTask

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.core.spec import JobSpec

REQUIRED = ("build_model", "units", "train_dataset", "loss")
OPTIONAL = ("eval_dataset", "collate", "metrics", "pretrained", "state_dict", "load_state_dict")
Batch = tp.Any


@tp.runtime_checkable
class Task(tp.Protocol):
    """What a user's ``[task] target`` class gives (see the module docstring; the optional methods too)."""

    def build_model(self) -> nn.Module: ...

    def units(self, model: nn.Module) -> nn.ModuleList: ...

    def train_dataset(self) -> Dataset: ...

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor: ...


class LoopTask(tp.Protocol):
    """What the loop, the evaluator, the checkpoint and ``hpcx dryrun`` call on whatever a run trains."""

    tokens_per_sample: int  # what a sample counts in `tokens_per_s` (a language model's seq_len; a task's 1)
    flops_per_token: float | None  # for MFU (None: unknown)

    def meta_model(self) -> nn.Module:
        """The bare model, on the meta device."""

    def blocks(self, model: nn.Module) -> nn.ModuleList:
        """The repeated units of the bare model."""

    def train_dataset(self) -> Dataset:
        """The map-style training set the sampler draws from."""

    def shuffle(self) -> bool:
        """Whether the sampler permutes the samples each epoch."""

    def collate(self, samples: list[tp.Any]) -> Batch:
        """One micro-batch from its samples."""

    def evaluator(self, spec: JobSpec, rank: int, world_size: int) -> Evaluator | None:
        """This rank's evaluation (None: none)."""

    def to_device(self, batch: Batch, device: torch.device) -> Batch:
        """A micro-batch on ``device``, copied without waiting."""

    def step_scale(self, micro_batches: tp.Sequence[Batch], world_size: int) -> float | torch.Tensor:
        """The factor on each micro-batch's loss for one optimizer step (1/micro-steps, or a masked scale)."""

    def micro_loss(self, model: nn.Module, batch: Batch, scale: float | torch.Tensor,
                   autocast: tp.ContextManager) -> torch.Tensor:
        """The scaled loss to back-propagate (the forward under ``autocast``)."""

    def eval_terms(self, model: nn.Module, batch: Batch, samples: int, autocast: tp.ContextManager) -> torch.Tensor:
        """The sums one evaluation micro-batch of ``samples`` adds (float64, always the same length)."""

    def eval_record(self, sums: list[float]) -> dict[str, tp.Any]:
        """The ``eval_*`` values of the evaluation's summed terms (over every rank)."""

    def start_weights(self, model: nn.Module) -> None:
        """After initialisation at step 0 (no checkpoint of the run's own): the task's pretrained weights."""

    def state_dict(self) -> dict[str, tp.Any]:
        """The task's own state to checkpoint (plain data; {} when none)."""

    def load_state_dict(self, state: dict[str, tp.Any]) -> None:
        """Restore what ``state_dict`` gave."""


def task_for(spec: JobSpec, data_source: str | None = None) -> LoopTask:
    """What ``spec`` trains: the user's task of ``[task]``, else the built-in language model's
    (``data_source``: ``Launch.data_source``, decided at resolve)."""
    if isinstance(spec.workload, TaskWorkload):
        return user_task(spec.workload, spec.data.shuffle)
    return LanguageModelTask(spec, data_source)


def user_task(workload: TaskWorkload, shuffle: bool) -> UserTask:
    """The user's class of ``[task]``, built with its kwargs, as a ``LoopTask``."""
    task = UserTask(load_task(workload.target, dict(workload.kwargs)), workload.target, shuffle)
    task.tokens_per_sample = workload.tokens_per_sample
    return task


def load_task(target: str, kwargs: dict[str, tp.Any]) -> tp.Any:
    """``pkg.mod:Class(**kwargs)``, imported from ``sys.path`` and then the submit folder
    (``hpc.core.imports.submit_folder_last``); one line naming what is missing."""
    module_name, class_name = target.split(":")
    submit_folder_last()
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError([f"`task.target` = {target!r}: cannot import {module_name!r} here: {exc}"]) from None
    except Exception as exc:  # noqa: BLE001  (the module's own code: SyntaxError, NameError, … at import)
        raise ConfigError([f"`task.target` = {target!r}: importing {module_name!r} raised "
                           f"{raised_at(exc, module_name)}"]) from None
    cls = getattr(module, class_name, None)
    if not callable(cls):
        raise ConfigError([f"`task.target` = {target!r}: module {module_name!r} has no class {class_name!r}"])
    try:
        task = cls(**kwargs)
    except TypeError as exc:
        raise ConfigError([f"`task.target` = {target!r}: {class_name}(**task.kwargs) raised TypeError: {exc}"]) from None
    except Exception as exc:  # noqa: BLE001  (the task's __init__; the machine's failures stay themselves)
        if looks_like_infrastructure(exc):
            raise
        raise ConfigError([f"`task.target` = {target!r}: {class_name}(**task.kwargs) raised "
                           f"{raised_at(exc, module_name)}"]) from None
    missing = [name for name in REQUIRED if not callable(getattr(task, name, None))]
    if missing:
        raise ConfigError([f"`task.target` = {target!r}: the task has no {', '.join(f'{m}()' for m in missing)}: "
                           f"a task defines {', '.join(f'{m}()' for m in REQUIRED)} (docs/tasks.md)"])
    return task


def raised_at(exc: BaseException, module_name: str) -> str:
    """``NameError: name 'x' is not defined (at pkg/mod.py:3 in <module>)``: the exception in one line, at the
    innermost line of the job's own code (the package of ``module_name``), or of the file python could not
    compile (a SyntaxError), or the innermost frame outside python's import machinery."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return one_line(exc, f"{exc.filename}:{exc.lineno}")
    where = user_code_error(exc, code_roots([module_name]))
    if where is None:
        frames = [f for f in traceback_frames(exc) if not f[0].startswith("<frozen")]
        where = f"{frames[-1][0]}:{frames[-1][1]} in {frames[-1][2]}" if frames else None
    return one_line(exc, where)


def method_at(method: tp.Any) -> str:
    """`` (defined at file:line)`` of a task's method, for a message about what it returned; "" if unknown."""
    try:
        func = inspect.unwrap(getattr(method, "__func__", method))
        return f" (defined at {inspect.getsourcefile(func)}:{func.__code__.co_firstlineno})"
    except (TypeError, AttributeError, OSError):
        return ""


def to_device(batch: Batch, device: torch.device) -> Batch:
    """Every tensor of a batch on ``device``, copied without waiting: tensors; dicts (and other mappings),
    lists and tuples, nested; namedtuples and dataclasses, moved field by field and rebuilt as the same
    type; and any other object with a ``to(device)`` method (a transformers ``BatchEncoding``, a task's own
    batch class), whose ``to`` is trusted to return the moved batch. Anything else is kept as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple: positional fields
        return type(batch)(*(to_device(v, device) for v in batch))
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return _dataclass_to(batch, device)
    if isinstance(batch, dict) and type(batch) in (dict, collections.OrderedDict):
        return type(batch)((k, to_device(v, device)) for k, v in batch.items())
    if isinstance(batch, (list, tuple)) and type(batch) in (list, tuple):
        return type(batch)(to_device(v, device) for v in batch)
    if callable(getattr(batch, "to", None)):
        return batch.to(device)
    if isinstance(batch, collections.abc.Mapping):  # a mapping of its own class without `to`: a plain dict
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):  # a subclass without `to`: its own class from an iterable
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def _dataclass_to(batch: tp.Any, device: torch.device) -> tp.Any:
    """A dataclass instance rebuilt as its own type with every field moved (``init=False`` fields set after)."""
    fields = dataclasses.fields(batch)
    moved = dataclasses.replace(batch, **{f.name: to_device(getattr(batch, f.name), device) for f in fields if f.init})
    for f in fields:
        if not f.init and hasattr(batch, f.name):
            object.__setattr__(moved, f.name, to_device(getattr(batch, f.name), device))
    return moved


class UserTask:
    """A user's ``Task`` as a ``LoopTask``: hpcx's side of the seam, with the checks of what it returns."""

    tokens_per_sample = 1
    flops_per_token: float | None = None

    def __init__(self, task: tp.Any, target: str, shuffle: bool):
        self.task, self.target, self._shuffle = task, target, shuffle
        self.metric_names: list[str] | None = None  # known after the first evaluation batch
        self.scalar_names: list[str] | None = None  # the extra scalars ``loss`` returns, known after its first call
        self._scalars: dict[str, list[torch.Tensor]] = {}  # this step's, per micro-batch

    def _wrong(self, method: str, what: str) -> ConfigError:
        return ConfigError([f"`task.target` = {self.target!r}: {method} {what}"])

    def meta_model(self) -> nn.Module:
        with torch.device("meta"):
            model = self.task.build_model()
        if not isinstance(model, nn.Module):
            raise self._wrong("build_model()", f"returned {type(model).__name__}, expected an nn.Module")
        return model

    def blocks(self, model: nn.Module) -> nn.ModuleList:
        units = self.task.units(model)
        if not isinstance(units, nn.ModuleList) or not len(units):
            raise self._wrong("units(model)", f"returned {_described(units)}, expected a non-empty nn.ModuleList of "
                              "the model's repeated units")
        return units

    def train_dataset(self) -> Dataset:
        dataset = self.task.train_dataset()
        if isinstance(dataset, torch.utils.data.IterableDataset) or (
                callable(getattr(dataset, "__iter__", None)) and not callable(getattr(dataset, "__len__", None))
                and not isinstance(dataset, tp.Iterator)):
            return dataset  # an iterable dataset: read as a stream (``trainer.data.StreamSampler``)
        return self._dataset("train_dataset()", dataset)

    def own_sampler(self, dataset: Dataset) -> tp.Any:
        """The task's ``sampler(dataset)``: the global order of its indices (None: hpcx's own)."""
        own = getattr(self.task, "sampler", None)
        sampler = own(dataset) if callable(own) else None
        if sampler is not None and not (callable(getattr(sampler, "__iter__", None))
                                        and callable(getattr(sampler, "__len__", None))):
            raise self._wrong("sampler(dataset)", f"returned {type(sampler).__name__}, expected a sampler of the "
                              "dataset's indices with __iter__ and __len__ (one order for the whole job)")
        return sampler

    def _dataset(self, method: str, dataset: tp.Any) -> Dataset:
        if not (callable(getattr(dataset, "__len__", None)) and callable(getattr(dataset, "__getitem__", None))):
            raise self._wrong(method, f"returned {type(dataset).__name__}, expected a map-style Dataset "
                              "(__len__ and __getitem__: hpcx's sampler draws the indices) or an iterable one "
                              "(__iter__, no __len__; an IterableDataset)")
        if len(dataset) < 1:
            raise self._wrong(method, "returned an empty dataset")
        return dataset

    def shuffle(self) -> bool:
        return self._shuffle

    def collate(self, samples: list[tp.Any]) -> Batch:
        own = getattr(self.task, "collate", None)
        return own(samples) if callable(own) else default_collate(samples)

    def evaluator(self, spec: JobSpec, rank: int, world_size: int) -> Evaluator | None:
        make = getattr(self.task, "eval_dataset", None)
        dataset = make() if spec.train.eval_every and callable(make) else None
        if dataset is None:
            return None
        ev = build_evaluator(self._dataset("eval_dataset()", dataset), spec.train.global_batch,
                             spec.train.micro_batch, rank, world_size, spec.train.eval_every, spec.train.eval_steps)
        ev.task = self
        return ev

    def to_device(self, batch: Batch, device: torch.device) -> Batch:
        return to_device(batch, device)

    def step_scale(self, micro_batches: tp.Sequence[Batch], world_size: int) -> float:
        return 1.0 / len(micro_batches)

    def micro_loss(self, model: nn.Module, batch: Batch, scale: float | torch.Tensor,
                   autocast: tp.ContextManager) -> torch.Tensor:
        with autocast:
            loss = self.checked_loss(model, batch, keep_scalars=True)
        return loss if isinstance(scale, float) and scale == 1.0 else loss * scale

    def step_scalars(self) -> dict[str, torch.Tensor]:
        """The task's own scalars of the step just done (``loss`` returned them beside the loss), each the
        mean over this rank's micro-batches, on the device (no host sync); emptied for the next step."""
        out = {name: torch.stack(values).mean() for name, values in sorted(self._scalars.items())}
        self._scalars = {}
        return out

    def _split(self, found: tp.Any) -> tuple[tp.Any, dict[str, tp.Any]]:
        """(loss, extra scalars) of what ``loss(model, batch)`` returned: a tensor; ``(loss, {name: scalar})``;
        or ``{"loss": loss, name: scalar, …}``."""
        if isinstance(found, tuple) and len(found) == 2 and isinstance(found[1], dict):
            return found[0], found[1]
        if isinstance(found, dict) and "loss" in found:
            return found["loss"], {k: v for k, v in found.items() if k != "loss"}
        return found, {}

    def _keep_scalars(self, extras: dict[str, tp.Any], device: torch.device) -> None:
        names = sorted(extras)
        bad = next((n for n in names if not (isinstance(n, str) and n.isidentifier() and n != "loss")), None)
        if bad is not None or not all(_scalar(extras[n]) for n in names):
            what = f"named a scalar {bad!r} (expected an identifier other than 'loss')" if bad is not None else \
                f"gave {next(n for n in names if not _scalar(extras[n]))!r} as not a number or a one-element tensor"
            raise self._wrong("loss(model, batch)", f"{what}: expected the loss, or (loss, {{name: scalar}})")
        if self.scalar_names is not None and names != self.scalar_names:
            raise self._wrong("loss(model, batch)", f"returned the scalars {names}, then {self.scalar_names} before: "
                              "expected the same names at every step (every rank logs them together)")
        self.scalar_names = names
        for name in names:
            value = torch.as_tensor(extras[name], device=device).detach().float().reshape(())
            self._scalars.setdefault(name, []).append(value)

    def checked_loss(self, model: nn.Module, batch: Batch, keep_scalars: bool = False) -> torch.Tensor:
        loss, extras = self._split(self.task.loss(model, batch))
        if keep_scalars and isinstance(loss, torch.Tensor):
            self._keep_scalars(extras, loss.device)
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()):
            raise self._wrong("loss(model, batch)", f"returned {_described(loss)}, expected a float scalar tensor "
                              f"(the mean loss of the batch){method_at(self.task.loss)}")
        if torch.is_grad_enabled() and not loss.requires_grad:
            raise self._wrong(f"loss(model, batch){method_at(self.task.loss)}", "returned a loss that does not "
                              "require grad: computed without the model's parameters, under no_grad, or detached")
        return loss.float()

    def eval_terms(self, model: nn.Module, batch: Batch, samples: int, autocast: tp.ContextManager) -> torch.Tensor:
        """(loss × samples, samples, then each metric's sum and count), float64."""
        with autocast:
            loss = self.checked_loss(model, batch)
            metrics = self._metrics(model, batch)
        device = loss.device
        terms = [loss.double() * samples, torch.tensor(float(samples), dtype=torch.float64, device=device)]
        for total, count in metrics.values():
            terms += [torch.as_tensor(total, device=device).double(), torch.as_tensor(count, device=device).double()]
        return torch.stack(terms)

    def _metrics(self, model: nn.Module, batch: Batch) -> dict[str, tuple[tp.Any, tp.Any]]:
        own = getattr(self.task, "metrics", None)
        found = own(model, batch) if callable(own) else {}
        problem = _metrics_problem(found)
        if problem:
            raise self._wrong("metrics(model, batch)", f"{problem}: expected {{name: (sum, count)}} of numbers or "
                              "scalar tensors")
        names = sorted(found)
        if self.metric_names is not None and names != self.metric_names:
            raise self._wrong("metrics(model, batch)", f"returned {names}, then {self.metric_names} before: expected "
                              "the same names for every batch")
        self.metric_names = names
        return {k: found[k] for k in names}

    def eval_record(self, sums: list[float]) -> dict[str, tp.Any]:
        loss_sum, samples = sums[0], sums[1]
        record: dict[str, tp.Any] = {"eval_loss": loss_sum / max(1.0, samples)}
        for i, name in enumerate(self.metric_names or []):
            total, count = sums[2 + 2 * i], sums[3 + 2 * i]
            record[f"eval_{name}"] = total / count if count else math.nan
        return record

    def start_weights(self, model: nn.Module) -> None:
        own = getattr(self.task, "pretrained", None)
        state = own(model) if callable(own) else None
        if state is None:
            return
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise self._wrong("pretrained(model)", f"returned {_described(state)}, expected a dict of tensors by "
                              "the bare model's parameter names")
        try:
            set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))
        except (RuntimeError, KeyError, ValueError) as exc:
            raise self._wrong("pretrained(model)", f"does not fit the model: {str(exc).splitlines()[0]}") from None

    def state_dict(self) -> dict[str, tp.Any]:
        own = getattr(self.task, "state_dict", None)
        state = own() if callable(own) else {}
        if not isinstance(state, dict):
            raise self._wrong("state_dict()", f"returned {type(state).__name__}, expected a dict of plain data")
        return state

    def load_state_dict(self, state: dict[str, tp.Any]) -> None:
        own = getattr(self.task, "load_state_dict", None)
        if callable(own) and state:
            own(state)


def _described(value: tp.Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__ if not isinstance(value, nn.ModuleList) else "an empty nn.ModuleList"


def _metrics_problem(found: tp.Any) -> str | None:
    if not isinstance(found, dict):
        return f"returned {type(found).__name__}"
    for name, pair in found.items():
        if not (isinstance(name, str) and name.isidentifier()):
            return f"named a metric {name!r} (not an identifier)"
        if not (isinstance(pair, tuple) and len(pair) == 2 and all(_scalar(x) for x in pair)):
            return f"gave {name!r} as {_described(pair)}"
    return None


def _scalar(x: tp.Any) -> bool:
    return (isinstance(x, torch.Tensor) and x.numel() == 1) or (isinstance(x, numbers.Real) and not isinstance(x, bool))

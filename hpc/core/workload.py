"""What a job runs, resolved once from its spec: hpcx's causal-LM trainer on a model of ``[model]``
(``LMWorkload``), a user's task of ``[task]`` (``TaskWorkload``: its model, data, loss and metrics) or a
user's own script of ``job.command`` (``ScriptWorkload``).

``workload_of`` is the one place that reads which of the spec's kind fields (``job.command``,
``task.target``) are set; the spec keeps the value it resolved (``JobSpec.workload``) and everything
downstream matches on its class (``match spec.workload: case ScriptWorkload(): …``) or reads
``kind``/``uses_trainer``, never an empty field (tests/test_workload.py walks the source for that).
The loader refuses a spec that mixes kinds (``job.command`` beside ``[task]``: hpc.core.spec); a
resolved.json that holds both reads as the script, which is what its ranks ran.

Torch-free, stdlib only: a leaf of hpc.core.
"""

from __future__ import annotations

import typing as tp
from dataclasses import dataclass, field

Kind = tp.Literal["lm", "task", "script"]


@dataclass(frozen=True)
class LMWorkload:
    """hpcx's trainer on the causal language model of ``[model]``."""

    kind: tp.ClassVar[Kind] = "lm"
    uses_trainer: tp.ClassVar[bool] = True  # hpcx's trainer runs it: a model to plan, build and dry-run
    arch: str  # the family (``llama``, ``gpt`` …) or the user's ``package.module:function``

    @property
    def code_modules(self) -> tuple[str, ...]:
        """The user's module a ``package.module:function`` model imports (none for a built-in family)."""
        return (self.arch.split(":")[0],) if ":" in self.arch else ()


@dataclass(frozen=True)
class TaskWorkload:
    """hpcx's trainer on a user's task (``[task]``): its class gives the model, data, loss and metrics."""

    kind: tp.ClassVar[Kind] = "task"
    uses_trainer: tp.ClassVar[bool] = True
    target: str  # ``package.module:Class``
    kwargs: tp.Mapping[str, tp.Any] = field(default_factory=dict, hash=False)  # the class's keyword arguments
    tokens_per_sample: int = 1
    flops_per_sample: float = 0.0  # 0: counted on the meta device
    sync_batchnorm: bool = False  # its BatchNorms become SyncBatchNorm

    @property
    def module(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def cls(self) -> str:
        return self.target.split(":", 1)[1]

    @property
    def code_modules(self) -> tuple[str, ...]:
        return (self.module,)


@dataclass(frozen=True)
class ScriptWorkload:
    """A user's own command (``job.command``) on every rank: it decides its own model, data and layout."""

    kind: tp.ClassVar[Kind] = "script"
    uses_trainer: tp.ClassVar[bool] = False
    command: tuple[str, ...]  # the argument list (never a shell string)

    @property
    def code_modules(self) -> tuple[str, ...]:
        return ()  # the script is its own process: hpcx imports none of its code


Workload = LMWorkload | TaskWorkload | ScriptWorkload


class _Spec(tp.Protocol):  # what of a JobSpec is read here (importing hpc.core.spec would make a cycle)
    job: tp.Any
    task: tp.Any
    model: tp.Any


def workload_of(spec: _Spec) -> Workload:
    """The spec's workload: its command if it has one, else its task if it names one, else the LM."""
    if spec.job.command:
        return ScriptWorkload(tuple(spec.job.command))
    task = spec.task
    if task.target:
        return TaskWorkload(task.target, dict(task.kwargs), task.tokens_per_sample, task.flops_per_sample,
                            task.sync_batchnorm)
    return LMWorkload(spec.model.arch)

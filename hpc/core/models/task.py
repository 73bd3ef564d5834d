"""A task's model (``[task]``, ``hpc.core.tasks``), torch-free: the family the spec loader records as
``model.arch = "task-model"``. Nothing about the model is in the spec: its size is known only by building it
on the meta device (``trainer.count.count_task``; ``hpcx plan`` and ``hpcx dryrun`` do), else unknown.
A task's sample holds ``task.tokens_per_sample`` positions (recorded as ``model.seq_len``; 1 for an
image): the planner's FLOPs are 6 per parameter per position (a lower bound for a convolution, which
reuses its weights across pixels), and ``tokens_per_s`` counts positions.
"""

from __future__ import annotations

import typing as tp
from dataclasses import dataclass

from hpc.core.models import TASK, Counted, ModelFacts, count_text

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.core.spec import Model


@dataclass
class Fields:
    """A task's model has no ``[model]`` fields of its own (the task's code says everything)."""


def facts(model: Model, counted: Counted | None = None) -> ModelFacts:
    """The counted model's numbers, else unknown."""
    if counted is None:
        return ModelFacts(label="the task's model (parameters unknown until built)", n_params=None,
                          unit_params=None, root_params=None, n_units=0, flops_per_token=None, seq_len=model.seq_len or 1,
                          vocab_size=1, source="unknown", family=TASK)
    return ModelFacts(label=f"the task's model ({count_text(counted.n_params)} params, counted)",
                      n_params=counted.n_params, unit_params=counted.unit_params,
                      root_params=counted.n_params - counted.unit_params * counted.n_units, n_units=counted.n_units,
                      flops_per_token=6.0 * (counted.n_params - counted.embedding_params),
                      seq_len=model.seq_len or 1, vocab_size=1,
                      source="counted on the meta device", family=TASK)


def problems(model: Model) -> list[str]:
    """Nothing to check here: ``hpc.core.tasks.task_problems`` checks ``[task]`` and that ``[model]`` is untouched."""
    return []


def activation_bytes(facts: ModelFacts, micro_batch: int, checkpointing: bool, mixed_precision: str,
                     dropout: float = 0.0, autocast: bool = False) -> float | None:
    """Unknown: a task's activations are its code's."""
    return None


def code_notice(model: Model) -> str | None:
    """The task's notice is ``hpc.core.tasks.code_notice`` (it names ``task.target``)."""
    return None


def preset_counts() -> str:
    return ""


class TaskModel:
    """A task's model as a ``hpc.core.models.Family``."""

    name = TASK
    phrase = "a task's model"
    fields = Fields
    builder = "trainer.models.task"
    counted_by_building = True
    facts = staticmethod(facts)
    problems = staticmethod(problems)
    activation_bytes = staticmethod(activation_bytes)
    code_notice = staticmethod(code_notice)
    preset_counts = staticmethod(preset_counts)


FAMILY = TaskModel()

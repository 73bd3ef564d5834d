"""A task's model (``[task]``, ``hpc.core.tasks``), torch-free: the family the spec loader records as
``model.arch = "task-model"``. Nothing about the model is in the spec: its size is known only by building it
on the meta device (``trainer.count.count_task``; ``hpcx plan`` and ``hpcx dryrun`` do), else unknown.
A task's sample holds ``task.tokens_per_sample`` positions (recorded as ``model.seq_len``; 1 for an
image), and ``tokens_per_s`` counts positions. The planner's FLOPs per sample are 3 × the forward FLOPs of
one sample (forward + a backward of twice the forward): the task's declared ``task.flops_per_sample``, else
counted on the meta device from a forward pass on the task's first sample (``trainer.count.forward_flops``);
only where neither is known, 6 per parameter per position (a convolution reuses its weights across every
pixel: for a ResNet-50 at 224² that is ~1/330 of its 8.2 GFLOPs).
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
                      root_params=root_params(counted), n_units=counted.n_units,
                      flops_per_token=flops_per_token(model, counted),
                      seq_len=model.seq_len or 1, vocab_size=1,
                      source="counted on the meta device" + (f"; FLOPs {counted.flops_source}" if counted.flops_source
                                                            else ""), family=TASK)


def root_params(counted: Counted) -> int:
    """Parameters outside the blocks: the total less the blocks' own (blocks of different sizes, a ResNet's
    stages, are summed; the largest × the count would exceed the total: ResNet-50's 6.0M × 16 against 25.6M)."""
    blocks = counted.units_params if counted.units_params is not None else counted.unit_params * counted.n_units
    return max(0, counted.n_params - blocks)


def flops_per_token(model: Model, counted: Counted) -> float:
    """Training FLOPs per position: 3 × a sample's forward FLOPs over its positions, else 6 per parameter."""
    if counted.flops_per_sample:
        return 3.0 * counted.flops_per_sample / (model.seq_len or 1)
    return 6.0 * (counted.n_params - counted.embedding_params)


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

"""A task's model (``hpc.core.models.task``), trainer side: the task builds it (``trainer.tasks``,
``LoopTask.meta_model``), never ``[model]``."""

from __future__ import annotations

import typing as tp

from hpc.core.errors import ConfigError

if tp.TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from hpc.core.spec import Model as ModelSpec


def build(spec: ModelSpec) -> nn.Module:
    """Refused: ``[model]`` of a task's spec says nothing (``trainer.tasks.task_for(spec).meta_model()``)."""
    raise ConfigError(["`model.arch` = 'task-model': a task's model is built by its `[task] target` "
                       "(trainer.tasks.task_for(spec).meta_model()), not from `[model]`"])

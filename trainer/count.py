"""Count a model's parameters by building it on the meta device: no memory, no initialisation.

``hpcx plan --count-params`` calls this (it imports torch, so only on request: the login-node
``plan`` stays torch-free). The planner needs the total, the largest block under ``model.blocks``
(an FSDP unit), the number of blocks, and the embedding weights no linear layer shares (FLOPs).
"""

from __future__ import annotations

from torch import nn

from hpc.core.errors import UserError
from hpc.core.models import Counted
from hpc.core.spec import JobSpec, Model as ModelSpec
from trainer.model import build_model, model_blocks


def count_model(spec: ModelSpec) -> Counted:
    """Parameters of ``spec``'s model, counted on the meta device."""
    try:
        model = build_model(spec, "meta")
        blocks = model_blocks(model, spec.blocks)
    except Exception as exc:  # noqa: BLE001  (the user's code: whatever it raises is their error to read)
        raise UserError([f"`model.arch` = {spec.arch!r}: could not build it on the meta device to count its "
                         f"parameters: {type(exc).__name__}: {exc}"]) from None
    if not len(blocks):
        raise UserError([f"`model.blocks` = {spec.blocks or 'blocks'!r} of {spec.arch!r} is empty: expected the "
                         "repeated units"])
    return Counted(n_params=_numel(model), unit_params=max(_numel(b) for b in blocks), n_units=len(blocks),
                   embedding_params=_embedding_params(model))


def count_task(spec: JobSpec) -> Counted:
    """Parameters of ``spec``'s task's model (``[task]``), counted on the meta device."""
    from trainer.tasks import UserTask, load_task

    task = UserTask(load_task(spec.task.target, spec.task.kwargs), spec.task.target, spec.data.shuffle)
    try:
        model = task.meta_model()
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001  (the user's code: whatever it raises is their error to read)
        raise UserError([f"`task.target` = {spec.task.target!r}: could not build its model on the meta device to "
                         f"count its parameters: {type(exc).__name__}: {exc}"]) from None
    blocks = task.blocks(model)
    return Counted(n_params=_numel(model), unit_params=max(_numel(b) for b in blocks), n_units=len(blocks),
                   embedding_params=_embedding_params(model))


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # parameters() lists a shared (tied) tensor once


def _embedding_params(model: nn.Module) -> int:
    matmul = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    return sum(m.weight.numel() for m in model.modules()
               if isinstance(m, nn.Embedding) and id(m.weight) not in matmul)

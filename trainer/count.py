"""Count a model's parameters by building it on the meta device: no memory, no initialisation.

``hpcx plan --count-params`` calls this (it imports torch, so only on request: the login-node
``plan`` stays torch-free). The planner needs the total, the largest block under ``model.blocks``
(an FSDP unit), the number of blocks, and the embedding weights no linear layer shares (FLOPs).
"""

from __future__ import annotations

import typing as tp

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from hpc.core.errors import UserError
from hpc.core.models import Counted
from hpc.core.spec import JobSpec, Model as ModelSpec
from hpc.core.workload import TaskWorkload
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
    from trainer.tasks import user_task  # lazy: numpy

    workload = spec.workload
    if not isinstance(workload, TaskWorkload):
        raise ValueError(f"{spec.source}: count_task counts a task's model, but the spec's workload is {workload.kind!r}")
    task = user_task(workload, spec.data.shuffle)
    try:
        model = task.meta_model()
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001  (the user's code: whatever it raises is their error to read)
        raise UserError([f"`task.target` = {workload.target!r}: could not build its model on the meta device to "
                         f"count its parameters: {type(exc).__name__}: {exc}"]) from None
    blocks = task.blocks(model)
    flops: float | None = workload.flops_per_sample
    if flops:
        source = "declared (task.flops_per_sample)"
    else:
        flops = forward_flops(task, model)
        source = ("counted on the meta device (a forward pass on the first sample)" if flops
                  else "unknown (the forward on the meta device failed): 6 per parameter")
    return Counted(n_params=_numel(model), unit_params=max(_numel(b) for b in blocks), n_units=len(blocks),
                   embedding_params=_embedding_params(model), flops_per_sample=flops or None, flops_source=source,
                   units_params=sum(_numel(b) for b in blocks))


def forward_flops(task: tp.Any, model: nn.Module) -> float | None:
    """Forward FLOPs of one sample (torch's FlopCounterMode: 2 per multiply-add of matmuls and convolutions), from
    the task's loss on its first training sample, on the meta device (no memory, no compute); None where the
    task's forward cannot run there (it reads a value, say)."""
    from trainer.tasks import to_device  # lazy: numpy

    try:
        batch = to_device(task.collate([task.train_dataset()[0]]), torch.device("meta"))
        with FlopCounterMode(display=False) as counter:
            task.checked_loss(model, batch)
    except Exception:  # noqa: BLE001  (the user's code: a forward that needs real values is not countable here)
        return None
    return float(counter.get_total_flops()) or None


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # parameters() lists a shared (tied) tensor once


def _embedding_params(model: nn.Module) -> int:
    matmul = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    return sum(m.weight.numel() for m in model.modules()
               if isinstance(m, nn.Embedding) and id(m.weight) not in matmul)

"""Tensor parallelism (``parallel.tp``): each family's declared plan, applied with DTensor before FSDP.

``apply_tp`` runs ``parallelize_module`` on the ``"tp"`` dimension of the device mesh (the innermost,
one node's consecutive ranks), first in ``trainer.parallelize`` (TP, then activation checkpointing,
compile, then ``fully_shard`` over the data-parallel dimensions, as torchtitan orders them). The plan
is data the family declares (``hpc.core.models.tp_plan.TpPlan``, ``Family.tp_plan``; the planner reads
the same one): ``trainer.train`` passes the plan of ``spec.model.arch``'s family, and ``style`` maps each
role it names to a torch ``ParallelStyle``; no module name is guessed here. The Llama block's plan
(``hpc.core.models.decoder.BLOCK_TP_PLAN``, the Llama's, Qwen2's and Mistral's):

================================  ==============================================================
role (module)                     placement
================================  ==============================================================
``embedding`` (``tok_emb``)       row-wise (vocabulary split), input Replicate, output Shard(1):
                                  the residual stream is split along the sequence (SP)
``norms``, ``final_norm``         ``SequenceParallel``: weight Replicate, input/output Shard(1)
``gathered`` (``attn``, ``mlp``)  ``PrepareModuleInput``: the sequence all-gathered (Replicate),
                                  further inputs (rotary cos/sin) as they are
``column`` (``wq wk wv w1 w3``)   column-wise: each rank ``n_heads / tp`` query heads, ``n_kv_heads
                                  / tp`` key/value heads, ``ffn_dim / tp`` hidden units
``row`` (``wo`` / ``w2``)         row-wise, output reduce-scattered to Shard(1)
``head``                          column-wise, output Shard(-1) kept a DTensor: the loss runs under
                                  ``loss_parallel`` and never gathers the vocabulary
================================  ==============================================================

The GPT's plan (``hpc.core.models.gpt.TP_PLAN``): its attention has one fused ``qkv`` matrix whose rows
are [q | k | v]: a column split would give rank 0 all of q and none of v, so it is ``whole``, computed on
each rank of the group (``PrepareModuleInputOutput``: its sequence gathered, its output split back along
the sequence); its MLP (``fc`` column, ``proj`` row), embeddings, norms and head follow the Llama plan, and
its learned ``positions`` are replicated with their output split along the sequence (``split_positions``).
A model without a plan (a user's, a task's) is refused (at ``hpc.core.tensor_parallel``, and here).

Attention modules read their local head count from the projection's output (``view(b, s, -1, hd)``),
so the same forward serves every degree; the rotary cos/sin cover the whole sequence (the attention
input is gathered).
"""

from __future__ import annotations

import typing as tp

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from hpc.core.errors import ConfigError

if tp.TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.tensor.parallel import ParallelStyle

    from hpc.core.models.tp_plan import TpPlan


def refuse_without_plan(model: nn.Module, plan: TpPlan | None, degree: int) -> TpPlan:
    """``plan``, or ConfigError with the reason (a model whose family declares none: refused above tp 1)."""
    if plan is None:
        raise ConfigError(f"`parallel.tp` = {degree} but {type(model).__name__} is not a built-in family: hpcx has no "
                          "tensor-parallel plan for it (which of its matrices split by rows or columns is the "
                          "model's own); use tp = 1")
    return plan


def style(role: str, inputs: int = 1) -> ParallelStyle:
    """The ``ParallelStyle`` of one role of a ``TpPlan`` (``inputs``: a gathered module's positional inputs)."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                                   RowwiseParallel, SequenceParallel)

    rest = (None,) * (inputs - 1)
    styles: dict[str, tp.Callable[[], ParallelStyle]] = {
        "embedding": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "head": lambda: ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        "final_norm": SequenceParallel, "norms": SequenceParallel,
        "column": ColwiseParallel, "row": lambda: RowwiseParallel(output_layouts=Shard(1)),
        "gathered": lambda: PrepareModuleInput(input_layouts=(Shard(1), *rest),
                                               desired_input_layouts=(Replicate(), *rest)),
        "whole": lambda: PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True),
    }
    return styles[role]()


def outer_plan(plan: TpPlan) -> dict[str, ParallelStyle]:
    """Embeddings, final norm and head: vocabulary-split embedding into a sequence-split residual stream,
    head column-wise with DTensor logits for ``loss_parallel`` (learned positions: ``split_positions``)."""
    return {module: style(role) for module, role in plan.roles().items() if role != "positions"}


def block_plan(plan: TpPlan) -> dict[str, ParallelStyle]:
    """One block's styles, by its module names."""
    inputs = dict(plan.block.gathered)
    return {module: style(role, inputs.get(module, 1)) for module, role in plan.block.roles().items()}


def apply_tp(model: nn.Module, blocks: nn.ModuleList, tp_mesh: DeviceMesh, plan: TpPlan | None) -> TpPlan:
    """Shard ``model`` (on the meta device or allocated) over ``tp_mesh`` by its family's ``plan``; returns
    it. A tied head keeps sharing the embedding's (row-split, Shard(0)) matrix."""
    plan = refuse_without_plan(model, plan, tp_mesh.size())
    embedding, head = model.get_submodule(plan.embedding), model.get_submodule(plan.head)
    tied = head.weight is embedding.weight
    parallelize_module(model, tp_mesh, outer_plan(plan))
    if tied:  # both are Shard(0) over the vocabulary: one parameter again
        head.weight = embedding.weight
    for block in blocks:
        parallelize_module(block, tp_mesh, block_plan(plan))
    if plan.positions:
        split_positions(model.get_submodule(plan.positions), tp_mesh)
    return plan


def split_positions(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """The GPT's position embedding, replicated over the group: its output ([seq, d]) split along the
    sequence (this rank's positions), to add to the sequence-split token embeddings."""
    def replicate(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
        for key, param in list(mod.named_parameters(recurse=False)):
            dt = distribute_tensor(param, mesh, [Replicate()], src_data_rank=None)
            mod.register_parameter(key, nn.Parameter(dt, requires_grad=param.requires_grad))

    def positions_in(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False) for t in inputs)

    def split_out(mod: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        return output.redistribute(mesh, [Shard(0)]).to_local()

    distribute_module(module, tp_mesh, replicate, positions_in, split_out)  # type: ignore[arg-type]

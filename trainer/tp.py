"""Tensor parallelism (``parallel.tp``): each family's plan, applied with DTensor before FSDP.

``apply_tp`` runs ``parallelize_module`` on the ``"tp"`` dimension of the device mesh (the innermost,
one node's consecutive ranks), first in ``trainer.parallelize`` (TP, then activation checkpointing,
compile, then ``fully_shard`` over the data-parallel dimensions, as torchtitan orders them). The plan
is keyed on module names, so a family built from the Llama modules (``wq wk wv wo``, ``w1 w2 w3``)
gets the Llama plan:

================================  ==============================================================
module                            placement
================================  ==============================================================
``tok_emb``                       row-wise (vocabulary split), input Replicate, output Shard(1):
                                  the residual stream is split along the sequence (SP)
norms (``attn_norm``, ...)        ``SequenceParallel``: weight Replicate, input/output Shard(1)
``attn`` / ``mlp`` inputs         ``PrepareModuleInput``: the sequence all-gathered (Replicate)
``wq wk wv`` / ``w1 w3``          column-wise: each rank ``n_heads / tp`` query heads, ``n_kv_heads
                                  / tp`` key/value heads, ``ffn_dim / tp`` hidden units
``wo`` / ``w2``                   row-wise, output reduce-scattered to Shard(1)
``head``                          column-wise, output Shard(-1) kept a DTensor: the loss runs under
                                  ``loss_parallel`` and never gathers the vocabulary
================================  ==============================================================

The GPT's attention has one fused ``qkv`` matrix whose rows are [q | k | v]: a column split would give
rank 0 all of q and none of v, so its attention is computed whole on each rank of the group (its
sequence gathered, its output split back along the sequence); its MLP (``fc`` column-wise, ``proj``
row-wise), embeddings, norms and head follow the Llama plan. A user model has no plan (refused at
``hpc.core.tensor_parallel``, and here).

Attention modules read their local head count from the projection's output (``view(b, s, -1, hd)``),
so the same forward serves every degree; the rotary cos/sin cover the whole sequence (the attention
input is gathered).
"""

from __future__ import annotations

import typing as tp

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hpc.core.errors import ConfigError

if tp.TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.tensor.parallel import ParallelStyle


def plan_kind(model: nn.Module, blocks: nn.ModuleList) -> str:
    """Which block plan the modules' names call for: ``separate`` (blocks with ``attn.wq wk wv wo`` and
    ``mlp.w1 w2 w3``: the Llama modules), ``fused`` (``attn.qkv``, ``mlp.fc``: the GPT's), or ``""``."""
    block = blocks[0] if len(blocks) else None
    if block is None or not hasattr(model, "tok_emb") or not hasattr(model, "head"):
        return ""
    if _has(block, "attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w2", "mlp.w3"):
        return "separate"
    if _has(block, "attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"):
        return "fused"
    return ""


def _has(module: nn.Module, *paths: str) -> bool:
    return all(_get(module, path) is not None for path in paths)


def _get(module: nn.Module, path: str) -> nn.Module | None:
    for part in path.split("."):
        module = getattr(module, part, None)  # type: ignore[assignment]
        if module is None:
            return None
    return module


def refuse_without_plan(model: nn.Module, blocks: nn.ModuleList, degree: int) -> str:
    """The model's plan kind (``plan_kind``), or ConfigError with the reason (a user model: refused above tp 1)."""
    kind = plan_kind(model, blocks)
    if not kind:
        raise ConfigError(f"`parallel.tp` = {degree} but {type(model).__name__} is not a built-in family: hpcx has no "
                          "tensor-parallel plan for it (which of its matrices split by rows or columns is the "
                          "model's own); use tp = 1")
    return kind


def outer_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """Embeddings, final norm and head (both families): vocabulary-split embedding into a sequence-split
    residual stream, head column-wise with DTensor logits for ``loss_parallel``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    plan: dict[str, ParallelStyle] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    for norm in ("norm", "ln_f"):
        if hasattr(model, norm):
            plan[norm] = SequenceParallel()
    return plan


def llama_block_plan() -> dict[str, ParallelStyle]:
    """One Llama block: attention q/k/v column-wise and o row-wise, MLP gate/up column-wise and down
    row-wise, the norms sequence-parallel; attention and MLP take the gathered sequence."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    return {
        "attn_norm": SequenceParallel(),
        "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)),
        "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
        "mlp_norm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(),
        "mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


def gpt_block_plan() -> dict[str, ParallelStyle]:
    """One GPT block: norms sequence-parallel, MLP fc column-wise and proj row-wise; the attention (one
    fused qkv matrix) computed whole on every rank of the group, its parameters plain (FSDP shards them
    over the data-parallel ranks), between a gathered input and an output split back along the sequence."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                                   RowwiseParallel, SequenceParallel)

    return {
        "ln1": SequenceParallel(),
        "attn": PrepareModuleInputOutput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                         use_local_input=True, output_layouts=(Replicate(),),
                                         desired_output_layouts=(Shard(1),), use_local_output=True),
        "ln2": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
    }


def apply_tp(model: nn.Module, blocks: nn.ModuleList, tp_mesh: DeviceMesh) -> str:
    """Shard ``model`` (on the meta device or allocated) over ``tp_mesh`` by its family's plan; returns
    the plan kind. A tied head keeps sharing the embedding's (row-split, Shard(0)) matrix."""
    from torch.distributed.tensor.parallel import parallelize_module

    kind = refuse_without_plan(model, blocks, tp_mesh.size())
    tied = getattr(model, "head").weight is getattr(model, "tok_emb").weight
    parallelize_module(model, tp_mesh, outer_plan(model))
    if tied:  # both are Shard(0) over the vocabulary: one parameter again
        model.head.weight = model.tok_emb.weight  # type: ignore[union-attr]
    plan = llama_block_plan() if kind == "separate" else gpt_block_plan()
    for block in blocks:
        parallelize_module(block, tp_mesh, plan)
    if hasattr(model, "pos_emb"):  # learned positions (the GPT's)
        split_positions(model.pos_emb, tp_mesh)  # type: ignore[arg-type]
    return kind


def split_positions(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """The GPT's position embedding, replicated over the group: its output ([seq, d]) split along the
    sequence (this rank's positions), to add to the sequence-split token embeddings."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor

    def replicate(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
        for key, param in list(mod.named_parameters(recurse=False)):
            dt = distribute_tensor(param, mesh, [Replicate()], src_data_rank=None)
            mod.register_parameter(key, nn.Parameter(dt, requires_grad=param.requires_grad))

    def positions_in(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False) for t in inputs)

    def split_out(mod: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        return output.redistribute(mesh, [Shard(0)]).to_local()

    distribute_module(module, tp_mesh, replicate, positions_in, split_out)  # type: ignore[arg-type]

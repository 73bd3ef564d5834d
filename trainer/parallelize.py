"""Parallelism as an ordered list of ``apply_*`` functions on a model and a device mesh.

``parallelize`` applies, in this order: tensor parallelism (``parallel.tp`` > 1: ``trainer.tp``, on
the mesh's ``"tp"`` dimension), activation checkpointing per block,
``torch.compile`` per block (optional), FSDP2 (fsdp/hsdp), the weights
(``WeightInit.materialize``: a model built on the meta device gets its memory and values
here), then DDP or DataParallel:

=============  ================================================================
``none``       the model as is (one process)
``dp``         ``nn.DataParallel`` (single process, several GPUs; kept for parity, use ddp)
``ddp``        ``DistributedDataParallel``
``fsdp``       FSDP2 ``fully_shard`` per block, on the model's ``fsdp_units()`` (the GPT's
               embeddings, and its final norm + head), then the root, on a 1-D mesh
               ``("dp_shard",)``: ``full_shard`` reshards parameters after forward,
               ``shard_grad_op`` keeps them unsharded until backward is done.
               ``no_shard`` (FSDP1's NO_SHARD is deprecated) is FSDP2 on a 2-D mesh
               ``(world, 1)``: every rank holds whole parameters and gradients are
               all-reduced, i.e. DDP semantics, while mixed precision, CPU offload, gradient
               sync control and DTensor state dicts stay the FSDP code path.
``hsdp``       the same ``fully_shard`` on a 2-D mesh ``("dp_replicate", "dp_shard")``:
               sharded within a group of ``dims.dp_shard`` ranks (one node by default),
               replicated across the ``dims.dp_replicate`` groups.
=============  ================================================================

With ``tp`` > 1 the mesh has a third, innermost dimension ``"tp"``; ``fully_shard`` takes the
data-parallel dimensions only (``dims.fsdp_dim_names``) and shards the TP-sharded DTensors again
over them (2-D parameters: a shard of a tensor-parallel slice).

Why materialization sits between FSDP and DDP: ``fully_shard`` on a meta model records each
rank's shard without allocating anything, so ``to_empty`` then allocates only the shard;
DDP and DataParallel broadcast and bucket real tensors, and each rank holds the whole replica
under them anyway, so they wrap the model after it has its weights. Without a ``WeightInit``,
a meta model stays on meta and ddp/dp are not wrapped (``hpcx dryrun``).
"""

from __future__ import annotations

import logging
import typing as tp
import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from hpc.compat import checkpoint_wrapper
from hpc.core.config import ConfigError
from hpc.core.dims import ParallelDims
from hpc.core.resolve import undecided
from hpc.core.spec import Parallel
from trainer.model import WeightInit, outer_units
from trainer.tp import apply_tp

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.core.models.tp_plan import TpPlan

log = logging.getLogger("hpcx.trainer")
DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh | None:
    """The data-parallel mesh of the layout (None for none/dp/ddp): ``dims.mesh_shape`` named
    ``dims.mesh_dim_names``; the world must be what the layout covers."""
    if dims.mesh_shape is None:
        return None
    return init_device_mesh(device_type, dims.mesh_shape, mesh_dim_names=dims.mesh_dim_names)


def mesh_groups(mesh: DeviceMesh) -> dict[str, list[list[int]]]:
    """For each mesh dimension, the rank groups that communicate along it (e.g. HSDP's shard groups)."""
    ranks = mesh.mesh
    groups = {}
    for dim, name in enumerate(mesh.mesh_dim_names or [str(d) for d in range(ranks.ndim)]):
        moved = ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim])
        groups[name] = moved.tolist()
    return groups


def parallelize(model: nn.Module, blocks: nn.ModuleList, parallel: Parallel, dims: ParallelDims,
                mesh: DeviceMesh | None, device: torch.device, init: WeightInit | None = None,
                preserve_rng: bool = True, tp_plan: TpPlan | None = None) -> nn.Module:
    """Activation checkpointing, compile, FSDP, the weights (``init``), then DDP/DataParallel; the
    model to train. The model may be on the meta device (give ``init``) or already on ``device``.
    ``parallel`` must be decided (``hpc.core.resolve.launch_parallel``, or ``decide_parallel`` without a
    launch); an `auto` left in it is refused. ``preserve_rng``: whether recomputed blocks must replay the
    RNG (``uses_rng``). ``tp_plan``: the model family's tensor-parallel plan (``parallel.tp`` > 1; none: refused)."""
    refuse_undecided(parallel)
    if dims.dp_enabled and parallel.compile:
        refuse_dp_compile(torch.cuda.device_count() if device.type == "cuda" else 0)
    if dims.tp_enabled:
        assert mesh is not None  # tp runs inside fsdp/hsdp (ParallelDims), which have a mesh
        apply_tp(model, blocks, mesh["tp"], tp_plan)
    if parallel.activation_checkpointing:
        apply_ac(blocks, preserve_rng)
    if parallel.compile:
        apply_compile(blocks)
    if dims.fsdp_enabled:
        assert mesh is not None  # build_mesh makes one for every FSDP strategy
        apply_fsdp(model, blocks, fsdp_mesh(mesh, dims), reshards(parallel, dims), parallel.mixed_precision,
                   parallel.cpu_offload, device)
    if init is not None:
        offloaded = dims.fsdp_enabled and parallel.cpu_offload
        init.materialize(model, device, torch.device("cpu") if offloaded else None)
    if on_meta(model) or dims.fsdp_enabled:
        return model
    model = model.to(device)
    if dims.ddp_enabled:
        return apply_ddp(model, device)
    if dims.dp_enabled:
        return apply_dp(model, DTYPES[parallel.mixed_precision])
    return model


def fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The data-parallel dimensions of the mesh (all of it without tp), which ``fully_shard`` takes."""
    names = dims.fsdp_dim_names
    if not dims.tp_enabled or names is None:
        return mesh
    return mesh[names if len(names) > 1 else names[0]]


def refuse_undecided(parallel: Parallel) -> None:
    """A programming error, not the user's: ``parallelize`` never decides an `auto` itself."""
    left = undecided(parallel)
    if left:
        raise ValueError(f"parallelize takes a decided Parallel, got {', '.join(left)} = 'auto': decide it "
                         "with hpc.core.resolve.launch_parallel (decide_parallel without a launch)")


def refuse_dp_compile(gpus: int) -> None:
    """dp + compile over several GPUs is refused (``hpc.resolve`` refuses it too): ``Module.compile``
    binds the compiled code to the original module, so DataParallel's replicas would run cuda:0's
    weights on the other GPUs' inputs."""
    if gpus > 1:
        raise ConfigError([f"`parallel.compile` = true with strategy 'dp' on {gpus} GPUs: DataParallel's replicas "
                           "would run the compiled cuda:0 module; use strategy 'ddp' (or compile = false)"])


def on_meta(model: nn.Module) -> bool:
    """Whether the model's parameters are still on the meta device (not materialized)."""
    return any(p.is_meta for p in model.parameters())


def block_features(parallel: Parallel, dims: ParallelDims) -> list[str]:
    """The features asked for that work block by block (so need the model's ``blocks``): tensor
    parallelism, activation checkpointing, compile and FSDP's per-block units. Under none, dp or ddp
    without them a model needs no ``blocks`` attribute."""
    asked = [("parallel.tp", dims.tp_enabled), ("parallel.activation_checkpointing", parallel.activation_checkpointing),
             ("parallel.compile", parallel.compile), (f"strategy {parallel.strategy!r} (an FSDP unit per block)",
                                                      dims.fsdp_enabled)]
    return [name for name, on in asked if on]


def blocks_for(task_blocks: tp.Callable[[nn.Module], nn.ModuleList], model: nn.Module, parallel: Parallel,
               dims: ParallelDims) -> nn.ModuleList:
    """``task_blocks(model)`` where a feature needs the blocks (``block_features``), else an empty list;
    a model without them is refused in one line naming the feature that needs them."""
    needed = block_features(parallel, dims)
    if not needed:
        return nn.ModuleList()
    try:
        return task_blocks(model)
    except ConfigError as exc:
        raise ConfigError([f"{exc.messages[0]}; needed by {', '.join(needed)}"]) from None


def uses_rng(dropout: float, blocks: nn.ModuleList, user_model: bool) -> bool:
    """Whether a block's forward draws random numbers (so a recomputation must replay the RNG): the
    spec's dropout, an ``nn.Dropout`` with p > 0 inside a block, or a user model (its code is unknown)."""
    drops = any(isinstance(m, DROPOUTS) and m.p > 0 for m in blocks.modules())
    return dropout > 0 or drops or user_model


def apply_ac(blocks: nn.ModuleList, preserve_rng: bool = True) -> None:
    """Recompute each block's activations in backward (non-reentrant). With ``preserve_rng`` the RNG
    state is saved and replayed, so dropout agrees; without (no dropout) that stash, and the device
    sync it costs on CUDA, is skipped (torchtitan's ``preserve_rng_state`` switch).

    The wrapper inserts ``_checkpoint_wrapped_module`` into parameter names; the
    ``torch.distributed.checkpoint.state_dict`` helpers strip it, so checkpoints do not depend on it.
    """
    wrap = checkpoint_wrapper()  # torch's private wrapper, reached in one place (hpc.compat)
    for i, block in enumerate(blocks):
        blocks[i] = wrap(block, preserve_rng_state=preserve_rng)


def apply_compile(blocks: nn.ModuleList) -> None:
    """``torch.compile`` each block in place (``Module.compile`` keeps parameter names unchanged)."""
    for block in blocks:
        block.compile()


def apply_fsdp(model: nn.Module, blocks: nn.ModuleList, mesh: DeviceMesh, reshard_after_forward: bool,
               mixed_precision: str, cpu_offload: bool, device: torch.device) -> nn.Module:
    """FSDP2 ``fully_shard`` on each unit of ``fsdp_units``, then on the root; 1-D mesh = FSDP, 2-D = HSDP.

    The model is on the meta device (nothing is allocated: each parameter becomes a DTensor of this
    rank's shard) or already on ``device``; it is never moved whole to the device first.
    """
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[mixed_precision], reduce_dtype=torch.float32)
    # pin_memory needs CUDA: CPUOffloadPolicy() fails on CPU-only hosts.
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    units = fsdp_units(model, blocks)
    for unit, reshard in zip(units[:-1], unit_reshard(len(blocks), len(units) - 1, reshard_after_forward)):
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, reshard_after_forward=reshard, mp_policy=mp,
                    offload_policy=offload)
    # Root: FSDP2's default (None) keeps whatever is left in it unsharded after forward, since
    # backward needs it at once; resharding it would cost a second all-gather per step.
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    return model


def fsdp_units(model: nn.Module, blocks: nn.ModuleList) -> list[list[nn.Module]]:
    """The FSDP units in the order ``apply_fsdp`` wraps them: each block, the model's ``fsdp_units()``
    groups (torchtitan wraps embeddings and norm + output the same way), and last the root, which
    takes every parameter not in another unit."""
    return [[block] for block in blocks] + outer_units(model) + [[model]]


def unit_reshard(n_blocks: int, n_units: int, reshard_after_forward: bool) -> list[bool]:
    """reshard_after_forward of each non-root unit: the layout's for blocks and outer units, except
    the last outer unit (the output side), which backward needs first: FSDP would gather it again
    at once (torchtitan's default for norm + output)."""
    flags = [reshard_after_forward] * n_units
    if n_units > n_blocks:
        flags[-1] = False
    return flags


def apply_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """DistributedDataParallel over the default process group."""
    device_ids = [device.index] if device.type == "cuda" else None
    # gradients live in the all-reduce buckets: no second full copy of the gradients
    return DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)


def apply_dp(model: nn.Module, amp_dtype: torch.dtype | None = None) -> nn.Module:
    """``nn.DataParallel`` (one process driving every visible GPU; ``AutocastDataParallel`` so its
    threads compute in ``amp_dtype``), with a warning pointing to DDP."""
    warnings.warn("parallel.strategy = 'dp' uses nn.DataParallel: one process, a Python thread per GPU and "
                  "a model copy every step; it is slower than DDP even on one node. Use strategy = 'ddp'.",
                  stacklevel=2)
    log.warning("strategy 'dp' (nn.DataParallel) is kept for parity only: use 'ddp'")
    return AutocastDataParallel(model, amp_dtype)


class AutocastDataParallel(nn.DataParallel):
    """DataParallel whose worker threads autocast to the loop's dtype.

    Autocast's dtype is per thread: DataParallel's workers enter ``autocast(enabled=...)`` without a
    dtype, so under the loop's bf16 autocast they compute in the thread default (fp16 on CUDA), with
    no scaler. Each replica runs inside ``autocast(dtype=amp_dtype)`` here; parameter names are
    DataParallel's own (``module.…``)."""

    def __init__(self, module: nn.Module, amp_dtype: torch.dtype | None = None) -> None:
        super().__init__(module)
        self.amp_dtype = amp_dtype

    def parallel_apply(self, replicas: tp.Sequence[nn.Module], inputs: tp.Sequence[tp.Any],
                       kwargs: tp.Any) -> list[tp.Any]:
        """DataParallel's own, each replica wrapped in ``AutocastReplica``."""
        if self.amp_dtype is not None:
            replicas = [AutocastReplica(r, self.amp_dtype) for r in replicas]
        return super().parallel_apply(replicas, inputs, kwargs)


class AutocastReplica(nn.Module):
    """One replica run inside ``autocast(device, dtype)`` in whatever thread calls it."""

    def __init__(self, replica: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.replica, self.dtype = replica, dtype

    def forward(self, *args: tp.Any, **kwargs: tp.Any) -> tp.Any:
        """The replica's forward under ``autocast`` of its inputs' device type."""
        device = next((t.device.type for t in args if isinstance(t, torch.Tensor)), "cuda")
        with torch.autocast(device, dtype=self.dtype):
            return self.replica(*args, **kwargs)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """FSDP2 on inner micro-steps: skip HSDP's all-reduce across replicas, keep the reduce-scatter.

    Turning FSDP2's whole gradient sync off (``set_requires_gradient_sync(False)``) would make
    every rank accumulate *unsharded* gradients (4 bytes per parameter: 52 GB for a 13B model),
    which defeats sharding; reduce-scattering each micro-batch keeps gradients sharded, and only
    the cross-replica all-reduce (the inter-node traffic of HSDP) waits for the last micro-step.
    This is what the planner's memory and communication figures assume.
    """
    if isinstance(model, FSDPModule):
        model.set_requires_all_reduce(enabled)


def reshards(parallel: Parallel, dims: ParallelDims) -> bool:
    """FSDP2's ``reshard_after_forward`` for the blocks: the sharding's (full_shard frees after forward), unless
    ``parallel.reshard_after_forward`` = false keeps every unit gathered."""
    return dims.reshard_after_forward and getattr(parallel, "reshard_after_forward", True)


def set_reshard_after_backward(model: nn.Module, last: bool) -> None:
    """``parallel.reshard_after_forward`` = false: FSDP2 frees the gathered units after the step's last backward
    only; on the micro-batches before it they stay gathered, so the next forward and backward gather nothing."""
    if isinstance(model, FSDPModule):
        model.set_reshard_after_backward(last)


def autocast_dtype(parallel: Parallel, dims: ParallelDims) -> torch.dtype | None:
    """Non-FSDP strategies get mixed precision from autocast; FSDP2 casts through its policy."""
    return None if dims.fsdp_enabled else DTYPES[parallel.mixed_precision]

"""The optimizer (``[optim]``: any ``torch.optim`` one, AdamW by default), the learning-rate schedules
(``train.schedule``, each after a linear warm-up), and gradient clipping that is exact across shards."""

from __future__ import annotations

import logging
import math
import typing as tp
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from hpc import compat
from hpc.core.errors import ConfigError
from hpc.core.optim import DEFAULT, SIGNATURES, Optim, canonical
from hpc.core.spec import Train

log = logging.getLogger("hpcx.trainer")


def build_optimizer(model: nn.Module, train: Train, sharded_scaler: bool = False,
                    optim: Optim | None = None) -> torch.optim.Optimizer:
    """``optim.name`` (``torch.optim``; AdamW by default) with ``optim.kwargs``, at ``train.lr``; weight decay
    on matrices only (embeddings and linear weights), not on norms and biases, whatever the optimizer.
    AdamW's weight decay and betas are ``train.weight_decay`` and ``train.betas``.

    AdamW takes the fused kernel (one pass over each tensor, CPU and GPU alike) where torch has one for the
    parameters (unless ``optim.kwargs.fused`` says otherwise); else the default multi-tensor one. On CPU,
    and so with CPU offload, fused takes a fraction of the time (bench/optimizer_step prints the ratio);
    both follow the same update rule. With ``sharded_scaler`` (fp16 under FSDP: ``ShardedGradScaler``) the
    multi-tensor one: that scaler hands the optimizer a ``found_inf`` of shape [1], which the fused step
    cannot broadcast into its step counters (torch 2.13: "output with shape [] doesn't match the broadcast
    shape [1]"). A value torch refuses (``momentum=-1``) is a ConfigError naming the key's section.
    """
    optim = optim or Optim()
    name = canonical(optim.name) or DEFAULT
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in optim.kwargs.items()}
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    if name == DEFAULT:
        kwargs.update(betas=(train.betas[0], train.betas[1]), weight_decay=train.weight_decay)
        kwargs.setdefault("fused", adamw_fused(decay + no_decay, sharded_scaler))
    weight_decay = kwargs.pop("weight_decay", SIGNATURES[name].get("weight_decay", 0))
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if "weight_decay" not in SIGNATURES[name]:  # Rprop: no weight decay to split
        groups = [{"params": decay + no_decay}]
    try:
        return getattr(torch.optim, name)(groups, lr=train.lr, **kwargs)
    except (ValueError, TypeError) as exc:
        raise ConfigError([f"`optim.kwargs` = {optim.kwargs!r}: torch.optim.{name} refused them: {exc}"]) from None


def adamw_fused(parameters: list[nn.Parameter], sharded_scaler: bool) -> bool:
    """Whether AdamW takes its fused kernel (see ``build_optimizer``), saying so in the log when not."""
    if sharded_scaler:
        log.info("AdamW: the multi-tensor kernel (the fused one fails under fp16's ShardedGradScaler)")
        return False
    if not fused_supported(parameters):
        log.info("AdamW: no fused kernel for these parameters (devices %s), using the multi-tensor one",
                 sorted({p.device.type for p in parameters}))
        return False
    return True


FUSED_DEVICES = ("cuda", "cpu")  # where torch's fused AdamW kernel takes every floating dtype


def fused_supported(parameters: list[nn.Parameter]) -> bool:
    """Whether the fused AdamW kernel takes all of ``parameters`` (real floating point, CPU or CUDA).

    Checked here because torch only checks when the first step runs."""
    return bool(parameters) and all(p.is_floating_point() and p.device.type in FUSED_DEVICES for p in parameters)


def lr_factor(step: int, train: Train, optim: Optim | None = None) -> float:
    """Multiplier of ``train.lr`` at optimizer step ``step`` (0-based): linear warm-up over
    ``train.warmup_steps``, then ``train.schedule`` (``onecycle``: its own cosine rise instead)."""
    optim = optim or Optim()
    if train.schedule == "onecycle":
        return onecycle_factor(step, train, optim)
    if step < train.warmup_steps:
        return (step + 1) / train.warmup_steps
    if train.schedule == "constant":
        return 1.0
    if train.schedule == "step":
        return optim.gamma ** (step // optim.step_size)
    if train.schedule == "multistep":
        return optim.gamma ** sum(1 for m in optim.milestones if step >= m)
    return decayed(train.min_lr_ratio, train.schedule, decay_progress(step, train.warmup_steps, train.steps))


def decay_progress(step: int, start: int, steps: int) -> float:
    """How far ``step`` is from ``start`` (0) to the last step ``steps - 1`` (1)."""
    return min(1.0, (step - start) / max(1, steps - start - 1))


def decayed(floor: float, shape: str, progress: float) -> float:
    """From 1 at ``progress`` 0 down to ``floor`` at 1: straight (``linear``) or along a half cosine."""
    remaining = 1.0 - progress if shape == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (1.0 - floor) * remaining


def onecycle_factor(step: int, train: Train, optim: Optim) -> float:
    """torch's OneCycleLR on the learning rate (its momentum cycle is not made), step for step: from
    ``1 / div_factor`` up to 1 at step ``rise - 1`` (``rise``: ``train.warmup_steps``, 0: 30% of the steps,
    torch's ``pct_start``), then down to ``min_lr_ratio`` at the last step, both halves along a cosine."""
    rise = train.warmup_steps or max(1, int(0.3 * train.steps))
    peak = float(rise - 1)  # torch: step_size_up = pct_start * total_steps - 1
    if step <= peak:
        return _anneal(1.0 / optim.div_factor, 1.0, step / peak if peak > 0 else 1.0)
    return _anneal(1.0, train.min_lr_ratio, min(1.0, (step - peak) / max(1.0, train.steps - 1 - peak)))


def _anneal(start: float, end: float, pct: float) -> float:
    """From ``start`` (``pct`` 0) to ``end`` (1) along a half cosine (torch's ``_annealing_cos``)."""
    return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)


def build_scheduler(optimizer: torch.optim.Optimizer, train: Train,
                    optim: Optim | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over ``lr_factor``; its state_dict is just the step count, so it checkpoints trivially."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, train, optim))


def grad_norm(parameters: list[nn.Parameter]) -> torch.Tensor:
    """The global L2 norm of all gradients (fp64 result, on the gradients' device), whatever the sharding.

    Plain tensors (none/dp/ddp: every rank holds the whole reduced gradient) count once.
    DTensor gradients (FSDP/HSDP) contribute the squared norms of their local shards, all-reduced
    over the mesh dimensions where they are sharded only — replicated dimensions hold copies, and a
    shard dimension of size 1 (no_shard, HSDP with one rank per shard group) needs no all-reduce.
    Each tensor's (or shard's) norm is taken in fp32 and the squares are summed in fp64, so the
    total does not depend on how tensors are split or on the order of the sums across ranks.
    The squares are summed where the gradients are; under CPU offload on NCCL they are all-reduced
    on gloo groups of the host (``open_host_groups``), so no step waits for a trip through the GPU.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    device = _local(grads[0]).device
    total = _sum_of_squares([g.detach() for g in grads if not isinstance(g, DTensor)], device)
    for (mesh, dims), group in _by_shard_dims(g for g in grads if isinstance(g, DTensor)).items():
        squares = _sum_of_squares([g.to_local().detach() for g in group], device)
        total = total + _all_reduced(squares, mesh, [d for d in dims if mesh.size(d) > 1])
    return total.sqrt()


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _all_reduced(squares: torch.Tensor, mesh: DeviceMesh, dims: list[int]) -> torch.Tensor:
    """``squares`` summed over the mesh dimensions ``dims``, back on its own device: on the host's gloo
    groups where ``open_host_groups`` made them (offloaded gradients on NCCL), else on the mesh's own."""
    if not dims:
        return squares
    host = [_HOST_GROUPS.get(_mesh_dim_key(mesh, d)) for d in dims]
    if squares.device.type == "cpu" and all(g is not None for g in host):
        for group in host:
            dist.all_reduce(squares, group=group)
        return squares
    comm = squares.to(_comm_device(mesh))
    for dim in dims:
        dist.all_reduce(comm, group=mesh.get_group(dim))
    return comm.to(squares.device)


# per process by nature: subgroups of torch's process-wide default group, made collectively, dropped by shutdown
_HOST_GROUPS: dict[tuple, dist.ProcessGroup] = {}  # (mesh ranks, dim) -> this rank's gloo group along dim


def _mesh_dim_key(mesh: DeviceMesh, dim: int) -> tuple:
    return tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()), dim


def open_host_groups(mesh: DeviceMesh | None) -> None:
    """Under CPU offload on NCCL: a gloo group along each mesh dimension of more than one rank, so that the
    norm of gradients held on the host is all-reduced on the host (no blocking trip through the GPU and
    back every step). Collective: every rank, in the same order, before the first step."""
    if mesh is None or mesh.device_type != "cuda":
        return
    for dim in range(mesh.ndim):
        key = _mesh_dim_key(mesh, dim)
        if mesh.size(dim) > 1 and key not in _HOST_GROUPS:
            ranks = mesh.mesh.movedim(dim, -1).reshape(-1, mesh.size(dim)).tolist()
            _HOST_GROUPS[key] = dist.new_subgroups_by_enumeration(ranks, backend="gloo")[0]


def forget_host_groups() -> None:
    """Drop the host groups (``trainer.dist.shutdown``: they die with the process group)."""
    _HOST_GROUPS.clear()


def _comm_device(mesh: DeviceMesh) -> torch.device:
    """Where the mesh's collectives run: gradients offloaded to the CPU still reduce on the GPU under NCCL."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = compat.foreach_norm(tensors)  # what clip_grad_norm_ uses: one fused pass per device/dtype
    return torch.stack([n.to(device) for n in norms]).double().square().sum()


def _by_shard_dims(grads: tp.Iterable[DTensor]) -> dict:
    groups: dict = defaultdict(list)
    for g in grads:
        dims = tuple(i for i, p in enumerate(g.placements) if isinstance(p, Shard) or compat.is_strided_shard(p))
        groups[(g.device_mesh, dims)].append(g)
    return groups


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm`` (0: off); returns the norm before
    (a tensor: reading it is left to logging steps, so a GPU step does not wait for it)."""
    norm = grad_norm(parameters)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for (device, dtype), grads in grads_by_device_and_dtype(parameters).items():
            compat.foreach_mul_(grads, coef.to(dtype=dtype, device=device))  # one launch per group
    return norm


def grads_by_device_and_dtype(parameters: list[nn.Parameter]) -> dict[tuple[torch.device, torch.dtype], list]:
    """The local gradients (a DTensor's shard) grouped by (device, dtype), for one foreach call each."""
    groups: dict = defaultdict(list)
    for p in parameters:
        if p.grad is not None:
            local = _local(p.grad)
            groups[(local.device, local.dtype)].append(local)
    return dict(groups)

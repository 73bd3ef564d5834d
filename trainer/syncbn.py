"""``task.sync_batchnorm``: every BatchNorm of a task's model normalizes over the global batch.

``convert`` swaps each ``nn.BatchNorm*d`` for torch's ``nn.SyncBatchNorm`` (same parameters, buffers
and state-dict keys), on the meta model before it is parallelized: under ddp, fsdp and hsdp every
rank's batch statistics are then the mean and variance of all ranks' samples together, so every
rank's running statistics stay equal (and a checkpoint's ``buffers.rank<R>`` copies agree).

torch's SyncBatchNorm runs on GPUs only: on CPU tensors its forward raises ("SyncBatchNorm expected
input tensor to be on GPU ..."; its kernels ``batch_norm_stats`` and ``batch_norm_gather_stats`` have
no CPU implementation in torch 2.13), and DDP refuses to wrap a CPU module holding one ("SyncBatchNorm
layers only work with GPU modules"). So on a GPU the modules are torch's ``nn.SyncBatchNorm``, and for a
CPU (gloo) run ``HostSyncBatchNorm``, a BatchNorm (not a ``SyncBatchNorm``, which DDP would refuse) whose
training forward does the same arithmetic in plain torch: per-channel sum, sum of squares and
count, one differentiable all-reduce (``torch.distributed.nn.functional.all_reduce``, whose backward
all-reduces the gradients as torch's SyncBatchNorm backward does), then normalization and the
running-statistics update BatchNorm makes (unbiased variance, ``momentum`` or the cumulative mean).
Statistics are summed in float64. In eval mode, or without a process group of more than one rank,
both fall back to plain ``batch_norm`` on the running statistics.
"""

from __future__ import annotations

import typing as tp

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_reduce

from hpc.core.errors import ConfigError


class HostSyncBatchNorm(nn.BatchNorm1d):  # public base; _check_input_dim below takes any dims
    """SyncBatchNorm's arithmetic for CPU tensors (see the module docstring); made from torch's
    ``nn.SyncBatchNorm`` by ``convert`` (its attributes, ``process_group`` included, are this class's)."""

    process_group: tp.Any = None

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # torch's own argument name (a keyword caller may use it)
        if not self._synchronizes():
            return super().forward(input)
        self._check_input_dim(input)
        mean, var, count = self._global_stats(input)
        if self.track_running_stats:
            self._update_running(mean.detach(), var.detach(), count)
        shape = [1, input.size(1)] + [1] * (input.dim() - 2)
        out = ((input.double() - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)).to(input.dtype)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out

    def _synchronizes(self) -> bool:
        """Training on batch statistics, with more than one rank in the group (as torch's own decides)."""
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        if not (self.training and batch_stats and dist.is_available() and dist.is_initialized()):
            return False
        return dist.get_world_size(self.process_group or dist.group.WORLD) > 1

    def _global_stats(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mean, biased variance, sample count) per channel over every rank's batch, float64, differentiable."""
        channels, dims = x.size(1), [0, *range(2, x.dim())]
        wide = x.double()
        count = torch.full((1,), x.numel() // channels, dtype=torch.float64)
        local = torch.cat([wide.sum(dims), wide.square().sum(dims), count])
        total = all_reduce(local, group=self.process_group or dist.group.WORLD)
        n = total[-1]
        mean = total[:channels] / n
        return mean, total[channels:2 * channels] / n - mean.square(), n

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, n: torch.Tensor) -> None:
        assert self.num_batches_tracked is not None and self.running_mean is not None and self.running_var is not None
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = var * n / (n - 1).clamp(min=1)
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
        self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)


def convert(model: nn.Module, target: str, device_type: str) -> nn.Module:
    """``model`` with each BatchNorm torch's ``nn.SyncBatchNorm`` (in place below the root), a
    ``HostSyncBatchNorm`` where the model trains on ``device_type`` "cpu"; ConfigError when it has none
    (``task.sync_batchnorm`` would change nothing)."""
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    found = [m for m in model.modules() if isinstance(m, nn.SyncBatchNorm)]
    if not found:
        raise ConfigError([f"`task.sync_batchnorm` = true, but the model of {target!r} has no BatchNorm layer: "
                           "remove it"])
    if device_type == "cpu":
        for module in tp.cast(list[nn.Module], found):
            module.__class__ = HostSyncBatchNorm  # same attributes and state; a BatchNorm DDP wraps on CPU
    return model

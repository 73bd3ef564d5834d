"""The training loss: the mean cross-entropy of next-token prediction, over every target token, or
— with a loss mask (``hpcx data prepare --format prompt-response``) — over the response tokens only.

A masked mean must not depend on how the global batch is cut into ranks and micro-batches, so it
is the sum of the counted tokens' losses over the count in the whole global batch: each rank
scales its sum by ``world_size / count`` (gradients are averaged over ranks), and the count is
one all-reduce per step. The count stays on the device (summed from the masks already copied there,
reduced there, and used as a tensor scale), so a masked step waits for the GPU no more than an
unmasked one.
"""

from __future__ import annotations

import contextlib
import typing as tp

import torch
import torch.distributed as dist
import torch.nn.functional as F

Batch = tp.Union[torch.Tensor, tp.Sequence[torch.Tensor]]


def split_batch(batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tokens, loss mask or None): a masked dataset yields ``(tokens, mask)`` pairs."""
    if isinstance(batch, torch.Tensor):
        return batch, None
    tokens, mask = batch
    return tokens, mask


def to_device(batch: Batch, device: torch.device) -> Batch:
    """A micro-batch on ``device``: tokens and mask each copied without waiting (from the loader's
    pinned memory on CUDA)."""
    tokens, mask = split_batch(batch)
    tokens = tokens.to(device, non_blocking=True)
    return tokens if mask is None else (tokens, mask.to(device, non_blocking=True))


def counted_targets(micro_batches: tp.Sequence[Batch], world_size: int) -> torch.Tensor | None:
    """Targets the loss counts in the whole global batch (None without a mask): this rank's
    micro-batches, summed over ranks; an int64 tensor on the masks' device, never read by the host."""
    masks = [split_batch(b)[1] for b in micro_batches]
    if masks[0] is None:
        return None
    count = torch.stack([m[:, 1:].sum(dtype=torch.int64) for m in masks if m is not None]).sum()
    if world_size > 1 and dist.is_initialized():
        dist.all_reduce(count)
    return count


def loss_context(logits: torch.Tensor) -> tp.ContextManager:
    """Where the loss and its backward run: ``loss_parallel`` when the logits are a DTensor split over
    the vocabulary (``parallel.tp`` > 1, ``trainer.tp``: each rank's log-softmax reduces its own columns
    and exchanges one max and one sum per token, never the vocabulary), else nothing."""
    from torch.distributed.tensor import DTensor

    if not isinstance(logits, DTensor):
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def _local(loss: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor loss (``loss_parallel``) as this rank's plain tensor; the backward stays DTensor."""
    to_local = getattr(loss, "to_local", None)
    return to_local() if to_local is not None else loss


def token_losses(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Per-target cross-entropy in fp32, shaped like ``tokens[:, 1:]``."""
    flat = _local(F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten(), reduction="none"))
    return flat.view(tokens.shape[0], -1)


def micro_loss(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor | None,
               scale: float | torch.Tensor) -> torch.Tensor:
    """The loss to back-propagate for one micro-batch: mean × ``scale`` (1/micro-steps) without a mask;
    with one, the counted targets' sum × ``scale`` (world_size / global count)."""
    if mask is None:
        loss = _local(F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()))
    else:
        loss = (token_losses(logits, tokens) * mask[:, 1:].to(logits.device, torch.float32)).sum()
    return loss if isinstance(scale, float) and scale == 1.0 else loss * scale


def masked_scale(count: torch.Tensor | int, world_size: int) -> torch.Tensor:
    """``world_size / count`` as a float32 tensor beside ``count``: after the ranks' gradients are
    averaged, the sum over counted targets of the whole batch divided by their number (a batch with
    none counts nothing)."""
    count = torch.as_tensor(count)
    return (world_size / count.clamp(min=1).to(torch.float64)).to(torch.float32)

"""The training loss: the mean cross-entropy of next-token prediction, over every target token, or
— with a loss mask (``hpcx data prepare --format prompt-response``) — over the response tokens only.

A masked mean must not depend on how the global batch is cut into ranks and micro-batches, so it
is the sum of the counted tokens' losses over the count in the whole global batch: each rank
scales its sum by ``world_size / count`` (gradients are averaged over ranks), and the count is
one all-reduce per step of a number the loader already holds on the host.
"""

from __future__ import annotations

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


def counted_targets(micro_batches: tp.Sequence[Batch], world_size: int) -> int | None:
    """Targets the loss counts in the whole global batch (None without a mask): this rank's
    micro-batches, summed over ranks."""
    masks = [split_batch(b)[1] for b in micro_batches]
    if masks[0] is None:
        return None
    count = torch.tensor([sum(int(m[:, 1:].sum()) for m in masks if m is not None)], dtype=torch.int64)
    if world_size > 1 and dist.is_initialized():
        if dist.get_backend() == "nccl":
            count = count.cuda()
        dist.all_reduce(count)
    return int(count.item())


def token_losses(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Per-target cross-entropy in fp32, shaped like ``tokens[:, 1:]``."""
    flat = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
    return flat.view(tokens.shape[0], -1)


def micro_loss(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """The loss to back-propagate for one micro-batch: mean × ``scale`` (1/micro-steps) without a mask;
    with one, the counted targets' sum × ``scale`` (world_size / global count)."""
    if mask is None:
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    else:
        loss = (token_losses(logits, tokens) * mask[:, 1:].to(logits.device, torch.float32)).sum()
    return loss * scale if scale != 1.0 else loss


def masked_scale(count: int, world_size: int) -> float:
    """``world_size / count``: after the ranks' gradients are averaged, the sum over counted targets
    of the whole batch divided by their number (a batch with none counts nothing)."""
    return world_size / max(1, count)

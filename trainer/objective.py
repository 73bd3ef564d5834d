"""The training loss: the mean cross-entropy of next-token prediction, over every target token, or
— with a loss mask (``hpcx data prepare --format prompt-response``) — over the response tokens only.

A masked mean must not depend on how the global batch is cut into ranks and micro-batches, so it
is the sum of the counted tokens' losses over the count in the whole global batch: each rank
scales its sum by ``world_size / count`` (gradients are averaged over ranks), and the count is
one all-reduce per step. The count stays on the device (summed from the masks already copied there,
reduced there, and used as a tensor scale), so a masked step waits for the GPU no more than an
unmasked one.

With document packing (``data.packing = "document"``) a batch is ``(tokens, mask, documents)``: each
position's document number rides along for the model's mask, and the mask already leaves out every
target whose input is another document's token (``document_targets``), so the mean is per counted token
of whole documents, as if each ran alone.
"""

from __future__ import annotations

import contextlib
import typing as tp

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from hpc.core.models.decoder import loss_chunk_tokens

Batch = tp.Union[torch.Tensor, tp.Sequence[torch.Tensor]]


def split_batch(batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tokens, loss mask or None): a masked dataset yields ``(tokens, mask)`` pairs (and a packed one
    ``(tokens, mask, documents)``: ``batch_documents``)."""
    if isinstance(batch, torch.Tensor):
        return batch, None
    return batch[0], batch[1]


def batch_documents(batch: Batch) -> torch.Tensor | None:
    """Each position's document number [batch, seq + 1] of a packed batch; None otherwise."""
    return batch[2] if not isinstance(batch, torch.Tensor) and len(batch) == 3 else None


def document_targets(mask: torch.Tensor | None, documents: torch.Tensor) -> torch.Tensor:
    """The loss mask of a packed window: a target counts where ``mask`` (None: all) counts it and its
    input is a token of the same document (a window's first token is no target)."""
    same = torch.zeros_like(documents, dtype=torch.bool)
    same[..., 1:] = documents[..., 1:] == documents[..., :-1]
    return same if mask is None else same & mask.to(torch.bool)


def to_device(batch: Batch, device: torch.device) -> Batch:
    """A micro-batch on ``device``: tokens, mask (and document numbers) each copied without waiting
    (from the loader's pinned memory on CUDA)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    return tuple(t.to(device, non_blocking=True) for t in batch)


def counted_targets(micro_batches: tp.Sequence[Batch], world_size: int, tp_degree: int = 1) -> torch.Tensor | None:
    """Targets the loss counts in the whole global batch (None without a mask): this rank's
    micro-batches, summed over the data-parallel ranks (``sum_over_data``); an int64 tensor on the masks'
    device, never read by the host."""
    masks = [split_batch(b)[1] for b in micro_batches]
    if masks[0] is None:
        return None
    count = torch.stack([m[:, 1:].sum(dtype=torch.int64) for m in masks if m is not None]).sum()
    return sum_over_data(count, world_size, tp_degree)


def padding_tokens(micro_batches: tp.Sequence[Batch], pad_id: int, world_size: int, tp_degree: int = 1) -> torch.Tensor:
    """Pad tokens among the inputs of the whole global batch (``hpcx data prepare --window`` pads each
    window's end with ``pad_id`` under a zero loss mask): each sample's trailing run of such tokens,
    summed over the data-parallel ranks; an int64 tensor on the device, read by the host only with the
    metrics line's values."""
    total = torch.zeros((), dtype=torch.int64)
    for batch in micro_batches:
        tokens, mask = split_batch(batch)
        inputs = tokens[:, :-1]
        pad = inputs == pad_id if mask is None else (inputs == pad_id) & ~mask[:, :-1].to(torch.bool)
        total = total.to(pad.device) + pad.flip(1).to(torch.int64).cumprod(1).sum()
    return sum_over_data(total, world_size, tp_degree)


def sum_over_data(value: torch.Tensor, world_size: int, tp_degree: int) -> torch.Tensor:
    """``value`` summed over the data-parallel ranks, in one all-reduce over the world: the ``tp_degree``
    ranks of a tensor-parallel group hold the same batch (and, under ``loss_parallel``, the same
    losses), so only the group's first rank (tp is the innermost mesh dimension) adds its value; the
    others add zeros, and the sum is the true one, not ``tp`` times it."""
    if world_size <= 1 or not dist.is_initialized():
        return value
    if tp_degree > 1 and dist.get_rank() % tp_degree:
        value = torch.zeros_like(value)
    dist.all_reduce(value)
    return value


class ChunkedCrossEntropy(torch.autograd.Function):
    """Per-target fp32 cross-entropy of ``logits`` [N, V] (any dtype) against ``targets`` [N], over
    chunks of ``chunk`` rows: forward keeps no fp32 copy (only the logits it is given, which the loop
    holds anyway), backward recomputes each chunk's fp32 log-softmax and writes its gradient into
    one buffer of the logits' dtype. Each row is computed by the same ``F.cross_entropy`` as the whole
    batch would be, so the values and gradients are those of the unchunked loss."""

    @staticmethod
    def forward(ctx: tp.Any, logits: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        losses = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for start in range(0, logits.shape[0], chunk):
            rows = slice(start, start + chunk)
            losses[rows] = F.cross_entropy(logits[rows].float(), targets[rows], reduction="none")
        ctx.save_for_backward(logits, targets)
        ctx.chunk = chunk
        return losses

    @staticmethod
    def backward(ctx: tp.Any, grad_losses: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, targets = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            with torch.enable_grad():
                part = logits[rows].detach().requires_grad_(True)
                loss = F.cross_entropy(part.float(), targets[rows], reduction="none")
                (grad[rows],) = torch.autograd.grad(loss, part, grad_losses[rows])
        return grad, None, None


def chunked_token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-target fp32 cross-entropy of flat ``logits`` [N, V] against ``targets`` [N] in chunks of
    ``hpc.core.models.decoder.LOSS_CHUNK_LOGITS`` logits (``ChunkedCrossEntropy``)."""
    return ChunkedCrossEntropy.apply(logits, targets, loss_chunk_tokens(logits.shape[0], logits.shape[-1]))


def loss_context(logits: torch.Tensor) -> tp.ContextManager:
    """Where the loss and its backward run: ``loss_parallel`` when the logits are a DTensor split over
    the vocabulary (``parallel.tp`` > 1, ``trainer.tp``: each rank's log-softmax reduces its own columns
    and exchanges one max and one sum per token, never the vocabulary), else nothing."""
    if not isinstance(logits, DTensor):
        return contextlib.nullcontext()
    return loss_parallel()


def tp_loss_context(tp_enabled: bool) -> tp.ContextManager:
    """``loss_parallel`` around a micro-batch's loss and backward when the model is tensor-parallel (its
    logits a DTensor split over the vocabulary), else nothing: the loop's side of ``loss_context``."""
    if not tp_enabled:
        return contextlib.nullcontext()
    return loss_parallel()


def is_dtensor(x: torch.Tensor) -> bool:
    """Whether ``x`` is a DTensor (the logits of a tensor-parallel model)."""
    return isinstance(x, DTensor)


def _local(loss: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor loss (``loss_parallel``) as this rank's plain tensor; the backward stays DTensor."""
    to_local = getattr(loss, "to_local", None)
    return to_local() if to_local is not None else loss


def eval_token_losses(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Per-target fp32 cross-entropy shaped like ``tokens[:, 1:]``, as the training loss computes it:
    in chunks (``chunked_token_losses``: no fp32 logits of the whole micro-batch), or under tensor
    parallelism ``loss_parallel``'s over this rank's share of the vocabulary (``token_losses``)."""
    if is_dtensor(logits):
        return token_losses(logits, tokens)
    return chunked_token_losses(logits.flatten(0, 1), tokens[:, 1:].flatten()).view(tokens.shape[0], -1)


def token_losses(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Per-target cross-entropy in fp32, shaped like ``tokens[:, 1:]``."""
    flat = _local(F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten(), reduction="none"))
    return flat.view(tokens.shape[0], -1)


def micro_loss(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor | None,
               scale: float | torch.Tensor) -> torch.Tensor:
    """The loss to back-propagate for one micro-batch: mean × ``scale`` (1/micro-steps) without a mask;
    with one, the counted targets' sum × ``scale`` (world_size / global count). The cross-entropy runs
    in chunks (``chunked_token_losses``): no fp32 logits of the whole micro-batch are ever held. Under
    tensor parallelism the logits are a DTensor split over the vocabulary and the loss is
    ``loss_parallel``'s (``loss_context``): each rank holds its share of the vocabulary only."""
    if is_dtensor(logits):
        if mask is None:
            loss = _local(F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()))
        else:
            loss = (token_losses(logits, tokens) * mask[:, 1:].to(logits.device, torch.float32)).sum()
    else:
        losses = chunked_token_losses(logits.flatten(0, 1), tokens[:, 1:].flatten())
        if mask is None:
            loss = losses.mean()
        else:
            loss = (losses * mask[:, 1:].flatten().to(logits.device, torch.float32)).sum()
    return loss if isinstance(scale, float) and scale == 1.0 else loss * scale


def masked_scale(count: torch.Tensor | int, world_size: int) -> torch.Tensor:
    """``world_size / count`` as a float32 tensor beside ``count``: after the ranks' gradients are
    averaged, the sum over counted targets of the whole batch divided by their number (a batch with
    none counts nothing)."""
    count = torch.as_tensor(count)
    return (world_size / count.clamp(min=1).to(torch.float64)).to(torch.float32)


def autocast_of(device: torch.device, dtype: torch.dtype | None) -> tp.ContextManager:
    """Autocast to ``dtype`` on ``device`` (None: none)."""
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()

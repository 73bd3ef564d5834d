"""The trainer's chunked cross-entropy (issue 34 item 6): the value and the gradients of the unchunked
loss, for several shapes, chunk sizes, dtypes and masks, and no fp32 logits of the whole micro-batch
saved for backward (what the planner's logits term now counts)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hpc.core.models.decoder import LOSS_CHUNK_LOGITS, loss_chunk_tokens
from trainer.objective import ChunkedCrossEntropy, micro_loss


def reference(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The loss as ``micro_loss`` computed it before chunking."""
    if mask is None:
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    flat = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
    return (flat.view(tokens.shape[0], -1) * mask[:, 1:].float()).sum()


def grads(fn, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.detach().clone().requires_grad_(True)
    loss = fn(x)
    loss.backward()
    return loss.detach(), x.grad


CASES = [(1, 17, 50, 7), (2, 33, 311, 5), (3, 64, 1000, 64), (4, 9, 257, 1), (2, 31, 129, 1000)]


@pytest.mark.parametrize("batch,seq,vocab,chunk", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_give_the_unchunked_values_and_gradients(batch, seq, vocab, chunk, dtype):
    torch.manual_seed(batch * seq + vocab)
    logits = (torch.randn(batch, seq, vocab) * 3).to(dtype)
    targets = torch.randint(0, vocab, (batch * seq,))
    want, want_grad = grads(lambda x: F.cross_entropy(x.float().flatten(0, 1), targets, reduction="none").sum(),
                            logits)
    got, got_grad = grads(lambda x: ChunkedCrossEntropy.apply(x.flatten(0, 1), targets, chunk).sum(), logits)
    assert got_grad.dtype == dtype
    assert torch.equal(got_grad, want_grad)  # every row computed by the same kernel: bit-identical
    assert abs(got.item() - want.item()) <= 1e-6 * abs(want.item())
    per_row = ChunkedCrossEntropy.apply(logits.flatten(0, 1), targets, chunk)
    assert torch.equal(per_row, F.cross_entropy(logits.float().flatten(0, 1), targets, reduction="none"))


@pytest.mark.parametrize("batch,seq,vocab", [(2, 16, 97), (3, 40, 500), (1, 128, 64)])
@pytest.mark.parametrize("masked", [False, True])
def test_micro_loss_is_unchanged(batch, seq, vocab, masked, monkeypatch):
    import hpc.core.models.decoder as decoder

    monkeypatch.setattr(decoder, "LOSS_CHUNK_LOGITS", 5 * vocab)  # several chunks, the last one short
    assert loss_chunk_tokens(batch * (seq - 1), vocab) == 5
    torch.manual_seed(seq)
    tokens = torch.randint(0, vocab, (batch, seq))
    mask = (torch.rand(batch, seq) > 0.4).long() if masked else None
    logits = torch.randn(batch, seq - 1, vocab)
    for scale in (1.0, 0.25, torch.tensor(0.5)):
        want, want_grad = grads(lambda x: reference(x, tokens, mask) * scale, logits)
        got, got_grad = grads(lambda x: micro_loss(x, tokens, mask, scale), logits)
        assert abs(got.item() - want.item()) <= 1e-6 * max(1.0, abs(want.item()))
        assert torch.allclose(got_grad, want_grad, rtol=1e-6, atol=1e-9)


def test_no_fp32_logits_are_saved_for_backward():
    vocab, tokens = 1000, torch.randint(0, 1000, (2, 65))
    logits = torch.randn(2, 64, vocab, dtype=torch.bfloat16, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        micro_loss(logits, tokens, None, 1.0)
    assert not [t for t in saved if t.dtype == torch.float32 and t.numel() >= 64 * vocab]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        reference(logits, tokens, None)
    assert [t for t in saved if t.dtype == torch.float32 and t.numel() == 128 * vocab]  # what it used to keep


def test_chunk_size_in_tokens():
    assert loss_chunk_tokens(8192, 128256) == LOSS_CHUNK_LOGITS // 128256
    assert loss_chunk_tokens(10, 100) == 10 and loss_chunk_tokens(5, 2**30) == 1

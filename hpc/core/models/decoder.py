"""What the built-in decoder families (``gpt``, ``llama``) share, torch-free: the activation bookkeeping
of a stack of blocks under a language-model head. A family module imports this, never another
family's module (tests/test_layers.py).
"""

from __future__ import annotations

from dataclasses import dataclass

LOGIT_BYTES = 12  # per logit at the loss's backward: fp32 log-probs + their gradient in and out
# The trainer's cross-entropy runs over chunks of at most this many logits (``trainer.objective``): the
# fp32 log-softmax and its gradients exist for one chunk at a time, never for the whole micro-batch.
LOSS_CHUNK_LOGITS = 2**26


def loss_chunk_tokens(tokens: int, vocab: int) -> int:
    """Tokens per chunk of the trainer's chunked cross-entropy (at least one, at most ``tokens``)."""
    return max(1, min(tokens, LOSS_CHUNK_LOGITS // max(1, vocab)))


def loss_terms(tokens: int, vocab: int, c: int, tp: int = 1) -> tuple[float, float, float]:
    """(logits, log_probs, loss) bytes of one micro-batch's loss on one rank: the logits the loop holds
    (compute dtype ``c``); what the loss saves for backward beyond them; what its backward adds. The
    trainer's chunked cross-entropy (``trainer.objective.ChunkedCrossEntropy``) saves nothing beyond
    the logits and, in backward, holds the logits' gradient (``c`` bytes each) and one chunk's fp32
    log-softmax with its gradient in and out (``LOGIT_BYTES`` each). Under tensor parallelism (loss
    parallel: the vocabulary split over ``tp`` ranks) the whole fp32 log-softmax of the rank's share
    is saved and its backward takes ``LOGIT_BYTES`` per logit."""
    logits = tokens * vocab * c / tp
    if tp > 1:
        return logits, tokens * vocab * 4 / tp, tokens * vocab * LOGIT_BYTES / tp
    return logits, 0.0, tokens * vocab * c + loss_chunk_tokens(tokens, vocab) * vocab * LOGIT_BYTES


@dataclass(frozen=True)
class Activations:
    """Activation bytes of one micro-batch."""

    held: float  # at the end of forward: what autograd saved, plus the logits the training loop holds
    peak: float  # the most alive at once, during backward


def decoder_activations(layers: int, block: float, block_input: float, head: float, logits: float,
                        log_probs: float, loss: float, grads: float, small: float, checkpointing: bool) -> Activations:
    """``Activations`` of a stack of ``layers`` decoder blocks from one micro-batch's parts: ``block``
    what one block saves, ``block_input`` what it keeps under checkpointing, ``head`` the final norm's
    and the head's inputs, the loss's ``logits``, fp32 ``log_probs`` and gradient ``loss``, ``grads``
    the widest gradients inside one block's backward, ``small`` ids, targets and shared tables. The
    peak is at the loss's backward or inside the last block's (recomputed first under checkpointing)."""
    kept = layers * (block_input if checkpointing else block)
    inner = block + grads if checkpointing else grads
    return Activations(kept + head + logits + log_probs + small, kept + logits + max(head + loss, inner) + small)

"""What the built-in decoder families (``gpt``, ``llama``) share, torch-free: the activation bookkeeping
of a stack of blocks under a language-model head. A family module imports this, never another
family's module (tests/test_layers.py).
"""

from __future__ import annotations

from dataclasses import dataclass

LOGIT_BYTES = 12  # per logit at the loss's backward: fp32 log-probs + their gradient in and out


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

"""The planner's activation bytes equal what autograd really keeps for the built-in GPT.

A forward pass of the trainer's own GPT on CPU, under each precision the trainer uses: fp32,
autocast bf16 (ddp and none: fp32 weights, the residual stream and LayerNorm inputs stay fp32)
and bf16 weights (what FSDP2's ``param_dtype = bf16`` computes with). A saved-tensor hook records
every tensor autograd keeps, counted once per storage and without the parameters themselves;
the training loop also holds the logits. That sum must equal ``gpt_activations(...).held`` plus,
under autocast, the bf16 weight copies the planner counts in ``buffers``. (The peak during
backward is measured against the CPU allocator by bench/activation_memory.)
"""

from __future__ import annotations

import pytest
import torch

from hpc.core.models import compute_bytes
from hpc.core.models.gpt import gpt_activations
from hpc.core.models.gpt import GPTShape
from trainer.models.gpt import GPT
from trainer.objective import micro_loss

# (shape, micro_batch): widths, vocabularies and sequence lengths that differ from each other
SHAPES = [(GPTShape(3, 96, 4, 80, 300), 3), (GPTShape(2, 128, 8, 64, 2000), 2),
          (GPTShape(2, 64, 2, 48, 500, tied=True), 4)]
MODES = ["fp32", "autocast", "bf16-weights"]


def measured_held(shape: GPTShape, micro_batch: int, mode: str) -> int:
    """Bytes autograd saves in one forward (one count per storage, parameters excluded) + the logits."""
    torch.manual_seed(0)
    model = GPT(shape)
    if mode == "bf16-weights":
        model = model.to(torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    tokens = torch.randint(0, shape.vocab_size, (micro_batch, shape.seq_len + 1))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with autocast:
            logits = model(tokens[:, :-1])
        micro_loss(logits, tokens, None, 1.0)  # as trainer.loop does (the chunked cross-entropy)
    saved.pop(logits.untyped_storage().data_ptr(), None)  # the loss saves the logits themselves: counted below
    return sum(saved.values()) + logits.numel() * logits.element_size()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape,micro_batch", SHAPES, ids=lambda x: str(x))
def test_held_activations_match_autograd(shape, micro_batch, mode):
    mixed = "none" if mode == "fp32" else "bf16"
    predicted = gpt_activations(shape, micro_batch, checkpointing=False, mixed_precision=mixed,
                                autocast=mode != "bf16-weights").held
    if mode == "autocast":  # the bf16 weight copies autocast caches from forward to backward
        predicted += shape.matmul_params * compute_bytes(mixed)
    assert measured_held(shape, micro_batch, mode) == pytest.approx(predicted, rel=0.005)


def test_autocast_keeps_the_residual_stream_in_fp32():
    """The class of the old error: autocast's activations are more than half of fp32's, not half."""
    shape, micro = SHAPES[1]
    fp32, autocast = (measured_held(shape, micro, m) for m in ("fp32", "autocast"))
    bf16 = measured_held(shape, micro, "bf16-weights")
    copies = shape.matmul_params * 2
    assert bf16 < autocast - copies < fp32
    held = {m: gpt_activations(shape, micro, False, "none" if m == "fp32" else "bf16",
                               autocast=m != "bf16-weights").held for m in MODES}
    assert held["bf16-weights"] < held["autocast"] < held["fp32"]

"""Peak activation memory of one forward + backward of the built-in GPT on CPU: the planner's
``gpt_activations(...).peak`` against what the CPU allocator really held.

    python bench/activation_memory/run.py [--micro-batch 4]

For each shape × precision (fp32; autocast bf16 as ddp/none run; bf16 weights as FSDP2's
``param_dtype`` computes) × activation checkpointing off/on, one step warms up (so gradients
exist), then ``torch.profiler`` with ``profile_memory=True`` records every allocation and free
of a second step; the running sum's maximum is the measured peak above the step's start. The
autocast weight copies (``buffers`` in the plan) are subtracted; the remaining peak is compared
with the prediction. Prints predicted / measured per case. Goal: within 1.00 ± 0.05 for
vocabularies several times the width (every preset: 50304 / 8192 at most); small vocabularies
(V ≈ d) are listed to show where the formula under-counts the block backward's temporaries.

The allocator's event stream is read through ``prof.profiler.kineto_results`` (a torch internal,
used only here): torch.profiler's public event list folds allocations into their operators.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

SHAPES = [  # (layers, dim, heads, seq_len, vocab): vocab/dim from 16 to 1
    (2, 64, 4, 256, 1000), (2, 128, 4, 128, 3000), (3, 96, 4, 80, 300), (3, 64, 4, 256, 64)]
MODES = ("fp32", "autocast", "bf16-weights")


def measured_peak(shape, mode: str, checkpointing: bool, micro_batch: int) -> int:
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from trainer.models.gpt import GPT
    from trainer.parallelize import apply_ac

    torch.manual_seed(0)
    model = GPT(shape)
    if mode == "bf16-weights":
        model = model.to(torch.bfloat16)
    if checkpointing:
        apply_ac(model.blocks)
    tokens = torch.randint(0, shape.vocab_size, (micro_batch, shape.seq_len + 1))

    def step() -> None:  # as trainer.loop.forward_backward does
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
            logits = model(tokens[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()

    step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    running = peak = 0
    for e in events:
        running += e.nbytes()
        peak = max(peak, running)
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batch", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from hpc.core.models import compute_bytes
    from hpc.core.models.gpt import gpt_activations
    from hpc.core.models.gpt import GPTShape

    print(f"load average {os.getloadavg()[0]:.2f}; micro_batch {args.micro_batch}")
    print(f"{'shape (L, d, a, s, V)':24s} {'mode':13s} {'ckpt':5s} {'measured MB':>12s} {'predicted MB':>13s} "
          f"{'ratio':>6s}")
    for dims in SHAPES:
        shape = GPTShape(*dims)
        for mode in MODES:
            mixed = "none" if mode == "fp32" else "bf16"
            copies = shape.matmul_params * compute_bytes(mixed) if mode == "autocast" else 0
            for ckpt in (False, True):
                measured = measured_peak(shape, mode, ckpt, args.micro_batch) - copies
                predicted = gpt_activations(shape, args.micro_batch, ckpt, mixed,
                                            autocast=mode != "bf16-weights").peak
                print(f"{str(dims):24s} {mode:13s} {str(ckpt):5s} {measured / 1e6:12.2f} {predicted / 1e6:13.2f} "
                      f"{predicted / measured:6.3f}", flush=True)


if __name__ == "__main__":
    main()

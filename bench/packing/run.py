"""Packed against unpacked fine-tuning on the same corpus of mixed-length examples, at equal real tokens.

    python bench/packing/run.py [--examples 256] [--seq-len 512] [--longest 128] [--micro-batch 4] [--dim 128]
                                [--layers 2] [--rounds 2] [--threads 1]

The corpus: ``--examples`` prompt-response examples of mixed lengths (log-uniform from 8 to ``--longest``
tokens, default seq_len / 4; a third of each the prompt, masked out of the loss), the same in every mode.
One epoch over it is timed per mode (forward, backward and AdamW step of every micro-batch of a
grouped-query Llama, the trainer's own modules and loss), rounds interleaved (in order, then reversed):

- ``unpacked``: one example per row, padded to ``seq_len`` with the EOS id under a zero loss mask
  (a fixed-shape sample per example, as the trainer's samples are), plain causal attention;
- ``packed``: examples laid out as ``hpcx data prepare --window`` lays them (whole, in order, a window
  padded where the next example does not fit), ``data.packing = "document"``: positions restart and
  attention stays in each document through the device's kernel (``trainer.models.decoder.DocumentAttention``;
  on this CPU SDPA per document span, on a GPU flex_attention);
- ``packed-mask``: the same windows through the dense ``[b, 1, s, s]`` mask (the path before issue 44);
- ``first-fit``: packed, each example in the first window with room (prepare's in-order layout leaves
  the rest of a window empty whenever the next example does not fit: ~9 % padding on this corpus);
- ``unpacked-trim``: unpacked, each micro-batch cut to its longest example (dynamic padding, as
  Hugging Face's collators pad; the trainer's samples have one shape, so this is the bench's only).

Each mode reports real (non-padding) tokens per second and its padding fraction; the result line gives
packed / unpacked (goal ≥ 1.8× at < 5 % padding) as the median over rounds of each round's ratio. The
real tokens of every mode are the corpus's, so the ratio is the ratio of epoch times. One thread by
default: on a CPU shared with other work, two threads' barriers cost the many small per-document
kernels far more than the one large masked kernel (measured here: the per-span kernel 3× faster than
the mask at one thread, slower at two on a machine with load 15).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from hpc.core.models.llama import LlamaShape  # noqa: E402
from trainer.models.llama import Llama  # noqa: E402
from trainer.objective import document_targets, masked_scale, micro_loss  # noqa: E402

VOCAB, EOS = 4096, 0


def corpus(n: int, seq_len: int, longest: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (tokens, loss mask) examples, lengths log-uniform in [8, ``longest``], EOS-ended, the first third masked."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = min(seq_len + 1, int(math.exp(rng.uniform(math.log(8), math.log(max(9, longest))))))
        ids = torch.randint(1, VOCAB, (length,), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        ids[-1] = EOS
        mask = torch.ones(length, dtype=torch.bool)
        mask[:length // 3] = False
        out.append((ids, mask))
    return out


def unpacked(examples, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor, None]]:
    """One example per sample of ``seq_len + 1`` tokens, the rest EOS under a zero mask."""
    rows = []
    for ids, mask in examples:
        tokens = torch.full((seq_len + 1,), EOS, dtype=torch.long)
        counted = torch.zeros(seq_len + 1, dtype=torch.bool)
        tokens[:len(ids)], counted[:len(ids)] = ids, mask
        rows.append((tokens, counted, None))
    return rows


def packed(examples, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Windows of ``seq_len + 1`` tokens laid out as ``hpc.data.shards.ShardWriter`` does with a window: an
    example that does not fit in what is left starts the next window, the rest padded (mask 0, counted
    in the document before it); each position's document number beside it."""
    windows, current = [], []

    def close() -> None:
        used = sum(len(ids) for ids, _ in current)
        tokens = torch.cat([ids for ids, _ in current] + [torch.full((seq_len + 1 - used,), EOS)])
        mask = torch.cat([m for _, m in current] + [torch.zeros(seq_len + 1 - used, dtype=torch.bool)])
        lengths = [len(ids) for ids, _ in current]
        lengths[-1] += seq_len + 1 - used
        windows.append((tokens, mask, torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))))
        current.clear()

    for ids, mask in examples:
        if current and sum(len(i) for i, _ in current) + len(ids) > seq_len + 1:
            close()
        current.append((ids, mask))
    if current:
        close()
    return windows


def first_fit(examples, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The examples reordered so that ``packed`` lays them out first-fit (each into the first window with
    room, in order): the layout a packer that keeps its windows open would make."""
    windows: list[list[int]] = []
    room: list[int] = []
    for i, (ids, _) in enumerate(examples):
        j = next((j for j, r in enumerate(room) if r >= len(ids)), len(room))
        if j == len(room):
            windows.append([])
            room.append(seq_len + 1)
        windows[j].append(i)
        room[j] -= len(ids)
    return [examples[i] for w in windows for i in w]


def trimmed(samples, micro_batch: int) -> list:
    """Unpacked samples cut, micro-batch by micro-batch, to the longest example among them (dynamic
    padding, as Hugging Face's collators pad: fewer pad tokens, a shape per micro-batch)."""
    out = []
    for i in range(0, len(samples), micro_batch):
        part = samples[i:i + micro_batch]
        longest = max(int(m.nonzero().max()) if m.any() else 1 for _, m, _ in part) + 1  # its EOS, a target
        out += [(t[:longest], m[:longest], None) for t, m, _ in part]
    return out


def batches(samples, micro_batch: int):
    for i in range(0, len(samples), micro_batch):
        part = samples[i:i + micro_batch]
        tokens, masks = torch.stack([s[0] for s in part]), torch.stack([s[1] for s in part])
        docs = None if part[0][2] is None else torch.stack([s[2] for s in part])
        yield tokens, masks, docs


def epoch(model: torch.nn.Module, optimizer: torch.optim.Optimizer, samples, micro_batch: int) -> float:
    """Seconds for one pass over ``samples``: one optimizer step per micro-batch, the trainer's masked loss."""
    started = time.perf_counter()
    for tokens, mask, docs in batches(samples, micro_batch):
        counted = mask if docs is None else document_targets(mask, docs)
        logits = model(tokens[:, :-1]) if docs is None else model(tokens[:, :-1], docs[:, :-1])
        micro_loss(logits, tokens, counted, masked_scale(counted[:, 1:].sum(), 1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def padding(samples) -> float:
    """Share of the samples' tokens that are padding (no example's)."""
    return 1 - REAL[0] / sum(len(s[0]) for s in samples)


REAL = [0]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--examples", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--longest", type=int, default=0, help="longest example (default seq_len / 4)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # as the trainer does (trainer.loop.set_float_math)
    examples = corpus(args.examples, args.seq_len, args.longest or args.seq_len // 4, args.seed)
    REAL[0] = sum(len(ids) for ids, _ in examples)  # the examples' tokens: what is not padding
    modes = {"unpacked": unpacked(examples, args.seq_len), "packed": packed(examples, args.seq_len),
             "packed-mask": packed(examples, args.seq_len),
             "first-fit": packed(first_fit(examples, args.seq_len), args.seq_len),
             "unpacked-trim": trimmed(unpacked(examples, args.seq_len), args.micro_batch)}
    heads = max(2, args.dim // 64)
    shape = LlamaShape(args.layers, args.dim, heads, heads // 2, int(args.dim * 8 / 3) // 8 * 8, args.seq_len, VOCAB)
    torch.manual_seed(args.seed)
    model = Llama(shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    epoch(model, optimizer, modes["packed"][:args.micro_batch], args.micro_batch)  # warm-up: allocator, kernels
    epoch(model, optimizer, modes["unpacked"][:args.micro_batch], args.micro_batch)
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    order = list(modes)
    for r in range(args.rounds):
        for mode in order if r % 2 == 0 else order[::-1]:
            model.document_kernel = "mask" if mode == "packed-mask" else None  # None: the device's kernel
            seconds[mode].append(epoch(model, optimizer, modes[mode], args.micro_batch))
    print(f"corpus: {args.examples} examples, {REAL[0]:,} real tokens; seq_len {args.seq_len}, micro-batch "
          f"{args.micro_batch}; Llama {args.layers} × {args.dim} ({heads} heads, {heads // 2} kv), {args.threads} threads")
    for mode, samples in modes.items():
        t = statistics.median(seconds[mode])
        print(f"  {mode:12s} {len(samples):5d} samples  padding {padding(samples):6.1%}  epoch {t:7.2f} s  "
              f"real tokens/s {REAL[0] / t:9.0f}  (rounds: {', '.join(f'{s:.2f}' for s in seconds[mode])} s)")
    def ratio(slow: str, fast: str) -> float:  # real tokens/s of ``fast`` over ``slow``: each round's, the median
        return statistics.median(a / b for a, b in zip(seconds[slow], seconds[fast]))

    print(f"packed / unpacked real tokens/s: first-fit {ratio('unpacked', 'first-fit'):.2f}× at "
          f"{padding(modes['first-fit']):.1%} padding (goal ≥ 1.8× at < 5%), the prepare layout "
          f"{ratio('unpacked', 'packed'):.2f}× at {padding(modes['packed']):.1%}; document kernel / dense mask: "
          f"{ratio('packed-mask', 'packed'):.2f}×; first-fit / unpacked trimmed to each micro-batch's longest: "
          f"{ratio('unpacked-trim', 'first-fit'):.2f}×")


if __name__ == "__main__":
    main()

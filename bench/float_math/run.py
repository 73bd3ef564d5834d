"""What flushing subnormal floats to zero (``trainer.loop.set_float_math`` on CPU) is worth.

    python bench/float_math/run.py [--size small] [--seq-len 128] [--train-steps 40] [--reps 6]

On x86 every arithmetic operation on a subnormal float (below 1.2e-38) takes a microcode assist
that costs tens to hundreds of cycles. One process, one thread, strategy none; each line times
the same work with subnormals kept (the CPU's default) and flushed, alternately, ``--reps`` times
each, and prints the median ratio flushed / kept:

- forward + backward of the built-in GPT at initialisation (no subnormals: the control, ≈ 1);
- the same after ``--train-steps`` steps of the trainer at the settings of ``bench/trainer_overhead``
  (jobs/tiny-ddp.toml, lr 1e-2, on the synthetic tokens): attention has sharpened and its softmax
  backward produces subnormals (their count is printed);
- one fused AdamW step (fresh state) over the model with gradients of 1e-20, whose squares
  (``exp_avg_sq``) are subnormal: what an offloaded optimizer meets where gradients are tiny.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY_NORMAL = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny


def build(root: Path, args: argparse.Namespace):
    """A trainer (strategy none) of the overhead bench's model, data and learning rate."""
    import torch

    from hpc.core.resolve import resolved_document
    from hpc.plan.resolve import resolve
    from hpc.core.site import load_site
    from hpc.core.spec import load_spec
    from trainer.run import load_run
    from trainer.train import build_trainer

    spec = load_spec(REPO / "jobs" / "tiny-ddp.toml", [
        f"model.size={args.size!r}", f"model.seq_len={args.seq_len}", f"train.steps={max(1, args.train_steps)}",
        "train.global_batch=8", "train.micro_batch=8", "train.warmup_steps=2", "parallel.strategy='none'",
        "job.tasks_per_node=1"])
    site = load_site("local")
    (root / "resolved.json").write_text(json.dumps(resolved_document(spec, site, resolve(spec, site), str(root))))
    return build_trainer(load_run(root), 0, torch.device("cpu"))


def subnormal_grads(trainer, tokens) -> int:
    """Subnormal values in the gradients reaching each attention block's qkv output, for ``tokens``."""
    from trainer.loop import forward_backward

    counts = []
    hooks = [block.attn.qkv.register_full_backward_hook(
        lambda m, gin, gout: counts.append(int(((gout[0] != 0) & (gout[0].abs() < TINY_NORMAL)).sum())))
        for block in trainer.model.blocks]
    forward_backward(trainer, tokens, 1.0)
    trainer.optimizer.zero_grad(set_to_none=True)
    for h in hooks:
        h.remove()
    return sum(counts)


def timed_ratio(work, reps: int) -> tuple[float, float]:
    """(median ms with subnormals kept, median ratio flushed / kept), alternating the setting each repetition."""
    import torch

    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(reps + 1):
        for flush in ((False, True) if i % 2 else (True, False)):
            torch.set_flush_denormal(flush)
            tic = time.perf_counter()
            work()
            times[flush].append(time.perf_counter() - tic)
    torch.set_flush_denormal(True)
    kept, flushed = statistics.median(times[False][1:]), statistics.median(times[True][1:])
    return 1000 * kept, flushed / kept


def fwd_bwd(trainer, tokens):
    from trainer.loop import forward_backward

    def work() -> None:
        forward_backward(trainer, tokens, 1.0)
        trainer.optimizer.zero_grad(set_to_none=True)
    return work


def adam_on_tiny_grads(trainer):
    """A fresh fused AdamW (the trainer's) over the model, gradients 1e-20: ``exp_avg_sq`` ≈ 5e-42."""
    import torch

    from hpc.core.spec import Train
    from trainer.optim import build_optimizer

    optimizer = build_optimizer(trainer.model, Train())
    for p in trainer.model.parameters():
        p.grad = torch.full_like(p, 1e-20)

    def work() -> None:
        optimizer.step()
    return work


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--train-steps", type=int, default=40)
    parser.add_argument("--reps", type=int, default=6)
    args = parser.parse_args()
    import torch

    from trainer.loop import train

    torch.set_num_threads(1)
    print(f"GPT {args.size}, seq_len {args.seq_len}, batch 8, CPU, 1 thread; load average {os.getloadavg()[0]:.1f}")
    print(f"{'work':58s} {'kept ms':>8s} {'flushed/kept':>12s}")
    with tempfile.TemporaryDirectory() as tmp:
        trainer, state = build(Path(tmp), args)
        tokens = next(iter(trainer.loader))
        kept, ratio = timed_ratio(fwd_bwd(trainer, tokens), args.reps)
        print(f"{'forward+backward at initialisation (control)':58s} {kept:8.0f} {ratio:12.3f}", flush=True)
        train(trainer, state)
        torch.set_flush_denormal(False)
        count = subnormal_grads(trainer, tokens)
        kept, ratio = timed_ratio(fwd_bwd(trainer, tokens), args.reps)
        label = f"forward+backward after {args.train_steps} steps ({count} subnormal grads)"
        print(f"{label:58s} {kept:8.0f} {ratio:12.3f}", flush=True)
        kept, ratio = timed_ratio(adam_on_tiny_grads(trainer), args.reps)
        print(f"{'fused AdamW step, gradients 1e-20 (subnormal squares)':58s} {kept:8.0f} {ratio:12.3f}")
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end (1, 5, 15 min)")


if __name__ == "__main__":
    main()

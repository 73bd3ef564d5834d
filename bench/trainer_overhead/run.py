"""Step time of the hpcx trainer against a hand-written torch loop: same model, batch, strategy.

    python bench/trainer_overhead/run.py [--size small] [--seq-len 128] [--steps 40] [--warmup 5]

For each of none (one process), ddp and fsdp (two ranks under torchrun, gloo on CPU,
one thread per rank), both loops run twice in the order hpcx, hand, hand, hpcx;
the median step time over the post-warm-up steps of both rounds is compared. The
hand-written loop builds the same GPT, wraps it by hand (DDP / fully_shard per
block then root), uses AdamW + LambdaLR warm-up/cosine + clip_grad_norm_ and
pre-generated batches, and logs ``loss.item()`` every step. Goal: ratio ≤ 1.05.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def make_run(root: Path, strategy: str, ranks: int, args: argparse.Namespace) -> Path:
    from hpc.resolve import resolve, resolved_document
    from hpc.site import load_site
    from hpc.spec import load_spec

    steps = args.warmup + args.steps
    spec = load_spec(REPO / "jobs" / "tiny-ddp.toml", [
        f"model.size={args.size!r}", f"model.seq_len={args.seq_len}", f"train.steps={steps}",
        f"train.global_batch={args.global_batch}", f"train.micro_batch={args.global_batch // ranks}",
        f"train.warmup_steps=2", f"train.warmup_metrics_steps={args.warmup}", "train.log_every=1",
        f"parallel.strategy={strategy!r}", f"job.tasks_per_node={ranks}"])
    site = load_site("local")
    run_dir = Path(tempfile.mkdtemp(prefix=f"{strategy}-", dir=root))
    (run_dir / "resolved.json").write_text(json.dumps(resolved_document(spec, site, resolve(spec, site), str(run_dir))))
    return run_dir


def hpcx_step_times(run_dir: Path, rank: int) -> list[float]:
    import torch

    from trainer.loop import train
    from trainer.run import load_run
    from trainer.train import build_trainer

    run = load_run(run_dir)
    trainer, state = build_trainer(run, rank, torch.device("cpu"))
    train(trainer, state)
    if rank != 0:
        return []
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    times = [json.loads(line)["step_time_s"] for line in lines]
    (run_dir / "metrics.jsonl").unlink()  # the next round appends
    return times[run.spec.train.warmup_metrics_steps:]


def hand_step_times(run_dir: Path, rank: int, world: int) -> list[float]:
    """The baseline: a plain loop written the way a user would, without the trainer."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from hpc.models import gpt_shape
    from trainer.model import GPT
    from trainer.run import load_run

    run = load_run(run_dir)
    spec, strategy = run.spec, run.launch.strategy
    torch.manual_seed(spec.train.seed)
    shape = gpt_shape(spec.model.size, spec.model.seq_len)
    model = GPT(shape)
    if strategy == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.train.lr, betas=tuple(spec.train.betas),
                            weight_decay=spec.train.weight_decay)
    total, warm = spec.train.steps, spec.train.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, 0.5 * (1 + math.cos(math.pi * s / total))))
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, shape.vocab_size, (spec.train.micro_batch, shape.seq_len + 1), generator=gen)
               for _ in range(4)]
    times = []
    for step in range(total):
        tic = time.perf_counter()
        tokens = batches[step % 4]
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        loss.item()
        times.append(time.perf_counter() - tic)
    if world > 1:
        dist.barrier()
    return times[spec.train.warmup_metrics_steps:]


def measure(run_dir: Path, rank: int, world: int) -> dict[str, list[float]]:
    """Rounds in the order hpcx, hand, hand, hpcx, so drift in machine load hits both alike."""
    out: dict[str, list[float]] = {"hpcx": [], "hand": []}
    for name in ("hpcx", "hand", "hand", "hpcx"):
        out[name] += hpcx_step_times(run_dir, rank) if name == "hpcx" else hand_step_times(run_dir, rank, world)
    return out


def worker(run_dir: str, out: str) -> None:
    """One rank under torchrun."""
    import torch

    from trainer.dist import detect_rank_env, init_distributed, shutdown

    torch.set_num_threads(1)
    env = detect_rank_env()
    init_distributed(env, "gloo", timeout_s=300)
    result = measure(Path(run_dir), env.rank, env.world_size)
    if env.rank == 0:
        Path(out).write_text(json.dumps(result))
    shutdown(60)


def run_strategy(root: Path, strategy: str, args: argparse.Namespace) -> dict[str, list[float]]:
    ranks = 1 if strategy == "none" else 2
    run_dir = make_run(root, strategy, ranks, args)
    if ranks == 1:
        import torch

        torch.set_num_threads(1)
        return measure(run_dir, 0, 1)
    out = root / f"{strategy}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
           "--worker", str(run_dir), str(out)]
    subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30, help="measured steps per round (two rounds)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--strategies", default="none,ddp,fsdp")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        os._exit(0)
    print(f"GPT {args.size}, seq_len {args.seq_len}, global batch {args.global_batch}, "
          f"{args.steps} steps × 2 rounds after {args.warmup} warm-up steps")
    print(f"{'strategy':9s} {'hpcx ms':>9s} {'hand ms':>9s} {'ratio':>7s}")
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in args.strategies.split(","):
            times = run_strategy(Path(tmp), strategy, args)
            hpcx, hand = statistics.median(times["hpcx"]), statistics.median(times["hand"])
            print(f"{strategy:9s} {1000 * hpcx:9.1f} {1000 * hand:9.1f} {hpcx / hand:7.3f}"
                  f"   (n={len(times['hpcx'])}/{len(times['hand'])})", flush=True)


if __name__ == "__main__":
    main()

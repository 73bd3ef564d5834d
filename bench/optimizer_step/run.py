"""AdamW step time: the fused kernel (what ``trainer.optim.build_optimizer`` picks) against the multi-tensor one.

    python bench/optimizer_step/run.py [--size 125m] [--steps 6]

One process, one thread, CPU. Two layouts of the built-in GPT's parameters: plain tensors (none/
ddp), and FSDP2 DTensor shards with ``CPUOffloadPolicy`` (a one-rank gloo group: the optimizer
of an offloaded GPU job runs exactly this, on the host). Gradients are set once (small random
values); the two optimizers step in turn, ``--steps`` times each, and the median step time of
each is compared. The parameters both reach are printed as a check (same update rule).
Goal: fused ≤ 0.5 × multi-tensor on CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def model(size: str, fsdp: bool):
    import torch

    from hpc.core.models.gpt import gpt_shape
    from trainer.models.gpt import GPT

    torch.manual_seed(0)
    gpt = GPT(gpt_shape(size))
    if fsdp:
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        for block in gpt.blocks:
            fully_shard(block, offload_policy=CPUOffloadPolicy(pin_memory=False))
        fully_shard(gpt, offload_policy=CPUOffloadPolicy(pin_memory=False))
    gen = torch.Generator().manual_seed(1)
    for p in gpt.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        grad = torch.randn(local.shape, generator=gen) * 1e-3
        p.grad = torch.distributed.tensor.DTensor.from_local(grad, p.device_mesh, p.placements) if fsdp else grad
    return gpt


def compare(size: str, fsdp: bool, steps: int) -> str:
    import torch

    from hpc.core.spec import Train
    from trainer.optim import build_optimizer

    models = {name: model(size, fsdp) for name in ("multi-tensor", "fused")}
    opts = {"fused": build_optimizer(models["fused"], Train()),
            "multi-tensor": torch.optim.AdamW([{"params": g["params"], "weight_decay": g["weight_decay"]}
                                               for g in build_optimizer(models["multi-tensor"], Train()).param_groups],
                                              lr=Train().lr, betas=tuple(Train().betas), foreach=True)}
    assert all(g["fused"] for g in opts["fused"].param_groups)
    times: dict[str, list[float]] = {name: [] for name in opts}
    for i in range(steps):
        for name in (("fused", "multi-tensor") if i % 2 else ("multi-tensor", "fused")):
            tic = time.perf_counter()
            opts[name].step()
            times[name].append(time.perf_counter() - tic)
    fused, multi = (statistics.median(times[n][1:]) for n in ("fused", "multi-tensor"))
    with torch.no_grad():
        gaps = [(a - b).abs().max() for a, b in zip(models["fused"].parameters(), models["multi-tensor"].parameters())]
        gap = max(float(g.full_tensor() if fsdp else g) for g in gaps)
    params = sum(p.numel() for p in models["fused"].parameters())
    layout = "FSDP2 + CPU offload" if fsdp else "plain tensors"
    return (f"{layout:20s} {params / 1e6:7.1f}M {1000 * multi:10.0f} {1000 * fused:8.0f} {fused / multi:7.3f}"
            f"   (max |param difference| {gap:.1e})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="125m")
    parser.add_argument("--steps", type=int, default=6, help="steps per optimizer (the first is left out)")
    args = parser.parse_args()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # as in the trainer (trainer.loop.set_float_math)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    print(f"AdamW step, GPT {args.size}, CPU, 1 thread; load average {os.getloadavg()[0]:.1f} at start")
    print(f"{'layout':20s} {'params':>8s} {'multi ms':>10s} {'fused ms':>8s} {'ratio':>7s}")
    for fsdp in (False, True):
        print(compare(args.size, fsdp, args.steps), flush=True)
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end (1, 5, 15 min)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

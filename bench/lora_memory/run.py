"""Peak memory of a LoRA step against a full fine-tune step of the same model, on CPU, and the ratio the
planner predicted for the two (``hpc.plan.memory.estimate``, with ``hpc.core.lora.with_lora``); then a
LoRA step at each frozen-base dtype (``lora.base_dtype``: fp32, bf16, nf4, under bf16 autocast) against
the planner's total for it, and the measured and planned ratio of each to the fp32 base.

    python bench/lora_memory/run.py [--dim 1024] [--layers 8] [--rank 16] [--micro-batch 2] [--no-dtypes]

Each mode runs in a fresh process (strategy none, no activation checkpointing): the trainer's
own model construction (``trainer.train.build_parallel_model``, so LoRA is ``trainer.lora.apply_lora``)
and optimizer (``trainer.optim.build_optimizer``), then two optimizer steps of forward, cross-entropy,
backward, AdamW; the peak RSS (VmHWM, reset once torch is imported) minus the RSS before the build is
the step's memory (the build is run once on the meta device first, so the modules it imports are
not counted). Printed beside each: the planner's total for the same configuration, and for the
pair the measured ratio LoRA / full against the planner's ratio, from the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
GB = 1e9
TARGETS = "['wq', 'wk', 'wv', 'wo', 'w1', 'w2', 'w3']"


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def overrides(args: argparse.Namespace, lora: bool, base: str = "") -> list[str]:
    """The bench's spec: fp32 compute, or with ``base`` (a ``lora.base_dtype``) bf16 autocast."""
    sets = ["model.arch='llama'", "model.size='small'", f"model.dim={args.dim}", f"model.n_layers={args.layers}",
            "model.n_heads=16", "model.n_kv_heads=4", "model.seq_len=256", "model.vocab_size=8192",
            "parallel.strategy='none'", "job.tasks_per_node=1", f"train.micro_batch={args.micro_batch}",
            f"train.global_batch={args.micro_batch}", f"parallel.mixed_precision={'bf16' if base else 'none'!r}",
            "parallel.activation_checkpointing=false"]
    return sets + ([f"lora.rank={args.rank}", f"lora.targets={TARGETS}"] if lora else []) + (
        [f"lora.base_dtype={base!r}"] if base else [])


def worker(sets: list[str], out: str) -> None:
    import torch
    import torch.nn.functional as F

    from hpc.cli import load_job
    from trainer.optim import build_optimizer
    from trainer.train import build_parallel_model

    torch.set_num_threads(1)
    spec, _, launch = load_job(str(REPO / "jobs" / "tiny-ddp.toml"), "local", sets)
    build_parallel_model(spec, launch, torch.device("meta"), materialize=False)  # its imports (torchao's too)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    baseline = status_bytes("VmRSS")
    model, _ = build_parallel_model(spec, launch, torch.device("cpu"))
    optimizer = build_optimizer(model, spec.train)
    tokens = torch.randint(0, spec.model.vocab_size, (spec.train.micro_batch, spec.model.seq_len + 1))
    amp = launch.parallel.mixed_precision == "bf16"  # the trainer's autocast for a replica (strategy none)
    started, peaks = time.perf_counter(), []
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        peaks.append(status_bytes("VmHWM"))
    seconds = (time.perf_counter() - started) / 2
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    Path(out).write_text(json.dumps({"baseline": baseline, "peak": peaks[-1], "first": peaks[0], "seconds": seconds,
                                     "params": sum(p.numel() for p in model.parameters()), "trainable": trainable}))


def planned(sets: list[str]) -> float:
    """The planner's per-rank total (GB) of the configuration, as ``hpcx plan`` computes it."""
    from hpc.cli import load_job
    from hpc.plan import launch_row

    spec, site, launch = load_job(str(REPO / "jobs" / "tiny-ddp.toml"), "local", sets)
    return launch_row(spec, site, launch).memory.total


def measure(sets: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "r.json")
        subprocess.run([sys.executable, __file__, "--worker", out, json.dumps(sets)], check=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=3600)
        return json.loads(Path(out).read_text())


def base_dtypes(args: argparse.Namespace) -> None:
    """A LoRA step at each ``lora.base_dtype`` under bf16 autocast: the first step's measured peak
    against the planner's total (its error), and each one's ratio to the fp32 base, measured and
    planned. The second step's peak is higher on CPU by what glibc keeps of the first step's freed
    activations (the RSS does not fall back after a step): that is printed against the planner's
    total plus its fragmentation allowance (``hpc.plan.memory.FRAGMENTATION``, part of its headroom)."""
    from hpc.plan.memory import FRAGMENTATION

    got = {}
    for base in ("fp32", "bf16", "nf4"):
        sets = overrides(args, True, base)
        r, plan = measure(sets), planned(sets)
        got[base] = first, _ = r["first"] - r["baseline"], plan
        both = r["peak"] - r["baseline"]
        print(f"base {base}: first step peak +{first / GB:.3f} GB | planner {plan:.3f} GB | planned / measured "
              f"{plan * GB / first:.3f} | two steps +{both / GB:.3f} GB against planner + 10% fragmentation "
              f"{plan * (1 + FRAGMENTATION):.3f} GB | {r['seconds']:.1f} s per step", flush=True)
    for base in ("bf16", "nf4"):
        print(f"base {base} / fp32: measured {got[base][0] / got['fp32'][0]:.3f}, planner "
              f"{got[base][1] / got['fp32'][1]:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--no-dtypes", dest="dtypes", action="store_false", help="skip the base-dtype runs")
    args = parser.parse_args()
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    got = {}
    for mode in ("full", "lora"):
        sets = overrides(args, mode == "lora")
        r, plan = measure(sets), planned(sets)
        step = r["peak"] - r["baseline"]
        got[mode] = (step, plan)
        print(f"{mode:>4}: {r['params']:,} params, {r['trainable']:,} trainable | step peak +{step / GB:.3f} GB "
              f"(peak RSS {r['peak'] / GB:.3f} GB) | planner {plan:.3f} GB | {r['seconds']:.1f} s per step", flush=True)
    (lora, lora_plan), (full, full_plan) = got["lora"], got["full"]
    print(f"LoRA / full: measured {lora / full:.3f}, planner {lora_plan / full_plan:.3f}")
    if args.dtypes:
        base_dtypes(args)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[3]), sys.argv[2])
    else:
        main()

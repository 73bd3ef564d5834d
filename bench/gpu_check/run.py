"""One GPU, bf16: tokens/s, MFU and peak memory of the hpcx trainer on a GPT preset that fits.

    python bench/gpu_check/run.py [--size auto|125m|350m|760m|1.3b] [--steps 30] [--compile]

Exits 0 with "skipped: no GPU" where CUDA is absent. Strategy `none` on cuda:0,
bf16 autocast, activation checkpointing, synthetic tokens, seq_len 2048; the
preset is the largest whose model state (16 bytes/parameter) takes at most a
quarter of the GPU's memory. Budget: well under 5 minutes (model init is on the
CPU, then one copy to the GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CANDIDATES = ("1.3b", "760m", "350m", "125m")
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "L4": 121.0}


def peak_tflops(name: str) -> float:
    """Dense bf16 peak of a known GPU model (0: unknown, MFU left out)."""
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0)


def pick_size(memory_gb: float) -> str:
    from hpc.models import GPT_PRESETS

    return next(s for s in CANDIDATES if 16 * GPT_PRESETS[s].n_params / 1e9 <= memory_gb / 4)


def site_doc(gpu_name: str, memory_gb: float) -> dict:
    return {"scheduler": {"kind": "local", "gpu_directive": "none"},
            "node": {"gpus": 1, "gpu_model": gpu_name, "gpu_memory_gb": round(memory_gb, 1),
                     "gpu_peak_tflops": peak_tflops(gpu_name), "cpus": 1, "intra_link": "none"},
            "network": {"fabric": "none"}, "storage": {"run_root": "/tmp"}}


def predicted_gb(run_dir: Path) -> float | None:
    """The planner's per-rank estimate (without headroom) for the strategy this run uses."""
    from hpc.plan import plan_job
    from hpc.site import parse_site
    from hpc.spec import spec_from_dict

    doc = json.loads((run_dir / "resolved.json").read_text())
    site_doc_ = {k: v for k, v in doc["site"].items() if k in ("scheduler", "node", "network", "storage", "nccl")}
    plan = plan_job(spec_from_dict(doc["spec"]), parse_site(site_doc_, "gpu-check", "<gpu_check>"))
    row = next((r for r in plan.rows if r.dims.strategy == doc["launch"]["strategy"] and r.memory), None)
    return row.memory.total if row else None


def make_run(root: Path, size: str, args: argparse.Namespace, gpu_name: str, memory_gb: float) -> Path:
    from hpc.resolve import resolve, resolved_document
    from hpc.site import parse_site
    from hpc.spec import load_spec

    spec = load_spec(REPO / "jobs" / "tiny-ddp.toml", [
        f"model.size={size!r}", f"train.steps={args.steps}", f"train.global_batch={args.micro_batch}",
        f"train.micro_batch={args.micro_batch}", "train.warmup_steps=5", "train.warmup_metrics_steps=5",
        "parallel.strategy='none'", "parallel.mixed_precision='bf16'", "parallel.activation_checkpointing=true",
        f"parallel.compile={str(args.compile).lower()}", "job.tasks_per_node=1"])
    site = parse_site(site_doc(gpu_name, memory_gb), "gpu-check", "<gpu_check>")
    run_dir = root / f"gpt-{size}"
    run_dir.mkdir()
    (run_dir / "resolved.json").write_text(json.dumps(resolved_document(spec, site, resolve(spec, site), str(run_dir))))
    return run_dir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="auto")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("skipped: no GPU (torch.cuda.is_available() is False)")
        return 0
    props = torch.cuda.get_device_properties(0)
    memory_gb = props.total_memory / 1e9
    size = pick_size(memory_gb) if args.size == "auto" else args.size
    print(f"{props.name}, {memory_gb:.0f} GB, bf16 peak {peak_tflops(props.name) or 'unknown'} TFLOP/s; GPT {size}, "
          f"micro batch {args.micro_batch} × seq 2048, {args.steps} steps, compile={args.compile}", flush=True)
    from trainer.train import run_rank

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = make_run(Path(tmp), size, args, props.name, memory_gb)
        predicted = predicted_gb(run_dir)
        result = run_rank(str(run_dir))
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][5:]
    mfus = [r["mfu"] for r in records if r["mfu"] is not None]
    print(f"tokens/s {statistics.median(r['tokens_per_s'] for r in records):,.0f} (median of {len(records)} steps)")
    print(f"MFU {100 * statistics.median(mfus):.1f}%" if mfus else "MFU unknown (GPU peak not in the table)")
    measured = max(r["mem_gb"] for r in records)
    print(f"peak memory {measured:.1f} GB (torch.cuda.max_memory_allocated)")
    if predicted:
        print(f"planner predicted {predicted:.1f} GB: measured/predicted = {measured / predicted:.2f} "
              f"(goal within ±10%: {'ok' if abs(measured / predicted - 1) <= 0.10 else 'MISSED'})")
    print(f"final loss {result['final_loss']:.3f}; wall {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

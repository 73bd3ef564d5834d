"""The GPU check: one prepared run of at most 8 minutes on one GPU, the trainer run as a user runs it.

    python bench/gpu_check/run.py [--budget-s 480] [--steps 20] [--only throughput,sync,fsdp,fp16]

Exits 0 with "skipped: no GPU" where CUDA is absent. Every part is ``python -m trainer RUN_DIR`` in a
fresh process on a run folder resolved for a one-GPU site (so meta-device init, bf16 defaults and the
like are picked up as the trainer gains them), reading back metrics.jsonl and ledger.jsonl:

1. throughput: GPT 350m and 1.3b, bf16 + activation checkpointing + torch.compile, seq 2048:
   tokens/s and MFU (median after warm-up), peak memory against the planner (``hpcx plan``'s
   estimate for that strategy, goal within ±10%);
2. sync: 350m with ``log_every`` 1 against 20 (the per-step host syncs of logging), as a ratio;
3. fsdp: FSDP2 (world size 1) with async checkpoints every 5 steps, a USR2 mid-run (the trainer
   saves, stops and, with no scheduler to requeue it, leaves), then the same command again: the
   resume onto the GPU, checked in the ledger and by the loss continuing where it stopped;
4. fp16: FSDP2 with fp16 (ShardedGradScaler) and CPU offload (pinned host memory): finite losses.

Parts that would not fit in the remaining budget are skipped and said so. Figures are printed as
ratios where a baseline exists; run ``nvidia-smi`` beside it to note the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "L4": 121.0}
WARMUP = 5  # steps left out of medians (compilation, allocator warm-up)
PARTS = ("throughput", "sync", "fsdp", "fp16")


def peak_tflops(name: str) -> float:
    """Dense bf16 peak of a known GPU model (0: unknown, MFU left out)."""
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0)


def site_doc(gpu_name: str, memory_gb: float) -> dict:
    """A one-GPU machine as a local site profile."""
    return {"scheduler": {"kind": "local", "gpu_directive": "none"},
            "node": {"gpus": 1, "gpu_model": gpu_name, "gpu_memory_gb": round(memory_gb, 1),
                     "gpu_peak_tflops": peak_tflops(gpu_name), "cpus": os.cpu_count() or 1, "intra_link": "none"},
            "network": {"fabric": "none"}, "storage": {"run_root": "/tmp"}}


class Check:
    """The GPU, a scratch folder, the time budget, and how to run the trainer on a spec."""

    def __init__(self, root: Path, budget_s: float, steps: int):
        import torch

        props = torch.cuda.get_device_properties(0)
        self.gpu, self.memory_gb = props.name, props.total_memory / 1e9
        self.root, self.steps, self.deadline = root, steps, time.monotonic() + budget_s

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def make_run(self, name: str, overrides: list[str]) -> Path:
        """A run folder resolved exactly as ``hpcx submit`` would, for this one-GPU machine."""
        from hpc.core.resolve import resolved_document
        from hpc.plan.resolve import resolve
        from hpc.core.site import parse_site
        from hpc.core.spec import load_spec

        spec = load_spec(REPO / "jobs" / "tiny-ddp.toml", [
            "model.seq_len=2048", f"train.steps={self.steps}", "train.warmup_steps=5",
            f"train.warmup_metrics_steps={WARMUP}", "job.tasks_per_node=1", "train.log_every=1", *overrides])
        site = parse_site(site_doc(self.gpu, self.memory_gb), "gpu-check", "<gpu_check>")
        run_dir = self.root / name
        run_dir.mkdir()
        for sub in ("logs", "checkpoints"):
            (run_dir / sub).mkdir()
        doc = resolved_document(spec, site, resolve(spec, site), str(run_dir))
        (run_dir / "resolved.json").write_text(json.dumps(doc))
        return run_dir

    def train(self, run_dir: Path, signal_at_step: int | None = None) -> subprocess.CompletedProcess:
        """``python -m trainer RUN_DIR`` (one process, cuda:0); ``signal_at_step``: send USR2 once
        metrics.jsonl shows that step."""
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SUBMITIT_EXECUTOR")}
        proc = subprocess.Popen([sys.executable, "-m", "trainer", str(run_dir)], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while signal_at_step is not None and proc.poll() is None:
            if any(r.get("step", 0) >= signal_at_step for r in metrics(run_dir)):
                proc.send_signal(signal.SIGUSR2)
                break
            time.sleep(0.2)
        out, err = proc.communicate(timeout=max(30.0, self.left() + 60))
        if proc.returncode != 0:
            raise RuntimeError(f"{run_dir.name}: trainer failed ({proc.returncode}): {err[-1500:]}")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def ledger(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]


def steady(run_dir: Path) -> list[dict]:
    return [r for r in metrics(run_dir) if r["step"] > WARMUP] or metrics(run_dir)


def predicted_gb(run_dir: Path) -> float | None:
    """The planner's per-rank estimate (without headroom) for the strategy this run uses."""
    from hpc.plan import plan_job
    from hpc.core.site import parse_site
    from hpc.core.spec import spec_from_dict

    doc = json.loads((run_dir / "resolved.json").read_text())
    site = {k: v for k, v in doc["site"].items() if k in ("scheduler", "node", "network", "storage", "nccl")}
    plan = plan_job(spec_from_dict(doc["spec"]), parse_site(site, "gpu-check", "<gpu_check>"))
    row = next((r for r in plan.rows if r.dims.strategy == doc["launch"]["strategy"] and r.memory), None)
    return row.memory.total if row else None


def throughput(check: Check, size: str, micro: int) -> list[str]:
    run = check.make_run(f"gpt-{size}", [f"model.size={size!r}", f"train.global_batch={micro}",
                                         f"train.micro_batch={micro}", "parallel.strategy='none'",
                                         "parallel.mixed_precision='bf16'", "parallel.activation_checkpointing=true",
                                         "parallel.compile=true"])
    check.train(run)
    rows = steady(run)
    rate = statistics.median(r["tokens_per_s"] for r in rows)
    mfus = [r["mfu"] for r in rows if r.get("mfu") is not None]
    measured = max(r["mem_gb"] for r in metrics(run))
    predicted = predicted_gb(run)
    memory = f"peak {measured:.1f} GB"
    if predicted:
        ok = "ok" if abs(measured / predicted - 1) <= 0.10 else "MISSED"
        memory += f", planner {predicted:.1f} GB: measured/predicted {measured / predicted:.2f} (±10%: {ok})"
    mfu = f"MFU {100 * statistics.median(mfus):.1f}%" if mfus else "MFU unknown (GPU peak not in the table)"
    return [f"GPT {size} bf16+AC+compile, micro {micro} × 2048: {rate:,.0f} tokens/s, {mfu}; {memory}"]


def sync_cost(check: Check) -> list[str]:
    """The same 350m run logging every step and every 20th: the ratio of their step times."""
    rates = {}
    for every in (1, 20):
        run = check.make_run(f"log-every-{every}", ["model.size='350m'", "train.global_batch=8",
                                                    "train.micro_batch=8", "parallel.strategy='none'",
                                                    "parallel.mixed_precision='bf16'", f"train.log_every={every}",
                                                    "train.steps=60"])
        check.train(run)
        rates[every] = statistics.median(r["step_time_s"] for r in steady(run))
    return [f"log_every 1 vs 20 (350m bf16): step {1000 * rates[1]:.1f} ms vs {1000 * rates[20]:.1f} ms, "
            f"ratio {rates[1] / rates[20]:.3f} (the per-step syncs of logging)"]


def fsdp_resume(check: Check) -> list[str]:
    """FSDP2 with async saves; preempted mid-run; the same command resumes from the newest checkpoint."""
    run = check.make_run("fsdp-resume", ["model.size='350m'", "train.global_batch=4", "train.micro_batch=4",
                                         "parallel.strategy='fsdp'", "parallel.mixed_precision='bf16'",
                                         "checkpoint.interval_steps=5", "checkpoint.async_save=true",
                                         "train.steps=30"])
    check.train(run, signal_at_step=12)
    stop = ledger(run)[-1]
    check.train(run)
    start, final = ledger(run)[-2:]
    steps = sorted({r["step"] for r in metrics(run)})
    ok = (stop["reason"] == "preempted" and start["step"] == stop["step"] and start["checkpoint"]
          and final["reason"] == "completed" and steps == list(range(1, 31)))
    return [f"FSDP2 async saves: preempted at step {stop['step']} ({stop['saves']} saves, {stop['save_s']} s), "
            f"resumed from {start['checkpoint']} in {start['restore_s']} s, completed at {final['step']}: "
            f"{'ok' if ok else 'MISSED'}"]


def fp16_offload(check: Check) -> list[str]:
    run = check.make_run("fp16-offload", ["model.size='350m'", "train.global_batch=4", "train.micro_batch=4",
                                          "parallel.strategy='fsdp'", "parallel.mixed_precision='fp16'",
                                          "parallel.cpu_offload=true", "train.steps=12"])
    check.train(run)
    losses = [r["loss"] for r in metrics(run)]
    finite = all(loss == loss and abs(loss) != float("inf") for loss in losses)
    rate = statistics.median(r["tokens_per_s"] for r in steady(run))
    return [f"FSDP2 fp16 + ShardedGradScaler + pinned CPU offload: {len(losses)} steps, loss {losses[0]:.3f} -> "
            f"{losses[-1]:.3f} ({'finite' if finite else 'NOT FINITE'}), {rate:,.0f} tokens/s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--only", default=",".join(PARTS))
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("skipped: no GPU (torch.cuda.is_available() is False)")
        return 0
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hpcx-gpu-check-") as tmp:
        check = Check(Path(tmp), args.budget_s, args.steps)
        print(f"{check.gpu}, {check.memory_gb:.0f} GB, bf16 peak {peak_tflops(check.gpu) or 'unknown'} TFLOP/s; "
              f"torch {torch.__version__}; budget {args.budget_s:.0f} s", flush=True)
        parts = {"throughput": [lambda: throughput(check, "350m", 8), lambda: throughput(check, "1.3b", 8)],
                 "sync": [lambda: sync_cost(check)], "fsdp": [lambda: fsdp_resume(check)],
                 "fp16": [lambda: fp16_offload(check)]}
        for name in args.only.split(","):
            for part in parts[name]:
                if check.left() < 45:
                    print(f"{name}: skipped (the {args.budget_s:.0f} s budget is spent)", flush=True)
                    continue
                try:
                    for line in part():
                        print(f"{name}: {line}", flush=True)
                except Exception as exc:  # report and go on: one broken part must not hide the others
                    print(f"{name}: FAILED: {str(exc)[-800:]}", flush=True)
    print(f"wall {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The trainer's step time at ``train.log_every = 1`` against the default (10), same run, same processes.

    python bench/log_every/run.py [--strategy fsdp] [--size small] [--steps 30] [--warmup 10]

Two ranks under torchrun (gloo on CPU, one thread per rank; ``--strategy none``: one process),
the trainer as ``run_rank`` runs it (preemption vote attached), rounds in the order
every-step, default, default, every-step. A logging step all-reduces the loss, copies loss and
gradient norm to the host (on a GPU: the wait for the step's kernels), and writes a metrics line;
the other steps read nothing from the device. The step time compared is the mean over the
measured steps (each metrics line covers the steps since the previous one). On CPU this sizes
the logging work itself; the GPU's sync cost is measured by ``bench/gpu_check`` (log_every 1 vs 20).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def make_run(root: Path, name: str, log_every: int, ranks: int, args: argparse.Namespace) -> Path:
    from hpc.core.resolve import resolved_document
    from hpc.plan.resolve import resolve
    from hpc.core.site import load_site
    from hpc.core.spec import load_spec

    spec = load_spec(REPO / "jobs" / "tiny-ddp.toml", [
        f"model.size={args.size!r}", f"model.seq_len={args.seq_len}", f"train.steps={args.warmup + args.steps}",
        "train.global_batch=8", f"train.micro_batch={8 // ranks}", "train.warmup_steps=2",
        f"train.warmup_metrics_steps={args.warmup}", f"train.log_every={log_every}",
        f"parallel.strategy={args.strategy!r}", f"job.tasks_per_node={ranks}"])
    site = load_site("local")
    run_dir = root / name
    run_dir.mkdir(parents=True)
    (run_dir / "resolved.json").write_text(json.dumps(resolved_document(spec, site, resolve(spec, site), str(run_dir))))
    return run_dir


def mean_step_s(run_dir: Path, rank: int, warmup: int) -> float | None:
    """Train ``run_dir`` with the vote attached; rank 0's mean step time after warm-up."""
    import torch

    from trainer.loop import train
    from trainer.preemption import PreemptionFlag
    from trainer.resilience import resilience_for
    from trainer.run import load_run
    from trainer.train import build_trainer, resume

    run = load_run(run_dir)
    flag = PreemptionFlag()
    trainer, state = build_trainer(run, rank, torch.device("cpu"), flag)
    trainer.resilience = resilience_for(run, rank, flag)
    train(trainer, resume(trainer, state))
    if rank != 0:
        return None
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    seconds = steps = 0.0
    for before, line in zip(lines, lines[1:]):
        if before["step"] >= warmup:
            covered = line["step"] - before["step"]
            seconds, steps = seconds + line["step_time_s"] * covered, steps + covered
    return seconds / steps


def measure(dirs: dict[str, str], rank: int, warmup: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"every": [], "default": []}
    for name in ("every0", "default1", "default2", "every3"):
        value = mean_step_s(Path(dirs[name]), rank, warmup)
        out[name[:-1]].append(value)
    return out


def worker(dirs_json: str, out: str, warmup: str) -> None:
    import torch

    from trainer.dist import detect_rank_env, init_distributed, shutdown

    torch.set_num_threads(1)
    env = detect_rank_env()
    init_distributed(env, "gloo", timeout_s=300)
    result = measure(json.loads(dirs_json), env.rank, int(warmup))
    if env.rank == 0:
        Path(out).write_text(json.dumps(result))
    shutdown(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--size", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        os._exit(0)
    from hpc.core.spec import Train

    default = Train().log_every
    ranks = 1 if args.strategy == "none" else 2
    print(f"GPT {args.size}, {args.strategy} on {ranks} rank(s), {args.steps} measured steps per round; "
          f"load average {os.getloadavg()[0]:.1f} at start")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        dirs = {name: str(make_run(root, name, 1 if name.startswith("every") else default, ranks, args))
                for name in ("every0", "default1", "default2", "every3")}
        if ranks == 1:
            import torch

            torch.set_num_threads(1)
            result = measure(dirs, 0, args.warmup)
        else:
            out = root / "result.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
                   "--worker", json.dumps(dirs), str(out), str(args.warmup)]
            subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=REPO,
                           stdout=subprocess.DEVNULL)
            result = json.loads(out.read_text())
    every, dflt = (sum(result[k]) / len(result[k]) for k in ("every", "default"))
    print(f"log_every 1: {1000 * every:.1f} ms/step   log_every {default}: {1000 * dflt:.1f} ms/step   "
          f"ratio default / every-step {dflt / every:.3f}")
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end (1, 5, 15 min)")


if __name__ == "__main__":
    main()

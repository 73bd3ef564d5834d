"""Step time training from a manifest (``hpcx data prepare``) against synthetic tokens, same run otherwise.

    python bench/data_step/run.py [--size small] [--steps 30] [--warmup 5] [--rounds 2] [--workers 0]

One process (``--strategy none``), the trainer as ``python -m trainer RUN`` runs it, rounds in the
order synthetic, manifest, manifest, synthetic, …; each value is the median ``step_time_s`` of the
metrics lines after warm-up (``log_every`` 1), and the ratio is manifest / synthetic (goal ≤ 1.02).
The corpus is standard-library source tokenized with a BPE tokenizer trained on it; the model's
vocabulary is the tokenizer's (rounded up to 64) in both runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench" / "data_prepare"))


def make_run(root: Path, name: str, source: str, args: argparse.Namespace) -> Path:
    from hpc.core.resolve import resolved_document
    from hpc.plan.resolve import resolve
    from hpc.core.site import load_site
    from hpc.core.spec import load_spec

    spec = load_spec(REPO / "jobs" / "tiny-ddp.toml", [
        f"model.size={args.size!r}", "model.vocab_size=8192", f"model.seq_len={args.seq_len}",
        f"data.source={source!r}", f"data.num_workers={args.workers}", f"train.steps={args.warmup + args.steps}",
        "train.global_batch=8", "train.micro_batch=8", "train.log_every=1", f"train.warmup_metrics_steps={args.warmup}",
        "parallel.strategy='none'", "job.tasks_per_node=1", "checkpoint.interval_steps=0"])
    site = load_site("local")
    run_dir = root / name
    run_dir.mkdir(parents=True)
    (run_dir / "resolved.json").write_text(json.dumps(resolved_document(spec, site, resolve(spec, site), str(run_dir))))
    return run_dir


def median_step_s(run_dir: Path, warmup: int) -> float:
    env = {"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-m", "trainer", str(run_dir)], check=True, cwd=REPO, capture_output=True, env=env)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in lines if "step_time_s" in r and r["step"] > warmup)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args()
    from run import make_corpus

    from tests.tokens.corpus import train_tokenizer

    root = Path(tempfile.mkdtemp(prefix="hpcx-bench-step-"))
    try:
        files = make_corpus(root / "txt", 4)
        tokenizer = train_tokenizer(root / "tokenizer.json", files[:100], vocab=8192)
        subprocess.run([sys.executable, "-m", "hpc.cli", "data", "prepare", str(root / "txt"), "--tokenizer",
                        str(tokenizer), "--out", str(root / "data")], check=True, cwd=REPO, capture_output=True)
        times: dict[str, list[float]] = {"synthetic": [], "manifest": []}
        for r in range(args.rounds):
            for kind in (("synthetic", "manifest") if r % 2 == 0 else ("manifest", "synthetic")):
                source = "synthetic" if kind == "synthetic" else str(root / "data")
                times[kind].append(median_step_s(make_run(root, f"{kind}-{r}", source, args), args.warmup))
        syn, man = statistics.median(times["synthetic"]), statistics.median(times["manifest"])
        print(f"{args.size} GPT, seq_len {args.seq_len}, global batch 8, 1 process, data.num_workers {args.workers}, "
              f"{args.rounds} rounds of {args.steps} steps")
        print(f"synthetic: {syn * 1000:.1f} ms/step  (rounds: {', '.join(f'{t * 1000:.1f}' for t in times['synthetic'])})")
        print(f" manifest: {man * 1000:.1f} ms/step  (rounds: {', '.join(f'{t * 1000:.1f}' for t in times['manifest'])})")
        print(f"manifest / synthetic: {man / syn:.3f}×")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Run folders for trainer tests, built the way ``hpcx submit`` builds them (spec + site → resolved.json)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hpc.core.resolve import resolved_document
from hpc.plan.resolve import resolve
from hpc.core.site import load_site
from hpc.core.spec import load_spec

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "jobs" / "tiny-ddp.toml"
# 10 steps, global batch 8, clipping active (the tiny GPT's early grad norms are above 0.5); a metrics line
# every step, so that tests compare losses step by step.
BASE = ["train.steps=10", "train.global_batch=8", "train.lr=3e-3", "train.warmup_steps=2", "train.grad_clip=0.5",
        "train.weight_decay=0.1", "train.seed=1234", "parallel.timeout_s=60", "train.log_every=1"]


def make_run(root: Path, name: str, strategy: str, ranks: int, overrides: list[str] = (), site: str = "local") -> Path:
    """A run folder with ``resolved.json`` for the tiny GPT under ``strategy`` on ``ranks`` local processes."""
    sets = BASE + [f"parallel.strategy={strategy!r}", f"job.tasks_per_node={ranks}", "job.nodes=1",
                   "train.micro_batch=1"] + list(overrides)
    spec = load_spec(TINY, sets)
    site_profile = load_site(site)
    launch = resolve(spec, site_profile)
    run_dir = Path(root) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    doc = resolved_document(spec, site_profile, launch, str(run_dir))
    (run_dir / "resolved.json").write_text(json.dumps(doc, indent=1))
    return run_dir


def read_losses(run_dir: Path) -> list[float]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r.get("kind") != "ranks"]  # not the straggler report's


def child_env(threads: int = 1) -> dict[str, str]:
    """Environment for child ranks: one intra-op thread each (2 shared cores), no inherited rank variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "SUBMITIT_EXECUTOR")}
    env.update(OMP_NUM_THREADS=str(threads), PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    return env


def torchrun(nproc: int, args: list[str], timeout: float = 300, port: int = 0) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=N ARGS`` with the test environment."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone", *args]
    return subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=timeout, cwd=REPO)

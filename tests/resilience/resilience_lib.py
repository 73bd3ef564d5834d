"""Helpers of the resilience tests: token files, run folders, metrics and checkpoint comparison."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hpc.core import runs
from tests.conftest import REPO, hpcx

TINY_SEQ, TINY_VOCAB = 64, 256


def token_file(path: Path, samples: int = 120, seed: int = 7) -> Path:
    """A ``.bin`` of uint16 tokens for the tiny GPT: ``samples`` samples, so shuffling is exercised."""
    rng = np.random.default_rng(seed)
    rng.integers(0, TINY_VOCAB, samples * TINY_SEQ + 1, dtype=np.uint16).tofile(path)
    return path


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """Step → loss from metrics.jsonl; a step logged twice (recomputed after a restart) must agree."""
    out: dict[int, float] = {}
    for record in runs.read_jsonl(Path(run_dir) / "metrics.jsonl"):
        if record.get("kind") == "ranks":  # the straggler report's per-interval line (trainer.straggler)
            continue
        step, loss = record["step"], record["loss"]
        assert out.get(step, loss) == loss, f"step {step} recomputed with another loss: {out[step]} vs {loss}"
        out[step] = loss
    return out


def ledger(run_dir: Path) -> list[dict]:
    return runs.read_jsonl(Path(run_dir) / "ledger.jsonl")


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (Path(run_dir) / "checkpoints").glob("step-*"))


def same_checkpoint_tensors(a: Path, b: Path, prefixes: tuple[str, ...] = ("model.", "optim.")) -> list[str]:
    """Keys under ``prefixes`` whose tensors differ (bitwise) between two DCP folders; [] when equal."""
    import torch

    from hpc.ckpt.dcp import DcpReader

    ra, rb = DcpReader(a), DcpReader(b)
    try:
        keys = sorted(k for k in ra.entries if k.startswith(prefixes))
        assert keys and keys == sorted(k for k in rb.entries if k.startswith(prefixes)), "different keys"
        differ = []
        for key in keys:
            x, y = ra.read(key), rb.read(key)
            if isinstance(x, torch.Tensor):
                if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                    differ.append(key)
            elif x != y:
                differ.append(key)
        return differ
    finally:
        ra.close()
        rb.close()


def submit(job: str, *sets: str, site: str | None = None, env: dict | None = None, timeout: float = 300) -> Path:
    """``hpcx submit JOB --set ... --json``; the run folder. Output goes through a file (a local job's
    controller no longer holds the caller's descriptors: tests/test_local_submit.py checks it with a pipe)."""
    args = [a for s in sets for a in ("--set", s)] + (["--site", site] if site else [])
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        code = subprocess.run([sys.executable, "-m", "hpc.cli", "submit", job, *args, "--json"], stdout=out,
                              stderr=err, timeout=timeout, env={**os.environ, **(env or {})}, cwd=REPO).returncode
        out.seek(0)
        err.seek(0)
        text = out.read()
        assert code == 0, text + err.read()
    return Path(json.loads(text)["run_dir"])


def wait_state(run_dir: Path, states: tuple[str, ...], timeout: float = 300, env: dict | None = None) -> dict:
    deadline = time.time() + timeout
    info: dict = {}
    while time.time() < deadline:
        out = hpcx("status", str(run_dir), "--json", env=env)
        info = json.loads(out.stdout) if out.returncode == 0 else {}
        if any(str(info.get("state", "")).startswith(s) for s in states):
            return info
        time.sleep(1)
    raise AssertionError(f"{run_dir} never reached {states}: last {info}")

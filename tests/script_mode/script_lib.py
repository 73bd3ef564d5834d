"""Helpers of the script-mode tests: a folder with the user's script and its spec, submit, wait, read."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hpc.core import runs
from tests.conftest import hpcx

HERE = Path(__file__).resolve().parent
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


def script_folder(folder: Path, command: list[str], *, name: str = "script", nodes: int = 1, tasks: int = 2,
                  extra: str = "", run_root: Path | None = None) -> Path:
    """``folder`` with ``ddp_script.py`` and ``job.toml`` running ``command`` there; the spec's path."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(HERE / "ddp_script.py", folder / "ddp_script.py")
    root = f'run_root = {json.dumps(str(run_root))}\n' if run_root else ""
    (folder / "job.toml").write_text(
        f'[job]\nname = "{name}"\nnodes = {nodes}\ntasks_per_node = {tasks}\nmax_requeues = 2\n{root}'
        f"command = {json.dumps(command)}\n{extra}")
    return folder / "job.toml"


def submit_in(folder: Path, *args: str, timeout: float = 300) -> Path:
    """``hpcx submit job.toml --json`` run in ``folder`` (the script's folder); the run folder. Output goes
    through files: a local job's controller must not hold the caller's pipes."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        code = subprocess.run([sys.executable, "-m", "hpc.cli", "submit", "job.toml", *args, "--json"], stdout=out,
                              stderr=err, timeout=timeout, cwd=folder, env=dict(os.environ)).returncode
        out.seek(0)
        err.seek(0)
        text = out.read()
        assert code == 0, text + err.read()
    return Path(json.loads(text)["run_dir"])


def status(run_dir: Path) -> dict:
    out = hpcx("status", str(run_dir), "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def wait_state(run_dir: Path, timeout: float = 300) -> dict:
    """Poll ``hpcx status`` until the job ends (a hang guard, not a timing)."""
    deadline = time.time() + timeout
    while True:
        found = status(run_dir)
        if str(found.get("state", "")).split()[0] in TERMINAL:
            return found
        assert time.time() < deadline, f"{run_dir}: still {found.get('state')} after {timeout} s"
        time.sleep(1)


def ledger(run_dir: Path) -> list[dict]:
    return runs.read_jsonl(Path(run_dir) / "ledger.jsonl")


def losses(run_dir: Path) -> dict[int, float]:
    """step → loss of the script's ``hpc.job.log`` lines; a step logged twice must agree."""
    out: dict[int, float] = {}
    for line in runs.read_jsonl(Path(run_dir) / "metrics.jsonl"):
        assert out.get(line["step"], line["loss"]) == line["loss"], line
        out[line["step"]] = line["loss"]
    return out


def final_weights(out: Path) -> dict:
    import torch

    return torch.load(out / "final.pt", weights_only=True)


def same_weights(a: dict, b: dict) -> bool:
    import torch

    return a["step"] == b["step"] and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def seen(out: Path, restart: int, rank: int) -> dict:
    return json.loads((out / f"env-{restart}-rank{rank}.json").read_text())

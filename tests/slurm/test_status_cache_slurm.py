"""`hpcx status` on the real sandbox with its caches warm: the queries the last list ran (sacct and squeue
of real jobs) are started before the list's code is imported and handed to it, and the list is the one
the Click command prints from cold caches (``hpc.login.status``, ``hpc.login.siteroots``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from hpc.login import status
from tests.conftest import REPO
from tests.test_slurm_vars import site_path_with

CONSOLE_SCRIPT = "import sys; from hpc.entry import main; main()"


def sbatch(*wrap: str) -> str:
    out = subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", "-J", "hpcx-cache-test", "--wrap", *wrap],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def wait_for(job: str, states: tuple[str, ...]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "State"], capture_output=True, text=True)
        if out.stdout.strip() in states:
            return
        time.sleep(0.5)
    raise AssertionError(f"job {job} is not {' or '.join(states)}")


def live_runs(root: Path, jobs: list[str]) -> None:
    """A run folder per job, none recorded as ended (reset before every list, as the bench does)."""
    for n, job in enumerate(jobs):
        run = root / f"cache-{n}"
        run.mkdir(parents=True, exist_ok=True)
        (run / "resolved.json").write_text(json.dumps({"launch": {"world_size": 2}}))
        (run / "job.json").write_text(json.dumps({"job_id": job, "scheduler": "slurm"}))
        (run / "states.jsonl").write_text(json.dumps({"state": "RUNNING", "time": 1.0}) + "\n")
        os.utime(run, (1e9 + n, 1e9 + n))


def test_a_warm_list_takes_the_queries_started_ahead_and_prints_the_cold_list(sandbox, tmp_path):
    ended = [sbatch("true"), sbatch("exit 3")]
    running = sbatch("sleep 300")
    try:
        for job in ended:
            wait_for(job, ("COMPLETED", "FAILED"))
        wait_for(running, ("RUNNING",))
        root = tmp_path / "runs"
        env = {**os.environ, **site_path_with(tmp_path, root)}
        jobs = [*ended, running]
        outputs = []
        for how in ("fast", "fast", "click"):
            live_runs(root, jobs)
            if how == "click":
                env["XDG_CACHE_HOME"] = str(tmp_path / "cold")
            argv = ["-c", CONSOLE_SCRIPT] if how == "fast" else ["-m", "hpc.cli"]
            done = subprocess.run([sys.executable, *argv, "status"], capture_output=True, text=True, env=env,
                                  timeout=120, cwd=REPO)
            assert done.returncode == 0 and done.stderr == "", done.stderr
            outputs.append(done.stdout)
        assert outputs[0] == outputs[1] == outputs[2]
        states = [line.split("  ")[2] for line in outputs[0].splitlines()]
        assert states == ["RUNNING", "FAILED", "COMPLETED"]
        cache = Path(tmp_path / "cache" / "hpcx" / status.QUERIES)
        record = json.loads(cache.read_text())["commands"]
        assert sorted(cmd[0] for cmd in record) == ["sacct", "squeue"]
        assert all(",".join(sorted(jobs)) == ",".join(sorted(cmd[cmd.index("-j") + 1].split(","))) for cmd in record)
    finally:
        subprocess.run(["scancel", running], timeout=60)

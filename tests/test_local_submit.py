"""`hpcx submit` on the embedded `local` site: a real job through submitit's local executor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, hpcx
from tests.test_cli import PROBE

JOB = str(REPO / "jobs/tiny-ddp.toml")


def test_main_job_runs_and_prints_result(run_root: Path):
    out = hpcx("submit", JOB, "--set", f"job.run_root={json.dumps(str(run_root))}", "--set", "train.steps=6",
               "--set", "train.log_every=4", "--wait", timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("submitted job ") and "local" in lines[0]
    result = next(ln for ln in lines if ln.startswith("result: "))
    assert result.startswith("result: 6 steps, loss ") and result.endswith("2 ranks, ddp")
    run_dir = Path(next(ln.split(": ", 1)[1] for ln in lines if ln.startswith("run folder:")))
    assert run_dir.parent == run_root
    metrics = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [2, 4, 6]  # the end of warm-up, every log_every steps, the last
    assert all(0 <= m["data_s"] < m["step_time_s"] for m in metrics)
    assert all(sum(m["phases_s"].values()) == pytest.approx(m["step_time_s"]) for m in metrics)
    world = json.loads((run_dir / "world.json").read_text())
    assert world["world_size"] == 2 and world["all_reduce"] == 2
    status = json.loads(hpcx("status", str(run_dir), "--json").stdout)
    assert status["state"] == "COMPLETED" and status["step"] == 6
    for rank in range(2):  # built on the meta device, materialized whole on each rank (ddp)
        log = (run_dir / "logs" / f"rank-{rank}.log").read_text()
        assert "model built on meta, materialized on cpu: 135808 of 135808 parameters on this rank (100.0%)" in log


def test_submit_never_imports_torch_and_returns_at_once(run_root: Path, tmp_path: Path):
    """The job's model is built only once the test opens a gate: submit returns while the job waits
    there (a submit that waited for its job would never return), not within some number of seconds.
    Output goes through files: the job's controller inherits them and would hold a pipe open."""
    gate = tmp_path / "gate"
    model = ['model.arch="tests.gated_model:build"', "model.seq_len=8", "model.vocab_size=64",
             f"model.kwargs={{gate = {json.dumps(str(gate))}}}"]
    sets = [f"job.run_root={json.dumps(str(run_root))}", "train.steps=3", *model]
    try:
        with (tmp_path / "out").open("w+") as out, (tmp_path / "err").open("w+") as err:
            subprocess.run([sys.executable, "-c", PROBE, "submit", JOB, "--json",
                            *(a for s in sets for a in ("--set", s))], stdout=out, stderr=err, timeout=120, cwd=REPO)
        stderr = (tmp_path / "err").read_text()
        assert "HEAVY=\n" in stderr + "\n", stderr[-2000:]
        run_dir = json.loads((tmp_path / "out").read_text())["run_dir"]
        assert json.loads(hpcx("status", run_dir, "--json").stdout)["state"] not in ("COMPLETED", "FAILED")
    finally:
        gate.touch()  # the job goes on (and ends) whatever the test found
    deadline = time.time() + 300
    while time.time() < deadline:
        state = json.loads(hpcx("status", run_dir, "--json").stdout)["state"]
        if state in ("COMPLETED", "FAILED"):
            break
        time.sleep(1)
    assert state == "COMPLETED"


def test_submit_returns_while_the_job_runs_its_controller_holding_none_of_the_callers_stdio(run_root: Path):
    """`RUN=$(hpcx submit …)` and `hpcx submit --json | cat` read the pipe to its end: the controller
    must not hold it (it writes to the run's submitit/controller.log)."""
    from hpc.schedulers.local.scheduler import controller_alive

    out = subprocess.run([sys.executable, "-m", "hpc.cli", "submit", JOB, "--json",
                          "--set", f"job.run_root={json.dumps(str(run_root))}", "--set", "train.steps=100000"],
                         stdin=subprocess.PIPE, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    run_dir = Path(info["run_dir"])
    try:
        assert controller_alive(info["job_id"], run_dir)  # 100000 steps: still training
        fds = {fd: os.readlink(f"/proc/{info['job_id']}/fd/{fd}") for fd in (0, 1, 2)}
        assert fds[0] == os.devnull
        assert fds[1] == fds[2] == str(run_dir / "submitit" / "controller.log")
    finally:
        from tests.resilience.resilience_lib import wait_state

        assert hpcx("cancel", str(run_dir)).returncode == 0
        assert wait_state(run_dir, ("CANCELLED", "FAILED", "COMPLETED"))["state"] == "CANCELLED"


def test_a_user_model_without_blocks_trains_under_ddp(run_root: Path, tmp_path: Path):
    """ddp wraps the whole model: a user model with no ``blocks`` (its layers in a Sequential) trains;
    the same model with activation checkpointing is refused at start naming that feature."""
    (tmp_path / "noblocks.py").write_text((REPO / "tests" / "trainer" / "dryrun_models.py").read_text())
    sets = ["--set", f"job.run_root={json.dumps(str(run_root))}", "--set", "train.steps=3", "--set",
            "model.seq_len=16", "--set", "model.vocab_size=64"]
    job = tmp_path / "job.toml"
    job.write_text((REPO / "jobs" / "tiny-ddp.toml").read_text().replace('arch = "gpt"\nsize = "tiny"',
                                                                         'arch = "noblocks:no_blocks"'))
    out = hpcx("submit", str(job), *sets, "--wait", timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert next(ln for ln in out.stdout.splitlines() if ln.startswith("result: ")).endswith("2 ranks, ddp")
    refused = hpcx("dryrun", str(job), *sets, "--set", "parallel.activation_checkpointing=true", cwd=tmp_path,
                   timeout=300)
    assert refused.returncode == 2 and "needed by parallel.activation_checkpointing" in refused.stderr, refused.stderr

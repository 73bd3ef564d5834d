"""The spine on the real two-node Slurm sandbox: submit, run on n1 and n2, status, logs, cancel."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path


from tests.conftest import REPO, hpcx

JOB = str(REPO / "jobs/tiny-ddp.toml")
TWO_NODES = ["--site", "sandbox", "--set", "job.nodes=2", "--set", "job.tasks_per_node=2"]


def submit(*args: str, env: dict | None = None) -> dict:
    out = hpcx("submit", *args, "--json", env=env, timeout=600)
    assert out.returncode in (0, 1), out.stderr
    return json.loads(out.stdout)


def wait_for(run_dir: str, states: set[str], timeout: float = 300) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = json.loads(hpcx("status", run_dir, "--json").stdout)
        if info["state"] in states or any(info["state"].startswith(s) for s in states):
            return info
        time.sleep(1)
    raise AssertionError(f"{run_dir} never reached {states}: last {info}")


def test_two_node_job_runs_on_both_nodes(sandbox):
    out = hpcx("submit", JOB, *TWO_NODES, "--set", "train.steps=6", "--set", "train.log_every=1",
               "--set", "job.name=spine-2x2",
               "--wait", timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    run_dir = Path(next(ln.split(": ", 1)[1] for ln in out.stdout.splitlines() if ln.startswith("run folder:")))
    assert "result:" in out.stdout
    world = json.loads((run_dir / "world.json").read_text())
    assert world["world_size"] == 4 and world["all_reduce"] == 4
    assert sorted(world["hosts"]) == ["n1", "n1", "n2", "n2"]
    for rank in range(4):
        log = (run_dir / "logs" / f"rank-{rank}.log").read_text()
        assert f"rank {rank}/4" in log
    metrics = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 7))
    status = json.loads(hpcx("status", str(run_dir), "--json").stdout)
    assert status["state"] == "COMPLETED"
    assert status["states"][0] == "SUBMITTED" and status["states"][-1] == "COMPLETED"
    assert "RUNNING" in status["states"]
    assert status["step"] == 6
    by_id = json.loads(hpcx("status", status["job_id"], "--json").stdout)
    assert by_id["run_dir"] == str(run_dir)
    logs = hpcx("logs", str(run_dir), "--rank", "3")
    assert logs.returncode == 0 and "rank 3/4" in logs.stdout
    missing = hpcx("logs", str(run_dir), "--rank", "7")
    assert missing.returncode == 2 and "--rank 7" in missing.stderr and "4 ranks (0-3)" in missing.stderr


def test_run_folder_is_private(sandbox):
    info = submit(JOB, "--site", "sandbox", "--set", "train.steps=2", "--set", "job.tasks_per_node=1",
                  "--set", "parallel.strategy=none", "--set", "train.global_batch=2")
    run_dir = Path(info["run_dir"])
    assert run_dir.stat().st_mode & 0o777 == 0o700
    assert (run_dir / "resolved.json").stat().st_mode & 0o777 == 0o600
    wait_for(str(run_dir), {"COMPLETED", "FAILED", "CANCELLED"})
    assert (run_dir / "metrics.jsonl").stat().st_mode & 0o077 == 0


def test_cancel_cancels(sandbox):
    info = submit(JOB, *TWO_NODES, "--set", "train.steps=100000", "--set", "job.name=spine-cancel")
    wait_for(info["run_dir"], {"RUNNING"})
    out = hpcx("cancel", info["run_dir"])
    assert out.returncode == 0, out.stderr
    final = wait_for(info["run_dir"], {"CANCELLED"}, timeout=120)
    assert final["state"].startswith("CANCELLED")
    time.sleep(3)
    again = json.loads(hpcx("status", info["run_dir"], "--json").stdout)
    assert again["state"].startswith("CANCELLED"), "a cancel must never be requeued"


def test_hostile_strings_arrive_byte_exact(sandbox, tmp_path):
    nasty = "it's a \"test\" $(touch /tmp/hpcx-pwned) `touch /tmp/hpcx-pwned2`; echo $HOME & | > x"
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    os.chmod(probe_dir, 0o777)
    for p in ("/tmp/hpcx-pwned", "/tmp/hpcx-pwned2"):
        Path(p).unlink(missing_ok=True)
    secret = "hf_" + hashlib.sha256(str(time.time()).encode()).hexdigest()[:20]
    spec = tmp_path / "probe.toml"
    spec.write_text(f"""
[job]
nodes = 2
tasks_per_node = 1
[model]
arch = "probe_model:build"
seq_len = 64
vocab_size = 256
kwargs = {{out_dir = {json.dumps(str(probe_dir))}}}
[train]
steps = 2
global_batch = 2
[parallel]
strategy = "ddp"
[env]
set = {{PYTHONPATH = {json.dumps(str(Path(__file__).parent))}}}
passthrough = ["HF_TOKEN"]
""")
    out = hpcx("submit", str(spec), "--site", "sandbox", "--set", f"job.name={nasty}",
               "--set", f"env.set.MY_VAR={nasty}", "--wait", env={"HF_TOKEN": secret}, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        seen = json.loads((probe_dir / f"probe-{rank}.json").read_text())
        assert seen["MY_VAR"] == nasty
        assert seen["SLURM_JOB_NAME"] == nasty
        assert seen["HF_TOKEN_sha256"] == hashlib.sha256(secret.encode()).hexdigest()
    assert not Path("/tmp/hpcx-pwned").exists() and not Path("/tmp/hpcx-pwned2").exists()
    run_dir = Path(next(ln.split(": ", 1)[1] for ln in out.stdout.splitlines() if ln.startswith("run folder:")))
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), f"secret written to {path}"


def test_rendered_script_is_what_was_submitted(sandbox):
    info = submit(JOB, "--site", "sandbox", "--set", "train.steps=1", "--set", "job.tasks_per_node=1",
                  "--set", "parallel.strategy=none", "--set", "train.global_batch=2")
    run_dir = Path(info["run_dir"])
    submitted = (run_dir / "submitit" / f"{info['job_id']}_submission.sh").read_text()
    assert submitted == (run_dir / "render.txt").read_text()
    wait_for(str(run_dir), {"COMPLETED", "FAILED"})


def test_status_falls_back_without_sacct(sandbox, tmp_path):
    """Where accounting is unavailable, state comes from squeue (queued/running) or scontrol."""
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "sacct").write_text("#!/bin/sh\necho 'sacct: error: accounting storage is disabled' >&2\nexit 1\n")
    (shim / "sacct").chmod(0o755)
    no_sacct = {"PATH": f"{shim}:{os.environ['PATH']}"}
    info = submit(JOB, *TWO_NODES, "--set", "train.steps=100000", "--set", "job.name=spine-nosacct")
    deadline = time.time() + 120
    while time.time() < deadline:
        seen = json.loads(hpcx("status", info["run_dir"], "--json", env=no_sacct).stdout)
        if seen["state"] == "RUNNING":
            break
        time.sleep(1)
    assert seen["state"] == "RUNNING" and seen["nodes"] == "n[1-2]"
    hpcx("cancel", info["run_dir"])
    deadline = time.time() + 120
    while time.time() < deadline:  # squeue says COMPLETING for a moment, then scontrol answers
        gone = json.loads(hpcx("status", info["run_dir"], "--json", env=no_sacct).stdout)
        if gone["state"] not in ("RUNNING", "COMPLETING"):
            break
        time.sleep(1)
    assert gone["state"] == "CANCELLED"


def test_hsdp_replicates_across_nodes_and_shards_within_one(sandbox):
    out = hpcx("submit", str(REPO / "jobs/tiny-hsdp-2node.toml"), "--site", "sandbox", "--set", "train.steps=4",
               "--set", "checkpoint.interval_steps=0", "--set", "train.log_every=1", "--wait", timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    run_dir = Path(next(ln.split(": ", 1)[1] for ln in out.stdout.splitlines() if ln.startswith("run folder:")))
    hosts = json.loads((run_dir / "world.json").read_text())["hosts"]
    mesh = json.loads((run_dir / "mesh.json").read_text())
    assert [[hosts[r] for r in g] for g in mesh["dp_shard"]] == [["n1", "n1"], ["n2", "n2"]]
    assert all(sorted(hosts[r] for r in g) == ["n1", "n2"] for g in mesh["dp_replicate"])
    metrics = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4] and all(m["loss"] > 0 for m in metrics)
    for rank in range(4):  # built on the meta device; each rank allocated and initialised half the model
        log = (run_dir / "logs" / f"rank-{rank}.log").read_text()
        assert "model built on meta, materialized on cpu: 67904 of 135808 parameters on this rank (50.0%)" in log


def test_a_refused_submission_is_one_line_and_leaves_no_run_folder(sandbox):
    out = hpcx("submit", JOB, "--site", "sandbox", "--set", "job.partition=nosuch", "--set", "job.name=refused")
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the scheduler refused the job: ")
    assert "partition" in lines[0].lower() and "Traceback" not in out.stderr
    assert not [p for p in sandbox.iterdir() if p.name.startswith("refused-")]

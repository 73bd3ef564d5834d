"""Issue 14 on the real Slurm sandbox: #SBATCH values as sbatch reads them, a full disk at submit,
and runs made under a spec's run root found again. Jobs are submitted held (`hold = true` in the
site's [scheduler.sbatch]), read back with squeue, and cancelled: none of them runs."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, hpcx
from tests.test_inputs import NASTY, sbatch_directive_words

JOB = str(REPO / "jobs/tiny-ddp.toml")


def held_site(tmp_path: Path, comment: str | None = None) -> Path:
    path = tmp_path / "held.toml"
    extra = "[scheduler.sbatch]\nhold = true\n" + (f"comment = {json.dumps(comment)}\n" if comment else "")
    path.write_text((REPO / "site/sandbox.toml").read_text() + extra)
    return path


def squeue_field(job_id: str, field: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", field], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.rstrip("\n")


def cancel(job_id: str) -> None:
    subprocess.run(["scancel", job_id], check=False, timeout=30)


@pytest.mark.slurm
def test_names_and_comments_arrive_byte_exact(sandbox, tmp_path: Path):
    """Through hpcx submit, sbatch reads back job.name and a [scheduler.sbatch] value exactly, backslashes
    included (a job named a\\b\\\\c used to show as ab\\c)."""
    for n, value in enumerate(NASTY):
        name = value if not value.startswith("-") else "x" + value
        env = {"XDG_STATE_HOME": str(tmp_path / "state")}
        out = hpcx("submit", JOB, "--site", str(held_site(tmp_path, value)), "--json", "--set", "job.nodes=1",
                   "--set", f"job.name={json.dumps(name)}",
                   "--set", f"job.run_root={json.dumps(str(tmp_path / 'runs'))}",
                   env=env)
        assert out.returncode == 0, out.stderr
        job_id = json.loads(out.stdout)["job_id"]
        try:
            assert squeue_field(job_id, "%j") == name, (n, value)
            assert squeue_field(job_id, "%k") == value, (n, value)
        finally:
            cancel(job_id)


@pytest.mark.slurm
def test_directive_parser_model_matches_sbatch(sandbox, tmp_path: Path):
    """The model in test_inputs.py reads plain shlex-quoted lines as sbatch does (backslash bug and all)."""
    for n, value in enumerate(NASTY):
        script = tmp_path / f"raw-{n}.sh"
        line = f"#SBATCH --comment={shlex.quote(value)}"
        script.write_text(f"#!/bin/bash\n{line}\n#SBATCH --hold\n#SBATCH --output=/dev/null\ntrue\n")
        out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=60)
        try:
            expected = sbatch_directive_words(line)[0].split("=", 1)[1]
        except ValueError:  # the model finds a quote left open: sbatch must refuse the script
            assert out.returncode != 0 and "Unmatched" in out.stderr, (value, out.stdout, out.stderr)
            continue
        assert out.returncode == 0, (value, out.stderr)
        job_id = out.stdout.strip().split(";")[0]
        try:
            assert squeue_field(job_id, "%k") == expected, (n, value)
        finally:
            cancel(job_id)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):
    """Mount a tmpfs of a given size (KiB) at a fresh folder; unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (the RLIMIT_FSIZE test in test_inputs.py runs anywhere)")
    mounted: list[Path] = []

    def mount(kib: int) -> Path:
        point = tmp_path / f"fs-{kib}"
        point.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k,mode=0755", "tmpfs", str(point)], check=True)
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], check=False)


@pytest.mark.slurm
def test_full_disk_at_submit_leaves_nothing(sandbox, tmp_path: Path, tiny_tmpfs):
    """Run roots on file systems of 0 to 44 KiB: each submit either succeeds whole, or says why in one
    line with exit 2 and leaves no folder, no temporary file and no job behind."""
    site = held_site(tmp_path)
    seen = set()
    for kib in range(0, 48, 4):
        root = tiny_tmpfs(kib) if kib else tiny_tmpfs(1)
        out = hpcx("submit", JOB, "--site", str(site), "--set", "job.nodes=1",
                   "--set", f"job.run_root={json.dumps(str(root))}", env={"XDG_STATE_HOME": str(tmp_path / "state")})
        assert "Traceback" not in out.stderr, out.stderr
        if out.returncode == 0:
            job_id = out.stdout.split()[2]
            [run] = list(root.iterdir())
            try:
                files = ("spec.toml", "resolved.json", "render.txt", "job.json")
                assert all((run / f).stat().st_size > 0 for f in files)
                assert json.loads((run / "job.json").read_text())["job_id"] == job_id
            finally:
                cancel(job_id)
            seen.add("submitted")
            continue
        assert out.returncode == 2, out.stdout + out.stderr
        [line] = out.stderr.splitlines()
        assert list(root.iterdir()) == [], (kib, line)
        if "was cancelled" in line:
            job_id = line.split(" job ")[1].split()[0]
            assert squeue_field(job_id, "%T") in ("", "CANCELLED"), line
            seen.add("cancelled after submission")
        elif "cannot write the job's files" in line:
            seen.add("submitit's files")
        else:
            assert ("cannot write the run folder (No space left on device)" in line
                    or "cannot create a run folder" in line), line
            seen.add("run folder")
    # every stage met a full disk at least once, and a roomy enough one succeeded
    assert seen == {"run folder", "submitit's files", "cancelled after submission", "submitted"}, seen


@pytest.mark.slurm
def test_runs_under_a_spec_run_root_are_found_again(sandbox, tmp_path: Path):
    env = {"XDG_STATE_HOME": str(tmp_path / "state")}
    root = tmp_path / "my-runs"
    out = hpcx("submit", JOB, "--site", str(held_site(tmp_path)), "--json", "--set", "job.nodes=1",
               "--set", f"job.run_root={json.dumps(str(root))}", "--set", 'job.name="findme"', env=env)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    name = Path(info["run_dir"]).name
    try:
        for ref in (name, info["job_id"]):
            status = hpcx("status", ref, "--json", env=env)
            assert status.returncode == 0, status.stderr
            assert json.loads(status.stdout)["run_dir"] == info["run_dir"]
        assert name in hpcx("status", env=env).stdout
        cancelled = hpcx("cancel", name, env=env)
        assert cancelled.returncode == 0 and cancelled.stdout.startswith(f"cancelled {name} "), cancelled.stderr
    finally:
        cancel(info["job_id"])


@pytest.mark.slurm
def test_an_unwritable_index_costs_only_a_warning(sandbox, tmp_path: Path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    out = hpcx("submit", JOB, "--site", str(held_site(tmp_path)), "--json", "--set", "job.nodes=1",
               "--set", f"job.run_root={json.dumps(str(tmp_path / 'runs'))}", env={"XDG_STATE_HOME": str(blocker)})
    assert out.returncode == 0, out.stderr
    job_id = json.loads(out.stdout)["job_id"]
    cancel(job_id)
    assert out.stderr == (f"warning: could not record {tmp_path / 'runs'} in {blocker}/hpcx/run-roots "
                          "(Not a directory): give `hpcx status` the run folder's path\n")

"""A run root shared by two real Unix users (the sandbox's run root, mode 1777, as a project's scratch
folder): each user's `hpcx status` lists and resolves (by name or job id: status, logs, cancel, drill)
only that user's runs, skips the other's without an error, and never fails on a folder it cannot read.

The second user is ``hpcx-peer`` (``scripts/slurm-sandbox up`` adds it). It runs the checkout's `hpcx`
with the system's Python 3.11 (this venv's interpreter lives under root's 0700 home) and the venv's
packages on ``sys.path``; its run is a real Slurm job it submitted itself."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, hpcx
from tests.resilience.resilience_lib import submit, wait_state
from tests.slurm.conftest import SANDBOX_RUNS

PEER = "hpcx-peer"
SYSTEM_PYTHON = "/usr/bin/python3"
SITE_PACKAGES = next((Path(sys.prefix) / "lib").glob("python3*/site-packages"))
LAUNCH = (f"import sys; sys.path[:0] = [{str(REPO)!r}, {str(SITE_PACKAGES)!r}]; sys.argv[0] = 'hpcx'; "
          "from hpc.cli import main; main()")


@pytest.fixture(scope="module")
def peer(sandbox) -> pwd.struct_passwd:
    try:
        user = pwd.getpwnam(PEER)
    except KeyError:
        pytest.fail(f"no user {PEER}: run scripts/slurm-sandbox up (it adds the user)")
    if os.getuid() != 0 or not Path(SYSTEM_PYTHON).is_file():
        pytest.skip("needs root (runuser) and the system's python3")
    return user


def as_peer(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run a command as the peer user, with its own home (its own index of run roots)."""
    home = pwd.getpwnam(PEER).pw_dir
    return subprocess.run(["runuser", "-u", PEER, "--", "env", f"HOME={home}", f"PATH={os.environ['PATH']}",
                           *args], capture_output=True, text=True, timeout=timeout, cwd="/tmp")


def peer_hpcx(*args: str) -> subprocess.CompletedProcess:
    return as_peer(SYSTEM_PYTHON, "-c", LAUNCH, *args)


def peer_run(name: str) -> tuple[Path, str]:
    """A run folder the peer made in the shared root (0700, as hpcx makes them) with a real Slurm job."""
    job = as_peer("sbatch", "--parsable", "-J", name, "-o", "/dev/null", "--wrap", "sleep 300")
    assert job.returncode == 0, job.stderr
    job_id = job.stdout.strip().split(";")[0]
    folder = SANDBOX_RUNS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(3).hex()}"
    make = ("import json, os, sys, time; f = sys.argv[1]; os.umask(0o077); os.mkdir(f); "
            "open(f + '/resolved.json', 'w').write(json.dumps({'launch': {'world_size': 1}})); "
            "open(f + '/job.json', 'w').write(json.dumps({'job_id': sys.argv[2], 'scheduler': 'slurm', "
            "'submitted_at': time.time()}))")
    made = as_peer(SYSTEM_PYTHON, "-c", make, str(folder), job_id)
    assert made.returncode == 0, made.stderr
    return folder, job_id


@pytest.fixture(scope="module")
def two_users(peer):
    """Root's real hpcx run (finished) and the peer's run (a job still running) in the shared root."""
    mine = submit(str(REPO / "jobs" / "tiny-hsdp-2node.toml"), "job.name=shared-root-mine", "train.steps=2",
                  site="sandbox")
    wait_state(mine, ("COMPLETED", "FAILED"), timeout=300)
    theirs, their_job = peer_run("shared-root-theirs")
    locked = SANDBOX_RUNS / f"shared-root-locked-{os.urandom(3).hex()}"  # the peer's own, but unreadable
    assert as_peer("sh", "-c", f"mkdir {locked} && echo {{}} > {locked}/resolved.json && chmod 000 {locked}"
                   ).returncode == 0
    yield mine, theirs, their_job
    subprocess.run(["scancel", their_job], capture_output=True)
    for folder in (theirs, locked):
        shutil.rmtree(folder, ignore_errors=True)


def test_each_user_lists_only_their_own_runs(two_users):
    mine, theirs, their_job = two_users
    listed = hpcx("status", "--json")
    assert listed.returncode == 0, listed.stderr
    names = {Path(r["run_dir"]).name for r in json.loads(listed.stdout)}
    assert mine.name in names and theirs.name not in names
    seen = peer_hpcx("status", "--json")
    assert seen.returncode == 0 and "Traceback" not in seen.stderr, seen.stderr
    rows = json.loads(seen.stdout)
    assert [Path(r["run_dir"]).name for r in rows] == [theirs.name]  # not root's, not its unreadable one
    assert rows[0]["job_id"] == their_job and rows[0]["state"] in ("PENDING", "RUNNING")  # asked Slurm as the peer
    assert peer_hpcx("status").stdout.count("\n") == 1


def test_names_and_job_ids_resolve_only_to_the_callers_runs(two_users):
    mine, theirs, their_job = two_users
    my_job = json.loads((mine / "job.json").read_text())["job_id"]
    for command in ("status", "logs", "cancel", "drill"):
        for ref in (theirs.name, their_job):
            out = hpcx(command, ref)
            assert out.returncode == 2 and out.stderr.startswith("error: ") and "Traceback" not in out.stderr, \
                (command, ref, out.stderr)
        for ref in (mine.name, my_job):
            out = peer_hpcx(command, ref)
            assert out.returncode == 2 and out.stderr.startswith("error: ") and "Traceback" not in out.stderr, \
                (command, ref, out.stderr)
    assert f"belongs to user {PEER}" in hpcx("status", theirs.name).stderr
    assert "belongs to user root" in peer_hpcx("status", mine.name).stderr
    state = subprocess.run(["squeue", "-h", "-j", their_job, "-o", "%T"], capture_output=True, text=True)
    assert state.stdout.strip() in ("PENDING", "RUNNING")  # nobody cancelled the peer's job
    assert json.loads(peer_hpcx("status", their_job, "--json").stdout)["run_dir"] == str(theirs)
    assert json.loads(hpcx("status", my_job, "--json").stdout)["run_dir"] == str(mine)

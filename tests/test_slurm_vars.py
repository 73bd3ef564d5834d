"""Slurm's own notations, read without a cluster: host lists, tasks per node, where slurmctld listens,
and `hpcx status` when the scheduler does not answer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.schedulers.base import UNREACHABLE
from hpc.schedulers.slurm.ranks import expand_hostlist, tasks_on_node
from hpc.schedulers.slurm.scheduler import SlurmScheduler, controller_addresses
from tests.conftest import REPO


@pytest.mark.parametrize("text,hosts", [
    ("n1", ["n1"]),
    ("n[1-2]", ["n1", "n2"]),
    ("n[1-3,7]", ["n1", "n2", "n3", "n7"]),
    ("gpu-a[01-03]", ["gpu-a01", "gpu-a02", "gpu-a03"]),
    ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),
    ("a1,b[2-3],c", ["a1", "b2", "b3", "c"]),
    ("rack[1-2]-node[1-2]", ["rack1-node1", "rack1-node2", "rack2-node1", "rack2-node2"]),
    ("node-7.cluster", ["node-7.cluster"]),
    ("x[5]", ["x5"]),
])
def test_host_lists_expand_like_scontrol_show_hostnames(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text,node,tasks", [
    ("2(x2)", 0, 2), ("2(x2)", 1, 2), ("8", 0, 8), ("3,2", 0, 3), ("3,2", 1, 2),
    ("4(x3),1", 2, 4), ("4(x3),1", 3, 1), ("1(x16)", 15, 1),
])
def test_tasks_on_this_node(text, node, tasks):
    assert tasks_on_node(text, node) == tasks


@pytest.mark.parametrize("text,node,words", [("2(x2)", 2, "not among the 2 nodes"), ("two", 0, "expected counts"),
                                            ("2(x)", 0, "expected counts")])
def test_tasks_per_node_that_do_not_parse_say_so(text, node, words):
    with pytest.raises(ValueError, match=words):
        tasks_on_node(text, node)


@pytest.mark.parametrize("conf,addresses", [
    ("SlurmctldHost=ctl(10.200.0.1)\nSlurmctldPort=6817\n", [("10.200.0.1", 6817)]),
    ("SlurmctldHost=head1\nSlurmctldHost=head2(10.0.0.2)\n", [("head1", 6817), ("10.0.0.2", 6817)]),
    ("slurmctldhost = ctl  # primary\nSlurmctldPort=6820-6823\n", [("ctl", 6820)]),
    ("ControlMachine=old\nControlAddr=10.1.1.1\nSlurmctldPort=7000\n", [("10.1.1.1", 7000)]),
    ("ControlMachine=old\n", [("old", 6817)]),
    ("# SlurmctldHost=commented(1.2.3.4)\nClusterName=x\n", []),
])
def test_where_slurmctld_listens(conf, addresses):
    assert controller_addresses(conf) == addresses


def bogus_conf(tmp_path: Path) -> Path:
    """A slurm.conf whose controller and accounting daemon listen nowhere (ports closed on 127.0.0.1):
    the cluster is down, while the shared sandbox keeps running."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=down\nSlurmctldHost=ctl(127.0.0.1)\nSlurmctldPort=1\n"
                    "AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=127.0.0.1\n"
                    "AccountingStoragePort=2\nAuthType=auth/none\n")
    return conf


def fake_runs(root: Path, count: int, first_job: int = 990000) -> list[Path]:
    """``count`` run folders of Slurm jobs that no scheduler knows, not recorded as ended."""
    made = []
    for i in range(count):
        run = root / f"fake-{i:03d}"
        run.mkdir(parents=True)
        (run / "resolved.json").write_text(json.dumps({"launch": {"world_size": 4}}))
        (run / "job.json").write_text(json.dumps({"job_id": str(first_job + i), "scheduler": "slurm"}))
        (run / "states.jsonl").write_text(json.dumps({"state": "RUNNING", "time": 1.0}) + "\n")
        made.append(run)
    return made


def site_path_with(tmp_path: Path, root: Path) -> dict[str, str]:
    """Environment where the only run root is ``root`` (a site profile named like the bundled ones)."""
    sites = tmp_path / "sites"
    sites.mkdir()
    for name in sorted(p.stem for p in (REPO / "site").glob("*.toml")):  # every shipped profile, shadowed
        text = (REPO / "site" / f"{name}.toml").read_text().replace("\nrun_root", "\n# run_root")
        # the root right under [storage] (not at the end: [container] may come after it)
        (sites / f"{name}.toml").write_text(text.replace("[storage]\n", f"[storage]\nrun_root = {json.dumps(str(root))}\n", 1)
                                            if "[storage]\n" in text else text)
    # and an empty index of remembered run roots (hpc/roots.py): earlier tests' submissions are not listed,
    # and caches of its own (hpc/login/cache.py): no queries an earlier test's list remembered
    return {"HPCX_SITE_PATH": str(sites), "HOME": str(tmp_path), "XDG_STATE_HOME": str(tmp_path / "state"),
            "XDG_CACHE_HOME": str(tmp_path / "cache")}


def test_states_of_an_unreachable_cluster_are_unknown_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", str(bogus_conf(tmp_path)))
    runs = fake_runs(tmp_path / "runs", 3)
    states = SlurmScheduler().states({str(990000 + i): r for i, r in enumerate(runs)}, timeout=20)
    assert {s.state for s in states.values()} == {"UNKNOWN"}
    assert all(s.detail["reason"] == UNREACHABLE and s.words == f"unknown ({UNREACHABLE})" for s in states.values())
    assert "slurmctld at 127.0.0.1:1" in states["990000"].detail["why"]


def test_status_list_says_unknown_when_the_cluster_is_down(tmp_path):
    root = tmp_path / "runs"
    fake_runs(root, 25)
    env = {**os.environ, **site_path_with(tmp_path, root), "SLURM_CONF": str(bogus_conf(tmp_path))}
    out = subprocess.run([sys.executable, "-m", "hpc.cli", "status"], capture_output=True, text=True, env=env,
                         timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 20 and all(f"unknown ({UNREACHABLE})" in line for line in lines), out.stdout
    listed = json.loads(subprocess.run([sys.executable, "-m", "hpc.cli", "status", "--json"], capture_output=True,
                                       text=True, env=env, timeout=60, cwd=REPO).stdout)
    assert {r["state"] for r in listed} == {"UNKNOWN"} and listed[0]["state_words"] == f"unknown ({UNREACHABLE})"


def hanging_tools(tmp_path: Path) -> dict[str, str]:
    """sacct, squeue and scontrol that never answer (a controller that accepts and hangs)."""
    shims = tmp_path / "bin"
    shims.mkdir()
    for tool in ("sacct", "squeue", "scontrol"):
        (shims / tool).write_text("#!/bin/sh\nexec sleep 600\n")
        (shims / tool).chmod(0o755)
    return {"PATH": f"{shims}:{os.environ['PATH']}"}


def test_status_list_gives_up_on_a_scheduler_that_hangs(tmp_path):
    root = tmp_path / "runs"
    fake_runs(root, 3)
    env = {**os.environ, **site_path_with(tmp_path, root), **hanging_tools(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "hpc.cli", "status"], capture_output=True, text=True, env=env,
                         timeout=300, cwd=REPO)  # a hang guard, half the tools' sleep 600: not a speed
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) == 3 and all(f"unknown ({UNREACHABLE})" in ln for ln in out.stdout.splitlines())


def test_recorded_final_states_are_not_asked_again(tmp_path):
    root = tmp_path / "runs"
    done = fake_runs(root, 2)
    for run in done:
        with open(run / "states.jsonl", "a") as f:
            f.write(json.dumps({"state": "COMPLETED", "time": 2.0}) + "\n")
    env = {**os.environ, **site_path_with(tmp_path, root), **hanging_tools(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "hpc.cli", "status"], capture_output=True, text=True, env=env,
                         timeout=120, cwd=REPO)
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and all("  COMPLETED  " in line for line in lines) and "unknown" not in out.stdout


def test_a_lagging_poll_does_not_repeat_what_the_job_recorded(tmp_path):
    """The job records each start (RUNNING) and each requeue (REQUEUED) itself; a poll that still sees
    the requeued incarnation RUNNING, then REQUEUED, must not add them again."""
    from hpc.login import submit
    from hpc.schedulers import JobState

    run = fake_runs(tmp_path / "runs", 1)[0]
    (run / "states.jsonl").write_text("".join(json.dumps(line) + "\n" for line in (
        {"state": "SUBMITTED"}, {"state": "RUNNING", "restart": 0}, {"state": "REQUEUED", "by": "rank 0"})))
    for polled in ("RUNNING", "REQUEUED", "PENDING", "PENDING", "UNKNOWN", "COMPLETED"):
        submit._record(run, JobState(polled))
    history = [json.loads(line)["state"] for line in (run / "states.jsonl").read_text().splitlines()]
    assert history == ["SUBMITTED", "RUNNING", "REQUEUED", "PENDING", "COMPLETED"]

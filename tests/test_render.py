"""Golden files for `hpcx render`: every example job × every shipped site.

Refresh after an intended change with:

    HPCX_UPDATE_GOLDENS=1 python -m pytest tests/test_render.py

then read the diff (`git diff tests/goldens`) before committing it.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest

from hpc.core.config import ConfigError
from hpc.core.errors import UserError
from hpc.core.imports import BOOT
from hpc.login.render import render, render_summary
from hpc.schedulers.slurm.scheduler import slurm_parameters
from hpc.plan.resolve import resolve
from hpc.core.site import list_sites, load_site
from hpc.core.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
GOLDENS = Path(__file__).parent / "goldens"
JOBS = sorted((REPO / "jobs").glob("*.toml"))
RUN_DIR = "/hpcx-runs/RUN"
PYTHON = "/venv/bin/python"


def rendered(job: Path, site_name: str) -> str:
    spec = load_spec(job)
    site = load_site(site_name)
    try:
        launch = resolve(spec, site)
    except ConfigError as exc:
        return "".join(f"error: {m.replace(str(job), 'jobs/' + job.name)}\n" for m in exc.messages)
    text = render_summary(spec, site, launch) + "\n" + render(spec, site, launch, RUN_DIR, PYTHON)
    return text.replace(str(REPO), "REPO")  # a task's notice names its file in the checkout


@pytest.mark.parametrize("site_name", list_sites())
@pytest.mark.parametrize("job", JOBS, ids=lambda p: p.stem)
def test_golden(job: Path, site_name: str):
    golden = GOLDENS / f"{job.stem}__{site_name}.txt"
    text = rendered(job, site_name)
    if os.environ.get("HPCX_UPDATE_GOLDENS"):
        golden.write_text(text)
    assert golden.exists(), f"missing golden {golden}: run HPCX_UPDATE_GOLDENS=1 pytest {__file__}"
    assert text == golden.read_text(), f"render changed; if intended: HPCX_UPDATE_GOLDENS=1 pytest {__file__}"


def test_no_stale_goldens():
    expected = {f"{j.stem}__{s}.txt" for j in JOBS for s in list_sites()}
    assert {p.name for p in GOLDENS.glob("*.txt")} == expected


def test_render_is_pure():
    job = REPO / "jobs/tiny-hsdp-2node.toml"
    assert rendered(job, "sandbox") == rendered(job, "sandbox")


def test_hostile_values_are_quoted(tmp_path: Path):
    nasty = "a b'$(touch /tmp/pwned)`id`\"; rm -rf ~"
    spec = load_spec(REPO / "jobs/tiny-hsdp-2node.toml", [f"job.name={nasty}", f"env.set.MY_VAR={nasty}"])
    assert spec.job.name == nasty and spec.env.set["MY_VAR"] == nasty
    site = load_site("sandbox")
    script = render(spec, site, resolve(spec, site), RUN_DIR, PYTHON)
    assert f"#SBATCH --job-name={shlex.quote(nasty)}" in script
    assert f"export MY_VAR={shlex.quote(nasty)}" in script
    # every line bash executes parses back to the same words: nothing runs
    for line in script.splitlines():
        if line.startswith("export MY_VAR="):
            assert shlex.split(line) == ["export", f"MY_VAR={nasty}"]


def test_secrets_never_rendered(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_supersecret")
    spec = load_spec(REPO / "jobs/tiny-hsdp-2node.toml", ['env.passthrough=["HF_TOKEN"]'])
    site = load_site("sandbox")
    script = render(spec, site, resolve(spec, site), RUN_DIR, PYTHON)
    assert "HF_TOKEN" in script and "hf_supersecret" not in script


def test_gpu_directives():
    spec = load_spec(REPO / "jobs/gpt-1.3b-fsdp.toml")
    for site_name, key, value in (("dgx-h100", "gpus_per_node", 8), ("pcie-4gpu", "gres", "gpu:4")):
        site = load_site(site_name)
        params = slurm_parameters(spec, site, resolve(spec, site), RUN_DIR, PYTHON)
        assert params[key] == value


# ---------------------------------------------------------------- failing like a cluster does


def sandbox_script(*sets: str, run_dir: str = RUN_DIR, python: str = PYTHON) -> str:
    spec = load_spec(REPO / "jobs/tiny-hsdp-2node.toml", list(sets))
    site = load_site("sandbox")
    return render(spec, site, resolve(spec, site), run_dir, python)


def command_lines(script: str) -> list[str]:
    """Lines bash runs (comments and #SBATCH lines out)."""
    return [line for line in script.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_srun_kills_every_task_when_one_fails():
    srun = next(line for line in sandbox_script().splitlines() if line.startswith("srun "))
    words = shlex.split(srun)
    assert "--kill-on-bad-exit=1" in words
    assert words.index("--kill-on-bad-exit=1") < words.index("/bin/sh")  # an srun option, not the task's


def test_usr2_is_trapped_before_srun_and_in_each_task():
    lines = command_lines(sandbox_script())
    trap = next(i for i, line in enumerate(lines) if shlex.split(line, comments=True) == ["trap", "", "USR2"])
    srun = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert trap < srun
    task = shlex.split(lines[srun])[shlex.split(lines[srun]).index("/bin/sh"):]
    assert task[:2] == ["/bin/sh", "-c"] and task[3] == "hpcx-task"
    assert task[2].startswith('trap "" USR2; ') and "exec env --block-signal=USR2 --block-signal=TERM" in task[2]
    assert task[4:] == [PYTHON, "-u", "-c", BOOT, "trainer.entry", f"{RUN_DIR}/submitit"]  # hpc.core.imports


def test_the_check_after_srun_gets_srun_status_and_the_run_folder():
    odd = "/runs/it's a run"
    lines = command_lines(sandbox_script(run_dir=odd))
    srun = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert lines[srun + 1].startswith("hpcx_srun_status=$?")  # nothing in between changes $?
    check = shlex.split(lines[srun + 2], comments=True)
    assert check[:2] == ["[", "$hpcx_srun_status"] and check[-6:] == [PYTHON, "-c", BOOT, "hpc.requeue", odd,
                                                                       "$hpcx_srun_status"]
    assert lines[-1] == 'exit "$hpcx_srun_status"'
    assert "export HPCX_REQUEUE_CHECK=after-srun" in "\n".join(lines)


def test_the_script_runs_the_check_only_when_srun_failed(tmp_path: Path):
    """The rendered teardown, run by bash with srun and python replaced by stand-ins."""
    import subprocess

    fake_python = tmp_path / "python"
    fake_python.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/check-ran\n")
    fake_python.chmod(0o755)
    script = sandbox_script(python=str(fake_python))
    body = script.split("# command\n", 1)[1]
    for status in (0, 137):
        (tmp_path / "check-ran").unlink(missing_ok=True)
        srun = next(line for line in body.splitlines() if line.startswith("srun "))
        runnable = body.replace(srun, f"(exit {status})")
        out = subprocess.run(["bash", "-c", runnable], capture_output=True, text=True, timeout=30)
        assert out.returncode == status
        ran = (tmp_path / "check-ran").read_text().split() if (tmp_path / "check-ran").exists() else None
        assert ran == (None if status == 0 else ["-c", *BOOT.split(), "hpc.requeue", RUN_DIR, "137"])


@pytest.mark.parametrize("job,site_name", [("tiny-hsdp-2node", "sandbox"), ("tiny-ddp", "local")])
def test_executors_submit_exactly_what_render_shows(tmp_path: Path, job: str, site_name: str):
    """The executors' task command (submitit's private ``_submitit_command_str``) and script text."""
    import sys

    from hpc import schedulers

    spec, site = load_spec(REPO / f"jobs/{job}.toml"), load_site(site_name)
    launch = resolve(spec, site)
    sched = schedulers.get(site.scheduler.kind)
    executor = sched.executor(spec, site, launch, tmp_path / "submitit")
    shown = sched.render(spec, site, launch, str(tmp_path), sys.executable)
    assert executor._submitit_command_str.endswith(f"{shlex.quote(BOOT)} trainer.entry {tmp_path}/submitit")
    if site_name == "sandbox":
        assert executor._make_submission_file_text(executor._submitit_command_str, "uid") == shown
    else:
        assert json.loads(shown)["command"] == executor._submitit_command_str


def test_local_gpu_site_hands_its_gpus_to_the_tasks(monkeypatch):
    from hpc.schedulers.local.scheduler import local_parameters
    from hpc.core.site import parse_site

    site = parse_site({"scheduler": {"kind": "local", "gpu_directive": "none"},
                       "node": {"gpus": 2, "gpu_memory_gb": 24, "cpus": 8, "intra_link": "pcie"}}, "ws", "<ws>")
    spec = load_spec(REPO / "jobs/tiny-ddp.toml")
    launch = resolve(spec, site)
    assert launch.gpus_per_node == 2 and launch.tasks_per_node == 2 and launch.backend == "nccl"
    assert local_parameters(spec, launch) == {"tasks_per_node": 2, "timeout_min": 20, "signal_delay_s": 120,
                                              "gpus_per_node": 2}
    assert local_parameters(spec, launch, "3,5,6")["visible_gpus"] == [3, 5, 6]
    for bad, words in (("GPU-1a2b,GPU-3c4d", "by index"), ("", "leaves 0 GPU"), ("7", "leaves 1 GPU")):
        with pytest.raises(UserError, match=words):
            local_parameters(spec, launch, bad)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    shown = json.loads(render(spec, site, launch, RUN_DIR, PYTHON))
    assert shown["gpus_per_node"] == 2  # submitit would export CUDA_VISIBLE_DEVICES="" without it
    cpu = load_site("local")
    assert "gpus_per_node" not in local_parameters(spec, resolve(spec, cpu))


def test_the_kind_decides_where_the_job_asks_to_run():
    """``Launch.partition``/``account``/``qos`` come from the site's kind (``Scheduler.placement``): Slurm
    fills what the spec leaves out from its ``[scheduler]`` defaults; the spec's own values win."""
    job = REPO / "jobs" / "tiny-ddp.toml"
    site = load_site("sandbox")
    assert site.scheduler.partition == "debug"
    assert resolve(load_spec(job, ["job.nodes=1"]), site).partition == "debug"
    assert resolve(load_spec(job, ["job.nodes=1", "job.partition=long", "job.qos=high"]), site).to_dict()[
        "partition"] == "long"
    local = resolve(load_spec(job, ["job.qos=high"]), load_site("local"))
    assert (local.partition, local.account, local.qos) == (None, None, "high")


class Recorder:
    """The scheduler's step builder, render and executor, each recording what it built or was given."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cls: type) -> None:
        self.built: list = []
        self.rendered: list = []
        self.executors: list = []
        step, render_, executor = cls.step, cls.render, cls.executor

        def counted_step(sched, *args):
            self.built.append(step(sched, *args))
            return self.built[-1]

        def recorded_render(sched, spec, site, launch, run_dir, python, step=None):
            self.rendered.append(step)
            return render_(sched, spec, site, launch, run_dir, python, step)

        def recorded_executor(sched, spec, site, launch, folder, step=None):
            self.executors.append((step, executor(sched, spec, site, launch, folder, step)))
            return self.executors[-1][1]

        for name, fn in (("step", counted_step), ("render", recorded_render), ("executor", recorded_executor)):
            monkeypatch.setattr(cls, name, fn)


def test_a_submit_builds_its_step_once_and_renders_and_submits_that_one(tmp_path, monkeypatch):
    """A real local submit (one task running `true`): ``Scheduler.step`` runs once, render.txt and the executor
    get that very value, and the command the executor hands submitit is the one render.txt shows."""
    import sys

    from hpc.login.submit import submit, wait
    from hpc.schedulers.local.scheduler import LocalScheduler

    seen = Recorder(monkeypatch, LocalScheduler)
    path = tmp_path / "job.toml"
    path.write_text(f'[job]\nname = "once"\ncommand = ["true"]\ntasks_per_node = 1\nrun_root = "{tmp_path / "runs"}"\n')
    spec, site = load_spec(path), load_site("local")
    done = submit(spec, site, resolve(spec, site), path)
    try:
        assert len(seen.built) == 1, seen.built
        (step,) = seen.built
        assert seen.rendered == [step] and [s for s, _ in seen.executors] == [step]
        shown = json.loads((done.run_dir / "render.txt").read_text())
        assert shown["command"] == step.command == seen.executors[0][1]._submitit_command_str
        assert step.argv[-1] == f"{done.run_dir}/submitit" and sys.executable in step.argv
    finally:
        assert wait(done.run_dir, lambda _: None, poll_s=0.5, timeout_s=300)["state"] == "COMPLETED"


@pytest.mark.parametrize("site_file", ["pyxis-h100", "apptainer-h100", "oci-h100"])
def test_a_container_step_is_built_once_and_the_executor_submits_what_render_shows(tmp_path, monkeypatch, site_file):
    """The same with each runtime's step (the step is what the runtime wraps): built once, the sbatch text the
    executor writes is render's, byte for byte, and the overlay the step mounts is the one written."""
    import dataclasses
    import sys

    from hpc import schedulers
    from hpc.schedulers.slurm.scheduler import SlurmScheduler

    site = load_site(str(REPO / "docs" / "sites" / f"{site_file}.toml"))
    image = {"oci": tmp_path / "bundle", "apptainer": tmp_path / "i.sif"}.get(site.container.runtime)
    if image is not None:  # an image the login node finds at submit (an OCI bundle, a .sif file)
        (image / "rootfs").mkdir(parents=True) if image.name == "bundle" else image.write_bytes(b"")
        if image.name == "bundle":
            (image / "config.json").write_text(json.dumps({"root": {"path": "rootfs"}, "process": {"env": []}}))
        site = dataclasses.replace(site, container=dataclasses.replace(site.container, image=str(image)))
    seen = Recorder(monkeypatch, SlurmScheduler)
    spec = load_spec(REPO / "jobs/tiny-hsdp-2node.toml")
    launch = resolve(spec, site)
    sched, run = schedulers.get("slurm"), tmp_path / "run"
    step = sched.step(spec, site, launch, str(run), sys.executable)
    executor = sched.executor(spec, site, launch, run / "submitit", step)
    shown = sched.render(spec, site, launch, str(run), sys.executable, step)
    assert len(seen.built) == 1 and seen.rendered == [step] and step.container
    assert executor._make_submission_file_text(executor._submitit_command_str, "uid") == shown
    links = {p.name: os.readlink(p) for p in (run / "container" / "path").iterdir()}
    assert links == dict(step.links) and step.mounts


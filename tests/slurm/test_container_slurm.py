"""Every task in an OCI container on the real two-node sandbox (site `sandbox-oci`: the bundle
scripts/sandbox-image builds, Debian bookworm with torch CPU and nothing of hpcx, run by runc on both nodes).
Only the srun step is inside: the batch shell, the check after srun and the requeue stay on the host.

Also the evidence of why each task runs runc itself instead of Slurm 22.05's `srun --container`
(docs/containers.md): that path runs, but one task per node, without the task's variables."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, hpcx
from tests.resilience.resilience_lib import (checkpoint_steps, ledger, losses_by_step, same_checkpoint_tensors,
                                             submit, token_file, wait_state)
from tests.slurm.test_failure_slurm import states, task_pid, wait_for

HSDP = str(REPO / "jobs" / "tiny-hsdp-2node.toml")
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
IMAGES = Path("/var/cache/hpcx-sandbox/images")
SITE = "sandbox-oci"


@pytest.fixture(scope="module")
def images(sandbox) -> Path:
    """The sandbox's bundles (scripts/sandbox-image, run by scripts/test-all after the sandbox is up)."""
    missing = [n for n in ("torch", "python") if not (IMAGES / n / "config.json").exists()]
    if missing:
        if os.environ.get("HPCX_REQUIRE_SLURM"):
            pytest.fail(f"the sandbox images {missing} are not built: run scripts/sandbox-image")
        pytest.skip(f"no sandbox images {missing}; run scripts/sandbox-image")
    return IMAGES


@pytest.fixture(scope="module")
def tokens(sandbox) -> Path:
    folder = sandbox / "container-test-data"
    folder.mkdir(exist_ok=True)
    return token_file(folder / "tokens.bin", samples=100)


def sets(tokens: Path, name: str, *extra: str) -> list[str]:
    return [f"job.name={name!r}", f"data.source={json.dumps(str(tokens))}", "data.shuffle=true", "model.dropout=0.1",
            "train.log_every=1", "checkpoint.interval_steps=10", *extra]


def site_with(tmp_path: Path, **values: object) -> str:
    """site/sandbox-oci.toml with some [container] values replaced (TOML strings)."""
    lines = (REPO / "site" / f"{SITE}.toml").read_text().splitlines()
    for i, line in enumerate(lines):
        key = line.split(" = ", 1)[0]
        if key in values:
            lines[i] = f"{key} = {json.dumps(values[key])}"
    path = tmp_path / f"{SITE}-{'-'.join(values)}.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_hsdp_trains_on_both_nodes_inside_the_image(images, tokens):
    folder = submit(HSDP, *sets(tokens, "oci-hsdp", "train.steps=20"), site=SITE)
    final = wait_state(folder, TERMINAL, timeout=400)
    assert final["state"] == "COMPLETED", (folder / "submitit").glob("*_0_log.err").__next__().read_text()[-3000:]
    start, stop = ledger(folder)
    assert stop["reason"] == "completed" and stop["step"] == 20
    inside = start["container"]
    assert inside["image"] == str(images / "torch") and inside["torch"] == "2.13.0+cpu"
    recorded = json.loads((folder / "resolved.json").read_text())["container"]
    assert recorded["runtime"] == "oci" and recorded["key"] == os.readlink(images / "torch")
    log = (folder / "logs" / "rank-0.log").read_text()
    assert "rank 0/4 on n1" in log
    tasks = sorted(p.name for p in (folder / "container" / "tasks").iterdir())
    assert len(tasks) == 4  # one container per task, on both nodes
    assert "--container" not in (folder / "render.txt").read_text().split("# teardown")[1]


def test_an_image_without_torch_fails_the_start_once_naming_it(images, tmp_path):
    site = site_with(tmp_path, image=str(images / "python"))
    folder = submit(HSDP, "job.name='oci-no-torch'", "train.steps=5", site=site)
    final = wait_state(folder, TERMINAL, timeout=300)
    assert final["state"] == "FAILED"
    (stop,) = ledger(folder)
    assert not stop["requeued"] and "would fail the same way" in stop["not_requeued"]
    assert f"the container image {images / 'python'} has no torch" in stop["error"]
    assert "REQUEUED" not in states(folder)


def test_sigkill_of_one_rank_is_requeued_once_from_the_host(images, tokens):
    folder = submit(HSDP, *sets(tokens, "oci-kill", "train.steps=30"), site=SITE)
    job_id = json.loads((folder / "job.json").read_text())["job_id"]
    wait_for(lambda: max(losses_by_step(folder), default=0) >= 7, "step 7", timeout=300)
    pid = wait_for(lambda: task_pid(job_id, 1), "rank 1's process", timeout=30)
    os.kill(pid, signal.SIGKILL)  # the rank inside the container; runc and srun see it end
    final = wait_state(folder, TERMINAL, timeout=400)
    assert final["state"] == "COMPLETED"
    start0, stop0, start1, stop1 = ledger(folder)
    assert stop0["by"] == "batch script" and stop0["reason"] == "failed" and stop0["requeued"]
    assert stop0["failed_ranks"] == [1] and start1["slurm_restart_count"] == 1
    assert stop1["reason"] == "completed" and stop1["step"] == 30
    assert states(folder).count("REQUEUED") == 1
    assert sorted(losses_by_step(folder)) == list(range(1, 31))


def test_cancel_never_requeues(images, tokens):
    folder = submit(HSDP, *sets(tokens, "oci-cancel", "train.steps=100000"), site=SITE)
    wait_for(lambda: checkpoint_steps(folder), "a first save", timeout=400)
    out = hpcx("cancel", str(folder))
    assert out.returncode == 0, out.stderr
    assert wait_state(folder, TERMINAL, timeout=120)["state"].startswith("CANCELLED")
    start, stop = ledger(folder)
    assert stop["reason"] == "terminated" and not stop["requeued"]
    assert "REQUEUED" not in states(folder)


def test_a_drill_resumes_bit_identical_to_an_uncontained_twin(images, tokens):
    steps = 30
    reference = submit(HSDP, *sets(tokens, "oci-twin", f"train.steps={steps}"), site="sandbox")
    drilled = submit(HSDP, *sets(tokens, "oci-drilled", f"train.steps={steps}"), site=SITE)
    out = hpcx("drill", str(drilled), "--at-step", "6", "--json", timeout=400)
    assert out.returncode == 0, out.stderr
    for folder in (reference, drilled):
        assert wait_state(folder, TERMINAL, timeout=500)["state"] == "COMPLETED", folder
    start0, stop0, start1, stop1 = ledger(drilled)
    assert stop0["reason"] == "preempted" and stop0["requeued"] and start1["step"] == stop0["step"]
    assert "container" in start1 and "container" not in ledger(reference)[0]
    assert losses_by_step(drilled) == losses_by_step(reference)
    final = f"step-{steps:07d}"
    assert same_checkpoint_tensors(drilled / "checkpoints" / final, reference / "checkpoints" / final) == []


def test_slurm_22_05_oci_support_runs_one_task_per_node_without_its_variables(images):
    """Why `oci_launch = "runc"` on the sandbox. If this fails, Slurm's own path may do: see docs/containers.md."""
    bundle = os.path.realpath(images / "torch")  # runc refuses a root file system reached through a link
    probe = "import os; print(os.environ.get('SLURM_PROCID'))"
    two = subprocess.run(["srun", "-N2", "-n2", f"--container={bundle}", "/usr/bin/python3", "-c", probe],
                         capture_output=True, text=True, timeout=120)
    assert two.returncode == 0 and two.stdout.split() == ["None", "None"], two.stdout + two.stderr
    four = subprocess.run(["srun", "-N1", "-n2", f"--container={bundle}", "/usr/bin/python3", "-c", "1"],
                          capture_output=True, text=True, timeout=120)
    assert four.returncode != 0 and "Task launch for StepId=" in four.stderr


def test_container_check_reports_from_inside_the_image(images):
    out = hpcx("container", "check", "--site", SITE, "--json", timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] and report["container"]["key"] == os.readlink(images / "torch")
    assert len(report["ranks"]) == 2
    for rank in report["ranks"]:
        assert rank["executable"] == "/usr/bin/python3" and rank["torch"] == "2.13.0+cpu"
        assert rank["hpcx_imports"] == "ok" and rank["image"] == str(images / "torch")
        assert rank["backend"] == "gloo" and rank["all_reduce_ok"] and rank["host"] in ("n1", "n2")
    assert report["transports"] == []  # a CPU site: gloo, no NCCL lines
    text = hpcx("container", "check", "--site", SITE, timeout=600)
    assert text.returncode == 0 and "hpcx imports: ok" in text.stdout and "torch 2.13.0+cpu" in text.stdout


def test_a_data_prepare_array_in_the_image_writes_the_same_bytes_as_a_local_run(images, tmp_path):
    from tests.slurm.test_data_slurm import folder_bytes
    from tests.tokens.corpus import text_corpus, train_tokenizer

    corpus = text_corpus(tmp_path / "txt", 12)
    tokenizer = train_tokenizer(tmp_path / "tokenizer.json")
    common = [str(corpus), "--tokenizer", str(tokenizer), "--group-bytes", "30000", "--val-fraction", "0.1"]
    local = hpcx("data", "prepare", *common, "--out", str(tmp_path / "local"))
    assert local.returncode == 0, local.stderr
    array = hpcx("data", "prepare", *common, "--out", str(tmp_path / "array"), "--site", SITE, "--wait", timeout=900)
    assert array.returncode == 0, array.stdout + array.stderr
    script = (tmp_path / "array" / ".prepare" / "array.sh").read_text()
    assert "/container/oci-task" in script and "/usr/bin/python3" in script  # each task ran in the image
    assert len(list((tmp_path / "array" / ".prepare" / "container" / "tasks").iterdir())) >= 2
    assert folder_bytes(tmp_path / "local") == folder_bytes(tmp_path / "array")


# ---------------------------------------------------------------- GPUs, shared memory and the torch floor

# What each rank of the script below sees inside its container: the fake GPUs the CDI spec names, whether
# it may write to one (the device cgroup lets it), the size of /dev/shm, and the CDI spec's variable.
SEE = """import json, os, platform, stat
seen = {"host": platform.node(), "fake": os.environ.get("HPCX_FAKE_GPU_DRIVER")}
for name in ("nvidia0", "nvidiactl"):
    st = os.stat("/dev/" + name)
    seen[name] = [stat.S_ISCHR(st.st_mode), os.major(st.st_rdev), os.minor(st.st_rdev)]
with open("/dev/nvidia0", "w") as f:
    seen["wrote"] = f.write("x")
shm = os.statvfs("/dev/shm")
seen["shm"] = shm.f_blocks * shm.f_frsize
os.makedirs("out", exist_ok=True)
with open("out/rank-%s.json" % os.environ["RANK"], "w") as f:
    json.dump(seen, f)
"""
FAKE_CDI = Path("/var/run/cdi/hpcx-sandbox-fake-gpu.json")


def site_plus(tmp_path: Path, *lines: str, **values: str) -> str:
    """site/sandbox-oci.toml (``values`` replaced, as ``site_with``) with ``lines`` added to its [container]."""
    path = Path(site_with(tmp_path, **values) if values else tmp_path / f"{SITE}.toml")
    if not values:
        path.write_text((REPO / "site" / f"{SITE}.toml").read_text())
    path.write_text(path.read_text() + "\n".join(lines) + "\n")  # [container] is the profile's last section
    return str(path)


@pytest.fixture
def fake_gpus(sandbox):
    """Two fake GPU device nodes (the devices /dev/null and /dev/zero are) in a folder both nodes see, and a
    CDI spec on the nodes (they share this machine's /run) that puts them at /dev/nvidia0 and /dev/nvidiactl."""
    import secrets
    import stat as st

    folder = sandbox / "fake-gpu" / secrets.token_hex(4)
    folder.mkdir(parents=True)
    for name, minor in (("nvidia0", 3), ("nvidiactl", 5)):
        os.mknod(folder / name, 0o666 | st.S_IFCHR, os.makedev(1, minor))
        os.chmod(folder / name, 0o666)
    FAKE_CDI.parent.mkdir(parents=True, exist_ok=True)
    FAKE_CDI.write_text(json.dumps({
        "cdiVersion": "0.6.0", "kind": "sandbox.hpcx/gpu",
        "containerEdits": {"env": ["HPCX_FAKE_GPU_DRIVER=1"]},
        "devices": [{"name": "all", "containerEdits": {"deviceNodes": [
            {"path": "/dev/nvidia0", "hostPath": str(folder / "nvidia0")},
            {"path": "/dev/nvidiactl", "hostPath": str(folder / "nvidiactl")}]}}]}))
    yield folder
    FAKE_CDI.unlink(missing_ok=True)
    import shutil

    shutil.rmtree(folder, ignore_errors=True)


def test_fake_gpus_and_the_shm_size_given_reach_every_task_on_both_nodes(images, sandbox, fake_gpus, tmp_path):
    import secrets

    from tests.script_mode.script_lib import script_folder, submit_in
    from tests.script_mode.script_lib import wait_state as wait_script

    site = site_plus(tmp_path, 'cdi = ["sandbox.hpcx/gpu=all"]', "shm_gb = 1")
    folder = sandbox / "container-gpu" / secrets.token_hex(4)
    spec = script_folder(folder, ["python3", "see.py"], name="oci-fake-gpu", nodes=2, tasks=2)
    (folder / "see.py").write_text(SEE)
    run = submit_in(folder, "--site", site)
    assert wait_script(run, timeout=400)["state"] == "COMPLETED", (run / "submitit").glob("*_0_log.err")
    seen = [json.loads((folder / "out" / f"rank-{r}.json").read_text()) for r in range(4)]
    assert {s["host"] for s in seen} == {"n1", "n2"}
    for s in seen:
        assert s["nvidia0"] == [True, 1, 3] and s["nvidiactl"] == [True, 1, 5] and s["wrote"] == 1
        assert s["shm"] == 1 << 30 and s["fake"] == "1"
    task = json.loads(next((run / "container" / "tasks").glob("*/config.json")).read_text())
    assert [d["path"] for d in task["linux"]["devices"]] == ["/dev/nvidia0", "/dev/nvidiactl"]
    assert spec.exists()


def fake_old_torch(folder: Path) -> Path:
    """A dist-packages folder holding a torch 2.4.0 and a numpy (their metadata: the check never imports them)."""
    for name, version in (("torch", "2.4.0a0+3bcc3cd"), ("numpy", "1.26.4")):
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text("raise ImportError('a stand-in')\n")
        (folder / f"{name}-{version}.dist-info").mkdir()
        (folder / f"{name}-{version}.dist-info" / "METADATA").write_text(f"Name: {name}\nVersion: {version}\n")
    (folder / "torch" / "version.py").write_text("__version__ = '2.4.0a0+3bcc3cd'\ncuda = '12.4'\n")
    return folder


def test_container_check_refuses_an_image_below_the_torch_floor_naming_it(images, sandbox, tmp_path):
    import secrets

    old = fake_old_torch(sandbox / "old-torch" / secrets.token_hex(4))
    image = str(images / "python")  # Debian's python3 (no torch), with the old torch bound where its pip puts packages
    site = site_with(tmp_path, image=image, mounts=["/etc/hosts:/etc/hosts:ro", "/etc/resolv.conf:/etc/resolv.conf:ro",
                                                   f"{old}:/usr/local/lib/python3.11/dist-packages:ro"])
    out = hpcx("container", "check", "--site", site, timeout=600)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"image {image} on n" in out.stdout and "torch 2.4.0a0+3bcc3cd, CUDA 12.4, NCCL none" in out.stdout
    (line,) = [x for x in out.stderr.splitlines() if x.strip()]
    assert f"the container image {image} has torch 2.4.0a0+3bcc3cd, below the 2.6 hpcx's trainer needs" in line
    assert site in line and "Traceback" not in out.stderr


def test_the_container_start_bench_runs_at_its_smallest_size(images, tmp_path):
    """bench/container_start (tests/test_bench_runs.py lists it here: it needs the sandbox and its images)."""
    import sys

    out = subprocess.run([sys.executable, str(REPO / "bench" / "container_start" / "run.py"), "--reps", "1",
                          "--nodes", "1", "--tasks", "1"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "the image adds" in out.stdout and "ratio oci / bare" in out.stdout, out.stdout

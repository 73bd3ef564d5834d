"""The site's ``[container]`` section: strict loading, the step rendered per runtime (goldens for pyxis and
Apptainer, which cannot run here), the per-run OCI bundle, and the first task's check inside the image.

Refresh the goldens after an intended change with ``HPCX_UPDATE_GOLDENS=1 python -m pytest tests/test_container.py``.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import pytest

from hpc.core import container as ct
from hpc.core.config import ConfigError
from hpc.core.failures import loading_failure
from hpc.core.site import load_site, parse_site
from hpc.core.spec import load_spec
from hpc.login.render import render
from hpc.plan.resolve import resolve
from hpc.schedulers.slurm import container as sc

REPO = Path(__file__).resolve().parents[1]
GOLDENS = Path(__file__).parent / "goldens" / "containers"
RUN_DIR = "/hpcx-runs/RUN"
PYTHON = "/venv/bin/python"
# where the overlay's links point in the goldens: an install outside the job's folder
LINKS = {"hpc": "/opt/hpcx/src/hpc", "trainer": "/opt/hpcx/src/trainer",
         "submitit": "/opt/hpcx/venv/lib/python3.11/site-packages/submitit",
         "cloudpickle": "/opt/hpcx/venv/lib/python3.11/site-packages/cloudpickle"}
EXAMPLES = {"pyxis": REPO / "docs/sites/pyxis-h100.toml", "apptainer": REPO / "docs/sites/apptainer-h100.toml",
            "oci": REPO / "docs/sites/oci-h100.toml"}


def site_doc(**container) -> dict:
    return {"scheduler": {"kind": "slurm", "partition": "debug"}, "node": {"cpus": 2, "tasks": 2},
            "storage": {"run_root": "/runs"}, "container": container}


def errors_of(**container) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        parse_site(site_doc(**container), "s", "s.toml")
    return exc.value.messages


@pytest.fixture
def fixed_host(monkeypatch):
    """The step as rendered from /home/u/proj with hpcx installed under /opt/hpcx."""
    monkeypatch.setattr(sc, "overlay_links", lambda: dict(LINKS))
    monkeypatch.setattr("hpc.schedulers.slurm.scheduler.os.getcwd", lambda: "/home/u/proj")


# ---------------------------------------------------------------- strict loading


def test_every_problem_at_once():
    found = errors_of(runtime="pyxis", image="img.sqsh", mounts=["/a:/b,/c:/d", "/a:/b:/c:ro", "rel:/x", "/a:/b:rx"],
                      env=["OK_NAME", "BAD-NAME"], flags=["--ok", "nope"], workdir="rel", python="my python",
                      colour="blue")
    joined = "\n".join(found)
    for needle in ("unknown key `container.colour`", "`container.image` = 'img.sqsh': expected an absolute path",
                   "`container.mounts[0]`", "`container.mounts[1]`", "`container.mounts[2]` = 'rel:/x': expected absolute",
                   "`container.mounts[3]` = '/a:/b:rx': expected `ro` or `rw`", "'BAD-NAME'", "'nope'",
                   "`container.workdir` = 'rel'", "`container.python` = 'my python'"):
        assert needle in joined, needle
    assert all(m.startswith("s.toml: ") for m in found)
    assert "OK_NAME" not in joined and "'--ok'" not in joined


def test_a_runtime_the_site_does_not_declare():
    found = errors_of(runtime="oci", runtimes=["pyxis"], image="/bundle")
    assert any("`container.runtime` = 'oci' is not among the site's `container.runtimes` (pyxis)" in m for m in found)
    assert any("'bogus'" in m for m in errors_of(runtime="pyxis", runtimes=["pyxis", "bogus"], image="a#b"))


@pytest.mark.parametrize("runtime,image", [("oci", "docker://x/y"), ("apptainer", "rel.sif"), ("pyxis", "/a,b.sqsh"),
                                           ("apptainer", "/a:b.sif"), ("oci", "")])
def test_images_refused_at_load(runtime, image):
    assert any("container.image" in m for m in errors_of(runtime=runtime, image=image))


def test_image_is_looked_at_only_at_submit(tmp_path):
    site = parse_site(site_doc(runtime="oci", image=str(tmp_path / "missing")), "s", "s.toml")
    assert site.container.enabled  # loads (render, site list) ...
    found = ct.submit_problems(site.container, "s.toml")  # ... refused at submit
    assert found == [f"s.toml: `container.image` = '{tmp_path / 'missing'}': no OCI bundle there (expected a folder "
                     "with config.json)"]
    (tmp_path / "missing").mkdir()
    (tmp_path / "missing" / "config.json").write_text("{}")
    assert ct.submit_problems(site.container, "s.toml") == []
    sif = parse_site(site_doc(runtime="apptainer", image=str(tmp_path / "x.sif")), "s", "s.toml").container
    assert "no such file" in ct.submit_problems(sif, "s.toml")[0]
    uri = parse_site(site_doc(runtime="pyxis", image="nvcr.io#nvidia/pytorch:24.05-py3"), "s", "s.toml").container
    assert ct.submit_problems(uri, "s.toml") == []  # the runtime pulls it on the node


def test_without_a_container_section_nothing_changes():
    site = load_site("sandbox")
    assert not site.container.enabled
    spec = load_spec(REPO / "jobs/tiny-hsdp-2node.toml")
    script = render(spec, site, resolve(spec, site), RUN_DIR, PYTHON)
    assert "--container" not in script and "PYTHONPATH" not in script


# ---------------------------------------------------------------- the step, per runtime


@pytest.mark.parametrize("runtime", sorted(EXAMPLES))
def test_golden(runtime, fixed_host):
    spec = load_spec(REPO / "jobs/tiny-hsdp-2node.toml")
    site = load_site(str(EXAMPLES[runtime]))
    text = render(spec, site, resolve(spec, site), RUN_DIR, PYTHON)
    golden = GOLDENS / f"tiny-hsdp-2node__{runtime}.txt"
    if os.environ.get("HPCX_UPDATE_GOLDENS"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text(), f"render changed; if intended: HPCX_UPDATE_GOLDENS=1 pytest {__file__}"


def srun_words(script: str) -> list[str]:
    return shlex.split(next(line for line in script.splitlines() if line.startswith("srun ")))


def test_pyxis_flags_are_pyxis_own(fixed_host):
    spec = load_spec(REPO / "jobs/tiny-hsdp-2node.toml")
    site = load_site(str(EXAMPLES["pyxis"]))
    script = render(spec, site, resolve(spec, site), RUN_DIR, PYTHON)
    words = srun_words(script)
    image = "nvcr.io#nvidia/pytorch:25.12-py3"
    assert f"--container-image={image}" in words
    mounts = next(w for w in words if w.startswith("--container-mounts=")).split("=", 1)[1].split(",")
    assert mounts == ["/lustre/datasets:/lustre/datasets:ro", "/hpcx-runs:/hpcx-runs", "/home/u/proj:/home/u/proj",
                      "/opt/hpcx/src:/opt/hpcx/src:ro",
                      "/opt/hpcx/venv/lib/python3.11/site-packages:/opt/hpcx/venv/lib/python3.11/site-packages:ro",
                      "/dev/infiniband:/dev/infiniband", "/dev/shm:/dev/shm"]  # infiniband, shm_gb: the node's
    assert "--container-workdir=/home/u/proj" in words and "--no-container-mount-home" in words
    assert "--container-env=WANDB_API_KEY" in words
    # GPUs: pyxis (enroot's NVIDIA hook) brings in the GPUs Slurm gave the step; hpcx adds nothing for them
    assert "#SBATCH --gpus-per-node=2" in script
    assert not [w for w in words if w.startswith("--") and "nvidia" in w.lower() and image not in w]
    # the check after srun stays on the host: no container flag after the step line
    task = words[words.index("/bin/sh"):]
    assert task[4:10] == ["env", f"PYTHONPATH={RUN_DIR}/container/path", f"HPCX_CONTAINER_IMAGE={image}",
                          f"HPCX_HOST_REQUEUE={RUN_DIR}/container/requeue-request", "HPCX_SHM_GB=64", "python"]


def test_apptainer_exec_wraps_the_task(fixed_host):
    spec = load_spec(REPO / "jobs/tiny-hsdp-2node.toml")
    site = load_site(str(EXAMPLES["apptainer"]))
    script = render(spec, site, resolve(spec, site), RUN_DIR, PYTHON)
    words = srun_words(script)
    at = words.index("apptainer")
    assert words[at:at + 3] == ["apptainer", "exec", "--nv"]  # the GPUs; ROCm's --rocm is refused at load
    binds = words[words.index("--bind") + 1].split(",")
    assert binds[-2:] == ["/dev/infiniband:/dev/infiniband", "/dev/shm:/dev/shm"]
    assert words[words.index("--pwd") + 1] == "/home/u/proj" and "--no-home" in words
    assert words[words.index("/shared/images/pytorch-25.12.sif") + 1] == "/bin/sh"
    # the variable's value is the batch shell's, never written into the script
    assert 'export APPTAINERENV_WANDB_API_KEY="$WANDB_API_KEY"' in script
    teardown = script.split("# teardown", 1)[1]
    assert "apptainer" not in teardown and PYTHON in teardown


def test_oci_runs_each_task_through_its_nodes_script(fixed_host):
    spec = load_spec(REPO / "jobs/tiny-hsdp-2node.toml")
    site = load_site(str(EXAMPLES["oci"]))
    words = srun_words(render(spec, site, resolve(spec, site), RUN_DIR, PYTHON))
    at = words.index(f"{RUN_DIR}/container/oci-task")
    assert words[at - 1] == "/bin/sh" and not [w for w in words[:at] if w.startswith("--container")]
    assert "HPCX_SHM_GB=64" in words  # the tmpfs each container gets, checked again inside


def test_gpus_fabric_and_shm_keys_are_strict():
    bad = errors_of(runtime="oci", image="/b", oci_launch="runc", cdi=["nvidia.com/gpu", "gpu=all", "Nvidia.com/gpu=0"],
                    devices=["nvidia0", "/sys/x", "/dev/../etc/shadow"], gpu_libraries=["libcuda.so", "/a,b", "/a:b"],
                    shm_gb=-1, infiniband="yes")
    joined = "\n".join(bad)
    for needle in ("'nvidia.com/gpu'", "'gpu=all'", "'Nvidia.com/gpu=0'", "'nvidia0'", "'/sys/x'", "'/dev/../etc/shadow'",
                   "'libcuda.so'", "'/a,b'", "'/a:b'", "container.shm_gb", "container.infiniband"):
        assert needle in joined, needle
    # what only a task that runs runc itself can add: not with the scheduler's own OCI support
    for key, value in (("cdi", ["nvidia.com/gpu=all"]), ("devices", ["/dev/nvidia*"]), ("infiniband", True),
                       ("gpu_libraries", ["/usr/lib/libcuda.so.1"])):
        (line,) = errors_of(runtime="oci", image="/b", oci_launch="scheduler", **{key: value})
        assert f"`container.{key}` needs `container.oci_launch` = 'runc'" in line
    # pyxis and apptainer bring the GPUs themselves; oci on a GPU site must be told how
    for runtime, image in (("pyxis", "a#b"), ("apptainer", "/i.sif")):
        (line,) = errors_of(runtime=runtime, image=image, cdi=["nvidia.com/gpu=all"])
        assert f"`container.cdi` is for runtime 'oci' ({runtime} brings the node's GPUs itself)" in line
    doc = site_doc(runtime="oci", image="/b", oci_launch="runc")
    doc["node"].update(gpus=8, gpu_memory_gb=80, intra_link="nvswitch", intra_bandwidth_gbs=450, intra_latency_us=3)
    doc["scheduler"]["gpu_directive"] = "gpus-per-node"
    with pytest.raises(ConfigError) as exc:
        parse_site(doc, "s", "s.toml")
    assert "on a GPU site: expected `cdi`" in exc.value.messages[0]
    doc["container"]["cdi"] = ["nvidia.com/gpu=all"]
    assert parse_site(doc, "s", "s.toml").container.cdi == ["nvidia.com/gpu=all"]
    doc["container"]["oci_launch"] = "scheduler"
    with pytest.raises(ConfigError):
        parse_site(doc, "s", "s.toml")


@pytest.mark.parametrize("flag", ["--rocm", "--rocm=true"])
def test_rocm_is_refused_in_one_line(flag):
    (line,) = errors_of(runtime="apptainer", image="/i.sif", flags=["--cleanenv", flag])
    assert line == f"s.toml: `container.flags` has {flag!r}: hpcx trains on NVIDIA GPUs (CUDA, NCCL); apptainer " \
        "gets `--nv` on a GPU site"


@pytest.mark.parametrize("writable,home", [(False, False), (True, True)])
def test_writable_and_home(writable, home):
    c = ct.Container(runtime="pyxis", image="a#b", writable=writable, mount_home=home)
    step = sc.wrap_step(["x"], c, RUN_DIR, [], "/w")
    assert ("--container-writable" in step.srun_args) == writable
    assert ("--no-container-mount-home" in step.srun_args) == (not home)
    a = sc.wrap_step(["x"], ct.Container(runtime="apptainer", image="/i.sif", writable=writable, mount_home=home),
                     RUN_DIR, [], "/w")
    assert ("--writable-tmpfs" in a.argv) == writable and ("--no-home" in a.argv) == (not home)
    assert sc.wrap_step(["x"], ct.Container(), RUN_DIR, [], "/w") == sc.Wrapped((), ("x",))


def image_bundle(folder: Path, config: dict | None = None) -> Path:
    """An OCI bundle folder: config.json (``config``, default a plain one) and an empty rootfs/."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rootfs").mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config if config is not None else {"root": {"path": "rootfs"}}))
    return folder


# an image's configuration that tries every way out of its container: hpcx takes its root, env and user only
HOSTILE = {"root": {"path": "rootfs", "readonly": False},
           "process": {"cwd": "/", "args": ["sh"], "env": ["PATH=/opt/bin:/usr/bin", "LANG=C.UTF-8"],
                       "user": {"uid": 1000, "gid": 1000, "additionalGids": [44]},
                       "capabilities": {"bounding": ["CAP_SYS_ADMIN"], "effective": ["CAP_SYS_ADMIN"]}},
           "hooks": {"prestart": [{"path": "/bin/sh", "args": ["sh", "-c", "touch /tmp/owned"]}],
                     "createRuntime": [{"path": "/bin/true"}]},
           "mounts": [{"destination": "/host-etc", "type": "none", "source": "/etc", "options": ["rbind", "rw"]},
                      {"destination": "/proc", "type": "proc", "source": "proc"}],
           "linux": {"namespaces": [{"type": "network"}, {"type": "pid"}, {"type": "user"}, {"type": "mount"}],
                     "devices": [{"path": "/dev/sda", "type": "b", "major": 8, "minor": 0}],
                     "resources": {"devices": [{"allow": True, "access": "rwm"}]},
                     "uidMappings": [{"containerID": 0, "hostID": 0, "size": 1}]}}


def test_oci_bundle_takes_only_root_env_and_user_from_the_image(tmp_path):
    image = image_bundle(tmp_path / "image", HOSTILE)
    c = ct.Container(runtime="oci", image=str(image), mounts=["/etc/hosts:/etc/hosts:ro"])
    mounts = ct.step_mounts(c, "/runs", "/home/u/proj", LINKS)
    bundle = sc.write_bundle(c, tmp_path / "run" / "container" / "bundle", mounts, "/home/u/proj")
    config = json.loads((bundle / "config.json").read_text())
    assert set(config) == {"ociVersion", "process", "root", "mounts", "linux"}  # no hooks
    # Slurm 22.05 takes BUNDLE/rootfs whatever root.path says: an empty folder, the image's root bound onto it
    assert config["root"] == {"path": "rootfs", "readonly": True} and (bundle / "rootfs").is_dir()
    assert config["mounts"][0] == {"destination": "/", "type": "none", "source": f"{image}/rootfs",
                                   "options": ["rbind", "rw"]}  # runc makes mount points; root.readonly
    assert config["process"] == {"terminal": False, "user": {"uid": 1000, "gid": 1000, "additionalGids": [44]},
                                 "args": ["true"], "env": ["PATH=/opt/bin:/usr/bin", "LANG=C.UTF-8"],
                                 "cwd": "/home/u/proj", "noNewPrivileges": True}  # no capabilities
    assert config["linux"] == {"namespaces": [{"type": "mount"}], "devices": [], "resources": {"devices": []}}
    assert not any(m["source"] == "/etc" or m["destination"] == "/host-etc" for m in config["mounts"])
    assert [m["destination"] for m in config["mounts"][1:7]] == ["/proc", "/dev", "/dev/pts", "/dev/shm", "/sys",
                                                                 "/tmp"]
    assert config["mounts"][4]["source"] == "/dev/shm"  # shm_gb = 0: the node's own, shared by its tasks
    binds = {m["destination"]: m["options"][-1] for m in config["mounts"][7:]}
    assert binds == {"/etc/hosts": "ro", "/runs": "rw", "/home/u/proj": "rw", "/opt/hpcx/src": "ro",
                     "/opt/hpcx/venv/lib/python3.11/site-packages": "ro"}
    step = sc.wrap_step(["x"], c, "/runs/r", mounts, "/w")
    assert step.srun_args == ("--container=/runs/r/container/bundle",) and step.argv == ("x",)
    # each task runs the bundle with runc itself: the task's folder, environment and arguments at its start
    c.oci_launch, c.shm_gb = "runc", 16
    step = sc.wrap_step(["x", "y z"], c, "/runs/r", mounts, "/w")
    assert step == sc.Wrapped((), ("/bin/sh", "/runs/r/container/oci-task", "x", "y z"))
    config = json.loads((sc.write_bundle(c, tmp_path / "b2", mounts, "/w") / "config.json").read_text())
    assert config["process"]["args"] == ["python3", "-c", sc.LOADER, "@TASKDIR@"]
    assert config["mounts"][4] == {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
                                   "options": ["nosuid", "nodev", "mode=1777", "size=16g"]}


def big_file(path: Path) -> None:
    with open(path, "wb") as f:  # 100 MB, sparse: nothing is written but the size
        f.truncate(100 << 20)


@pytest.mark.parametrize("make,expected", [
    (big_file, "larger than 1 MiB"),
    (lambda p: p.write_text("[" * 200_000 + "]" * 200_000), "nested deeper than"),
    (lambda p: p.symlink_to("/dev/zero"), "character device"),
    (lambda p: os.mkfifo(p), "FIFO"),
    (lambda p: p.write_text('{"root": '), "not valid JSON"),
    (lambda p: p.write_bytes(b'{"a": "\xff"}'), "not UTF-8"),
    (lambda p: p.write_text("[1, 2]"), "expected an object"),
    (lambda p: p.write_text('{"root": {"path": "../../etc"}}'), "outside the bundle folder"),
    (lambda p: p.write_text('{"root": {"path": "/"}}'), "outside the bundle folder"),
    (lambda p: p.write_text('{"root": {"path": "."}}'), "outside the bundle folder"),
    (lambda p: p.write_text('{"process": {"env": "PATH=/bin"}}'), "NAME=VALUE"),
    (lambda p: p.write_text('{"process": {"user": {"uid": "root", "gid": 0}}}'), "numeric uid and gid"),
    (lambda p: p.write_text('{"process": {"user": {"uid": 0, "gid": 0, "additionalGids": [-1]}}}'), "group ids"),
], ids=["100MB", "nested", "dev-zero", "fifo", "truncated", "latin1", "array", "root-up", "root-slash", "root-dot",
        "env", "user", "gids"])
def test_an_image_config_is_read_bounded_and_checked(tmp_path, make, expected):
    image = tmp_path / "img"
    image.mkdir()
    (image / "rootfs").mkdir()
    make(image / "config.json")
    c = ct.Container(runtime="oci", image=str(image))
    with pytest.raises(ConfigError) as exc:
        sc.write_bundle(c, tmp_path / "bundle", [], "/w", where="job.toml: `container.image`")
    (line,) = exc.value.messages
    assert line.startswith(f"job.toml: `container.image` = '{image}': its config.json") and expected in line, line
    assert "\n" not in line
    assert set(ct.identity(c)) <= {"runtime", "image", "resolved", "config_sha256"}  # never a stall, never a raise


def test_oci_is_never_writable():
    assert any("`container.writable` = true: runtime 'oci'" in m for m in errors_of(runtime="oci", image="/b",
                                                                                   writable=True))


def test_overlay_brings_hpcx_and_pure_packages_only(tmp_path):
    links = ct.overlay_links()
    assert {"hpc", "trainer", "submitit", "cloudpickle", "click"} <= set(links)
    assert not {"torch", "numpy", "tokenizers", "pyarrow", "zstandard"} & set(links)
    overlay = ct.write_overlay(tmp_path, links)
    assert (overlay / "hpc").resolve() == Path(links["hpc"]).resolve()
    ct.write_overlay(tmp_path, links)  # again (a resume): the links are replaced, not an error


def test_identity(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "image.json").write_text(json.dumps({"key": "torch-abc"}))
    found = ct.identity(ct.Container(runtime="oci", image=str(tmp_path)))
    assert found["key"] == "torch-abc" and len(found["config_sha256"]) == 64
    sif = tmp_path / "x.sif"
    sif.write_bytes(b"12345")
    assert ct.identity(ct.Container(runtime="apptainer", image=str(sif)))["size"] == 5
    assert ct.identity(ct.Container()) == {"runtime": "none", "image": ""}


# ---------------------------------------------------------------- inside the image


def test_inside_check(monkeypatch):
    import importlib.util

    assert ct.inside_problem({}, gpus=False) is None  # not in a container: nothing to check
    assert ct.inside_problem({ct.IMAGE_ENV: "/img"}, gpus=False) is None  # this Python has torch
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    line = ct.inside_problem({ct.IMAGE_ENV: "/var/cache/img/python"}, gpus=False)
    assert line.startswith("the container image /var/cache/img/python has no torch for its Python")
    # the check after srun reads it as a start that would fail the same way: not requeued
    found = loading_failure(f"hpcx: start of job 7.0\nhpcx: {line}\nsrun: error: n1: task 0: Exited with exit code 2\n")
    assert found["module"] == "/var/cache/img/python" and found["where"] == "starting in the container image"


def test_the_loader_runs_the_task_with_its_own_environment_and_arguments(tmp_path):
    """What each runc task does inside the image (``LOADER``), here with this machine's Python."""
    import subprocess
    import sys

    nasty = "a b'$(echo no)`\n\"x"
    (tmp_path / "environ").write_bytes(b"\0".join([b"HPCX_T=" + nasty.encode(), b"PATH=/usr/bin:/bin"]) + b"\0")
    argv = [sys.executable, "-c", "import os, sys; print(repr(os.environ['HPCX_T']), sys.argv[1:])", nasty, ""]
    (tmp_path / "argv").write_bytes(b"".join(a.encode() + b"\0" for a in argv))
    out = subprocess.run([sys.executable, "-c", sc.LOADER, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{nasty!r} {[nasty, '']!r}"


def test_the_task_script_names_one_container_per_task_and_start(tmp_path):
    script = sc.OCI_TASK_SCRIPT
    assert "${SLURM_RESTART_COUNT:-0}" in script and "${SLURM_PROCID:-0}" in script  # a requeue's own
    c = ct.Container(runtime="oci", image=str(image_bundle(tmp_path / "img")), oci_launch="runc")
    sc.prepare_run(c, tmp_path / "run", "/w")
    written = (tmp_path / "run" / "container" / "oci-task").read_text()
    # the node's side is the host's Python (devices, CDI), which then becomes `runc run`
    last = shlex.split(written.rstrip().splitlines()[-1])
    assert last[:2] == ["exec", sys.executable] and last[-4:] == ["hpc.schedulers.slurm.oci", "$run", "$dir", "$id"]
    assert "hpc.core.imports" in last[3]  # BOOT: never the current folder's `hpc`


def test_a_job_changes_its_sites_container(tmp_path, fixed_host):
    from hpc.core.site import select_site

    base = (REPO / "docs/sites/pyxis-h100.toml").read_text().replace('runtime = "pyxis"',
                                                                      'runtime = "pyxis"\nruntimes = ["pyxis", "none"]')
    (tmp_path / "p.toml").write_text(base)
    job = REPO / "jobs/tiny-hsdp-2node.toml"
    site = select_site(str(tmp_path / "p.toml"), load_spec(job, ['container.image=nvcr.io#me/torch:1',
                                                                 'container.mounts=["/scratch:/scratch"]']))
    assert site.container.image == "nvcr.io#me/torch:1" and site.container.runtime == "pyxis"
    assert site.container.mounts == ["/lustre/datasets:/lustre/datasets:ro", "/scratch:/scratch"]
    plain = select_site(str(tmp_path / "p.toml"), load_spec(job, ["container.runtime=none"]))
    assert not plain.container.enabled
    spec = load_spec(job, ["container.runtime=none"])
    assert "--container" not in render(spec, plain, resolve(spec, plain), RUN_DIR, PYTHON)
    with pytest.raises(ConfigError) as exc:
        select_site(str(tmp_path / "p.toml"), load_spec(job, ["container.runtime=apptainer"]))
    assert "`container.runtime` = 'apptainer' is not among the site's `container.runtimes` (pyxis, none)" in \
        exc.value.messages[0]
    with pytest.raises(ConfigError) as exc:
        select_site(str(tmp_path / "p.toml"), load_spec(job, ['container.mounts=["/a,b"]']))
    assert "`container.mounts[1]`" in exc.value.messages[0]


def test_rank_0_inside_the_image_asks_the_host_for_the_requeue(tmp_path, monkeypatch):
    """The image has no scontrol: rank 0 leaves a request, the batch shell on the host requeues after srun."""
    from hpc.schedulers.slurm.scheduler import SlurmJobSide

    request = tmp_path / "requeue-request"
    monkeypatch.setenv("HPCX_HOST_REQUEUE", str(request))
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    monkeypatch.setattr("hpc.schedulers.slurm.scheduler.show_job", lambda job: pytest.fail("asked scontrol"))
    assert SlurmJobSide().requeue() is None
    assert (tmp_path / "requeue-request.42.1").read_text() == "42 1\n"
    line = sc.host_requeue_line("/runs/r")
    assert line.startswith('[ ! -e /runs/r/container/requeue-request."$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}" ] ||')
    assert 'scontrol requeue "$SLURM_JOB_ID"' in line


# TensorProperties(dtype=torch.float32) as Debian bookworm's Python 3.11.2 (the sandbox image's) pickles it: the
# memory-format enum member as builtins.getattr(_MEM_FORMAT_ENCODING, 'TORCH_CONTIGUOUS_FORMAT')
PICKLED_BY_3_11_2 = (b'\x80\x04\x95\xe5\x00\x00\x00\x00\x00\x00\x00\x8c%torch.distributed.checkpoint.metadata\x94\x8c'
                     b'\x10TensorProperties\x94\x93\x94)\x81\x94(\x8c\x05torch\x94\x8c\x07float32\x94\x93\x94\x8c\x13'
                     b'torch.serialization\x94\x8c\x0b_get_layout\x94\x93\x94\x8c\rtorch.strided\x94\x85\x94R\x94\x89'
                     b'\x8c\x08builtins\x94\x8c\x07getattr\x94\x93\x94h\x00\x8c\x14_MEM_FORMAT_ENCODING\x94\x93\x94'
                     b'\x8c\x17TORCH_CONTIGUOUS_FORMAT\x94\x86\x94R\x94\x89t\x94b.')


def test_checkpoints_written_in_the_image_read_back():
    """A drill inside the image found its own checkpoint "incomplete": its Python pickles enum members by getattr."""
    import io
    import pickle

    import torch

    from hpc.ckpt.safe_pickle import MetadataUnpickler, RefusedGlobal

    props = MetadataUnpickler(io.BytesIO(PICKLED_BY_3_11_2)).load()
    assert props.dtype == torch.float32 and props.memory_format == torch.contiguous_format
    for target in (b'\x8c\x02os\x94\x8c\x06system', b'\x8c\x08builtins\x94\x8c\x04eval'):  # never any other getattr
        planted = b'\x80\x04\x8c\x08builtins\x94\x8c\x07getattr\x94\x93\x94' + target + b'\x94\x86\x94R\x94.'
        with pytest.raises(RefusedGlobal):
            MetadataUnpickler(io.BytesIO(planted)).load()
    enum_cls = type(props).__module__  # a member name that is not one: refused too
    bad = PICKLED_BY_3_11_2.replace(b'\x8c\x17TORCH_CONTIGUOUS_FORMAT', b'\x8c\x17TORCH_CONTIGUOUS_FORMAX')
    with pytest.raises((RefusedGlobal, pickle.UnpicklingError)):
        MetadataUnpickler(io.BytesIO(bad)).load()
    assert enum_cls


# ---------------------------------------------------------------- paths hpcx derives, in the runtimes' mount lists

ODD = {"comma": ",", "colon": ":", "newline": "\n"}
# which runtimes read each character as list syntax: pyxis' --container-mounts and apptainer's --bind split at
# `,` and `:`; a newline breaks every runtime's step line. (An OCI bundle is JSON: `,` and `:` are only text.)
REFUSES = {"pyxis": ",:\n", "apptainer": ",:\n", "oci": "\n"}
SITES = {"pyxis": {"image": "a#b"}, "apptainer": {"image": "/i.sif"}, "oci": {"image": "/b", "oci_launch": "runc"}}


def odd_folder(tmp_path: Path, what: str, ch: str) -> Path:
    """A real folder whose name holds ``ch``."""
    folder = tmp_path / f"{what}{ch}x"
    folder.mkdir(parents=True)
    return folder


def step_of(runtime: str, run_dir: str, workdir: str, links=None, reads=(), **more):
    c = ct.Container(runtime=runtime, **SITES[runtime], **more)
    return sc.step_for(c, run_dir, f"{run_dir}/submitit", workdir, False, links or LINKS, reads)


def refused(runtime: str, ch: str, call) -> str | None:
    """The one line ``call`` was refused with, or None; checks it is refused exactly where it must be."""
    try:
        call()
    except ct.UserError as exc:
        (line,) = exc.messages
        assert ch in REFUSES[runtime] or ch == ":", (runtime, line)
        return line
    assert ch not in REFUSES[runtime], f"{runtime} took a path holding {ch!r}"
    return None


@pytest.mark.parametrize("runtime", sorted(REFUSES))
@pytest.mark.parametrize("name,ch", sorted(ODD.items()))
def test_each_derived_path_with_list_syntax_is_refused_naming_it(tmp_path, monkeypatch, runtime, name, ch):
    ok = odd_folder(tmp_path, "plain", "")
    cases = {
        "the folder the job is submitted from": lambda f: step_of(runtime, f"{ok}/RUN", str(f)),
        "the run root": lambda f: step_of(runtime, f"{f}/RUN", str(ok)),
        "hpcx's install": lambda f: step_of(runtime, f"{ok}/RUN", str(ok), {"hpc": f"{f}/hpc", "trainer": f"{f}/trainer"}),
        "the folder of `data.source`": lambda f: step_of(runtime, f"{ok}/RUN", str(ok), reads=[
            ("job.toml: the folder of `data.source`", str(f))]),
        "the home folder": lambda f: (monkeypatch.setenv("HOME", str(f)),
                                      step_of(runtime, f"{ok}/RUN", str(ok), mount_home=True)),
    }
    for what, call in cases.items():
        folder = odd_folder(tmp_path, what.split()[-1].strip("`'"), ch)
        line = refused(runtime, ch, lambda: call(folder))
        if line is not None and what == "the run root" and ch in ":\n":  # the run folder inside it, first
            assert line.startswith("the run folder ") and repr(str(folder))[1:-1] in line, line
        elif line is not None:
            assert what in line.split(" '")[0] and repr(str(folder))[1:-1] in line and runtime in line, line
    # the run folder itself (hpcx render --run-dir, a run root's name): on PYTHONPATH inside, split at `:`
    run = odd_folder(tmp_path, "run", ch)
    if ch == ",":  # only its parent, the run root, is in the mount list
        assert step_of(runtime, str(run), str(ok)).argv
        return
    with pytest.raises(ct.UserError) as exc:
        step_of(runtime, str(run), str(ok))
    assert exc.value.messages[0].startswith(f"the run folder {str(run)!r} holds ")


def test_a_jobs_inputs_are_mounted_read_only_and_checked(tmp_path):
    """`data.source`, `data.val_source` and `checkpoint.init_from` come from the spec: their folders are mounted
    read-only, and one holding `,` is refused naming the spec and the key."""
    from types import SimpleNamespace as Ns

    data, weights = odd_folder(tmp_path, "data", ""), odd_folder(tmp_path, "w", ",")
    (data / "tokens.bin").write_bytes(b"\0" * 8)
    spec = Ns(source="job.toml", data=Ns(source=str(data / "tokens.bin"), val_source="none"),
              checkpoint=Ns(init_from=str(weights)))
    reads = ct.job_reads(spec)
    assert reads == [("job.toml: the folder of `data.source`", str(data)),
                     ("job.toml: the folder of `checkpoint.init_from`", str(weights))]
    step = step_of("oci", f"{tmp_path}/RUN", "/home/u/proj", reads=reads)  # oci: a `,` is only text in JSON
    with pytest.raises(ct.UserError) as exc:
        step_of("pyxis", f"{tmp_path}/RUN", "/home/u/proj", reads=reads)
    assert exc.value.messages == [f"job.toml: the folder of `checkpoint.init_from` {str(weights)!r} holds `,`, which "
                                  "runtime 'pyxis' would read as the start of another mount or option: use a folder "
                                  "without `,`, `:` or a newline"]
    c = ct.Container(runtime="pyxis", image="a#b")
    mounts = ct.step_mounts(c, "/runs", "/home/u/proj", LINKS, [reads[0]])
    assert ct.Mount(str(data), str(data), True) in mounts and step.argv


def test_a_submit_from_a_folder_with_a_comma_leaves_nothing_behind(tmp_path):
    """`hpcx submit` end to end: one line naming the folder, exit 2, and no run folder (nothing reaches sbatch)."""
    from tests.conftest import hpcx

    root = tmp_path / "runs"
    site = tmp_path / "pyxis.toml"
    site.write_text(EXAMPLES["pyxis"].read_text().replace('run_root = "$HOME/hpcx-runs"', f'run_root = "{root}"'))
    here = odd_folder(tmp_path, "proj", ",")
    out = hpcx("submit", str(REPO / "jobs/tiny-hsdp-2node.toml"), "--site", str(site), cwd=here, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"the folder the job is submitted from {str(here)!r} holds `,`" in lines[0], out.stderr
    assert "Traceback" not in out.stderr and not list(root.glob("*/*")), list(root.rglob("*"))


def test_an_image_the_spec_names_is_blamed_on_the_spec_and_leaves_nothing(tmp_path):
    from tests.conftest import hpcx

    root = tmp_path / "runs"
    site = tmp_path / "oci.toml"
    site.write_text(EXAMPLES["oci"].read_text().replace('run_root = "$HOME/hpcx-runs"', f'run_root = "{root}"')
                    .replace('/shared/images/pytorch-25.12', str(image_bundle(tmp_path / "image"))))
    spec = tmp_path / "job.toml"
    spec.write_text((REPO / "jobs/tiny-hsdp-2node.toml").read_text() + f'\n[container]\nimage = "{tmp_path}/gone"\n')
    out = hpcx("submit", str(spec), "--site", str(site), cwd=tmp_path, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"{spec}: `container.image` = '{tmp_path}/gone': no OCI bundle there" in out.stderr, out.stderr
    assert str(site) not in out.stderr and not list(root.glob("*/*"))
    # the site's own image, broken: the site profile is named
    (tmp_path / "image" / "config.json").write_text("[" * 100_000)
    spec.write_text((REPO / "jobs/tiny-hsdp-2node.toml").read_text())
    out = hpcx("submit", str(spec), "--site", str(site), cwd=tmp_path, timeout=300)
    assert out.returncode == 2 and f"{site}: `container.image` = '{tmp_path}/image': its config.json: JSON nested " \
        "deeper than" in out.stderr, out.stdout + out.stderr
    assert not list(root.glob("*/*"))


# ---------------------------------------------------------------- each task's own configuration, on its node


def bundle_for(tmp_path: Path, **more) -> Path:
    """A run folder with the per-run bundle of a runc site (``more``: [container] values); returns it."""
    c = ct.Container(runtime="oci", image=str(image_bundle(tmp_path / "img", HOSTILE)), oci_launch="runc", **more)
    run = tmp_path / "run"
    sc.write_bundle(c, run / "container" / "bundle", [], "/w", gpus=0, source="site.toml")
    return run


def test_a_task_gets_its_nodes_devices_libraries_and_cdi_edits(tmp_path, monkeypatch):
    from hpc.schedulers.slurm import oci

    libs = odd_folder(tmp_path, "driver", "")
    for name in ("libcuda.so.1", "libnvidia-ml.so.1"):
        (libs / name).write_text("")
    cdi = odd_folder(tmp_path, "cdi", "")
    (cdi / "fake.json").write_text(json.dumps({
        "cdiVersion": "0.6.0", "kind": "example.com/gpu",
        "containerEdits": {"env": ["FAKE_DRIVER=1"], "hooks": [{"hookName": "createContainer", "path": "/bin/true"}]},
        "devices": [{"name": "all", "containerEdits": {
            "deviceNodes": [{"path": "/dev/nvidia0", "hostPath": "/dev/null"}],
            "mounts": [{"hostPath": str(libs), "containerPath": "/usr/local/nvidia/lib64", "options": ["ro", "rbind"]}]}},
            {"name": "1", "containerEdits": {"deviceNodes": [{"path": "/dev/zero"}]}}]}))
    monkeypatch.setattr(oci, "CDI_DIRS", (str(cdi), str(tmp_path / "absent")))
    run = bundle_for(tmp_path, devices=["/dev/nul*"], gpu_libraries=[f"{libs}/libcuda.so*", f"{libs}/libnvidia-ml.so.1"],
                     cdi=["example.com/gpu=all"], shm_gb=2)
    config = oci.task_config(run, tmp_path / "task")
    null = os.stat("/dev/null")
    assert config["process"]["args"][-1] == str(tmp_path / "task")
    assert [d["path"] for d in config["linux"]["devices"]] == ["/dev/null", "/dev/nvidia0"]
    assert config["linux"]["devices"][1] == {"path": "/dev/nvidia0", "type": "c", "major": os.major(null.st_rdev),
                                             "minor": os.minor(null.st_rdev), "fileMode": 0o666, "uid": 0, "gid": 0}
    assert {"allow": True, "type": "c", "major": 1, "minor": 3, "access": "rwm"} in config["linux"]["resources"]["devices"]
    binds = {m["destination"]: m for m in config["mounts"]}
    assert binds[f"{libs}/libcuda.so.1"]["options"][-1] == "ro" and f"{libs}/libnvidia-ml.so.1" in binds
    assert binds["/usr/local/nvidia/lib64"]["source"] == str(libs)
    assert f"LD_LIBRARY_PATH={libs}" in config["process"]["env"] and "FAKE_DRIVER=1" in config["process"]["env"]
    assert config["hooks"] == {"createContainer": [{"path": "/bin/true"}]}  # the site's CDI spec: its hooks run
    assert binds["/dev/shm"]["options"][-1] == "size=2g"


def test_what_a_node_lacks_is_one_line(tmp_path, monkeypatch, capsys):
    from hpc.schedulers.slurm import oci

    monkeypatch.setattr(oci, "CDI_DIRS", (str(tmp_path / "none"),))
    cases = [({"devices": ["/dev/hpcx-no-such-gpu*"]}, "no device node matches '/dev/hpcx-no-such-gpu*' on "),
             ({"infiniband": True, "devices": ["/dev/null"]}, "no device node matches '/dev/infiniband/*'"),
             ({"gpu_libraries": ["/no/libcuda.so*"]}, "no file matches '/no/libcuda.so*'"),
             ({"cdi": ["nvidia.com/gpu=all"]}, "CDI device 'nvidia.com/gpu=all' is in no CDI spec on ")]
    if os.path.exists("/dev/infiniband"):
        cases.pop(1)
    for more, expected in cases:
        run = bundle_for(tmp_path / str(len(expected)), **more)
        (tmp_path / "task").mkdir(exist_ok=True)
        with pytest.raises(SystemExit) as exc:
            oci.main([str(run), str(tmp_path / "task"), "hpcx-test"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.count("\n") == 1 and err.startswith(f"hpcx: {expected}"), err
        assert "site.toml" in err or "CDI" in err


def test_the_loader_keeps_the_images_search_paths_and_gives_the_task_the_rest(tmp_path):
    """What each runc task does inside the image (``LOADER``), here with this machine's Python: the image's
    environment (runc's process.env) is the base, the task's goes over it but for PATH and LD_LIBRARY_PATH."""
    import subprocess

    task = [b"HPCX_T=task", b"PATH=/host/venv/bin:/usr/bin:/bin", b"LD_LIBRARY_PATH=/host/lib", b"SHARED=task"]
    (tmp_path / "environ").write_bytes(b"\0".join(task) + b"\0")
    probe = "import os; print(*(os.environ.get(k) for k in ('HPCX_T', 'PATH', 'LD_LIBRARY_PATH', 'SHARED', 'LANG')))"
    (tmp_path / "argv").write_bytes(b"\0".join(a.encode() for a in [sys.executable, "-c", probe]) + b"\0")
    image = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64", "SHARED": "image",
             "LANG": "C.UTF-8"}
    out = subprocess.run([sys.executable, "-c", sc.LOADER, str(tmp_path)], capture_output=True, text=True, timeout=60,
                         env=image)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["task", "/usr/local/bin:/usr/bin:/bin", "/usr/local/nvidia/lib64", "task", "C.UTF-8"]


# ---------------------------------------------------------------- torch, CUDA, NCCL and /dev/shm inside the image


def test_the_torch_floor_is_pyprojects():
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch,) = [d for d in deps if d.replace(" ", "").startswith("torch>=")]
    floor = torch.split(">=", 1)[1].split(",")[0]
    assert ct.TORCH_FLOOR == ct.release(floor)
    assert ct.release("2.6.0a0+ecf3bae") >= ct.TORCH_FLOOR > ct.release("2.5.1+cu124") > ct.release("")
    assert ct.release("2.10.0a0+b4e4ee8") > ct.release("2.9.1")  # numbers, not text


def fake_image_python(tmp_path: Path, torch_version: str, cuda: str = "None", nccl: str = "") -> Path:
    """A folder that, first on PYTHONPATH, makes this Python look like an image with that torch (and numpy)."""
    site = tmp_path / f"site-{torch_version}"
    for name, version in (("torch", torch_version), ("numpy", "2.0.0")) + ((("nvidia_nccl_cu12", nccl),) if nccl else ()):
        package = site / name
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("raise ImportError('a stand-in: never imported by the check')\n")
        meta = site / f"{name}-{version}.dist-info"
        meta.mkdir()
        (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n")
    (site / "torch" / "version.py").write_text(f"__version__ = '{torch_version}'\ncuda: str | None = {cuda}\n")
    return site


@pytest.mark.parametrize("version,cuda,nccl,ok", [("2.4.0a0+3bcc3cd", "'12.4'", "", False), ("2.5.1", "None", "", False),
                                                  ("2.6.0a0+ecf3bae", "'12.8'", "2.25.1", True),
                                                  ("2.10.0a0+b4e4ee8", "'13.1'", "2.28.9", True)])
def test_each_node_prints_what_the_image_holds_and_refuses_an_old_torch(tmp_path, version, cuda, nccl, ok):
    """The first action of each task (``BOOT``), in a real Python whose `torch` is an old or a new one."""
    import subprocess

    from hpc.core.imports import python_command

    site = fake_image_python(tmp_path, version, cuda, nccl)
    env = {**os.environ, "PYTHONPATH": f"{site}:{REPO}", "HPCX_CONTAINER_IMAGE": "/images/pt", "SLURM_LOCALID": "0"}
    out = subprocess.run(python_command(sys.executable, "platform"), capture_output=True, text=True, env=env,
                         timeout=120, cwd=tmp_path)
    lines = out.stderr.splitlines()
    import platform

    assert lines[0] == (f"hpcx: image /images/pt on {platform.node()}: python {platform.python_version()}, torch "
                        f"{version}, CUDA {cuda.strip(chr(39)) if cuda != 'None' else 'none'}, NCCL {nccl or 'none'}")
    if ok:
        assert out.returncode == 0 and len(lines) == 1, out.stderr
        return
    assert out.returncode == 2 and len(lines) == 2, out.stderr
    assert lines[1] == (f"hpcx: the container image /images/pt has torch {version}, below the 2.6 hpcx's trainer needs "
                        "(pyproject.toml's torch range): use an image with torch 2.6 or newer (docs/containers.md "
                        "names some)")
    # the check after srun reads it as a start that would fail the same way: not requeued
    found = loading_failure(out.stderr + "srun: error: n1: task 0: Exited with exit code 2\n")
    assert found["module"] == "/images/pt" and found["where"] == "starting in the container image"
    # only the first task of a node prints the versions
    quiet = subprocess.run(python_command(sys.executable, "platform"), capture_output=True, text=True, timeout=120,
                           env={**env, "SLURM_LOCALID": "1"}, cwd=tmp_path)
    assert quiet.stderr.splitlines() == lines[1:]


def test_a_dev_shm_smaller_than_the_site_asks_is_refused(tmp_path):
    size = os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize
    assert ct.shm_problem("/img", {}) is None and ct.shm_problem("/img", {ct.SHM_ENV: "0"}) is None
    assert ct.shm_problem("/img", {ct.SHM_ENV: str(max(1, size >> 30))}) is None or size < 1 << 30
    line = ct.shm_problem("/img", {ct.SHM_ENV: str((size >> 30) + 1)})
    assert line.startswith(f"the container image /img has a /dev/shm of {size / 2**30:.2f} GiB on ")
    assert line.endswith(f"below the site's `container.shm_gb` = {(size >> 30) + 1}: ask the site for nodes with a "
                         "larger one, or lower it")
    assert "has no" in ct.shm_problem("/img", {ct.SHM_ENV: "1"}, str(tmp_path / "gone"))


def test_render_with_a_run_dir_whose_root_holds_a_comma_is_one_line(tmp_path):
    """`hpcx render --run-dir`: its parent is the run root, which pyxis would mount."""
    from tests.conftest import hpcx

    root = odd_folder(tmp_path, "runs", ",")
    out = hpcx("render", str(REPO / "jobs/tiny-hsdp-2node.toml"), "--site", str(EXAMPLES["pyxis"]), "--run-dir",
               f"{root}/RUN", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("hpcx")] or [out.stderr]
    assert f"the run root {str(root)!r} holds `,`, which runtime 'pyxis'" in line, out.stderr


@pytest.mark.parametrize("runtime,missing", [("apptainer", "gone.sif"), ("oci", "gone")])
def test_each_runtimes_refused_submit_leaves_no_run_folder(tmp_path, runtime, missing):
    """An image the site names that is not there: the site profile is blamed, nothing is left in the run root."""
    from tests.conftest import hpcx

    root = tmp_path / "runs"
    site = tmp_path / f"{runtime}.toml"
    site.write_text(EXAMPLES[runtime].read_text().replace('run_root = "$HOME/hpcx-runs"', f'run_root = "{root}"')
                    .replace("/shared/images/pytorch-25.12.sif" if runtime == "apptainer" else
                             "/shared/images/pytorch-25.12", str(tmp_path / missing)))
    out = hpcx("submit", str(REPO / "jobs/tiny-hsdp-2node.toml"), "--site", str(site), cwd=tmp_path, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"{site}: `container.image` = '{tmp_path / missing}': no" in out.stderr, out.stderr
    assert root.is_dir() and not list(root.glob("*/*")), list(root.rglob("*"))


# ---------------------------------------------------------------- a kind that runs no container

LOCAL = REPO / "site" / "local.toml"
IMAGE_OF = {"pyxis": "nvcr.io#nvidia/pytorch:25.12-py3", "apptainer": "/shared/images/pytorch-25.12.sif",
            "oci": "/shared/images/pytorch-25.12"}
NO_CONTAINER = "but a 'local' site runs no container (its scheduler kind has no container runtime)"


@pytest.mark.parametrize("runtime", sorted(IMAGE_OF))
def test_a_local_profile_naming_a_runtime_is_refused_in_one_line(tmp_path, runtime):
    """Each runtime, as the profile's `runtime` and among its `runtimes`: one line naming the file and key."""
    profile = tmp_path / "mine.toml"
    for table, key in ((f'runtime = "{runtime}"\nimage = "{IMAGE_OF[runtime]}"', "runtime` ="),
                       (f'runtimes = ["none", "{runtime}"]', "runtimes` names")):
        profile.write_text(LOCAL.read_text() + f"\n[container]\n{table}\n")
        with pytest.raises(ConfigError) as exc:
            load_site(str(profile))
        (line,) = exc.value.messages
        assert line.startswith(f"{profile}: `container.{key} '{runtime}', {NO_CONTAINER}: remove the [container] "
                               "table"), line


@pytest.mark.parametrize("runtime", sorted(IMAGE_OF))
def test_a_job_container_on_a_local_site_is_refused_naming_the_spec(tmp_path, runtime):
    """A job's `[container]` naming a runtime, or changing anything (the image, a mount), on the local site."""
    from hpc.core.site import job_site

    site = load_site("local")
    cases = {f'runtime = "{runtime}"\nimage = "{IMAGE_OF[runtime]}"': f"`container.runtime` = '{runtime}', "
             f"{NO_CONTAINER}", f'image = "{IMAGE_OF[runtime]}"': f"`container.image` is set, {NO_CONTAINER}",
             'mounts = ["/data:/data:ro"]': f"`container.mounts` is set, {NO_CONTAINER}"}
    for table, expected in cases.items():
        path = tmp_path / "job.toml"
        path.write_text(f'[job]\nname = "x"\ncommand = ["true"]\n\n[container]\n{table}\n')
        with pytest.raises(ConfigError) as exc:
            job_site(site, load_spec(path))
        (line,) = exc.value.messages
        assert line.startswith(f"{path}: {expected}: remove the") and line.endswith(f"over {LOCAL})"), line


def test_a_slurm_profile_takes_every_runtime_and_a_local_one_none():
    """The kinds' tables: Slurm runs all four runtimes, local only `none` (an explicit `none` loads)."""
    from hpc import schedulers

    assert sorted(schedulers.container_runtimes("slurm")) == sorted(ct.RUNTIMES)
    assert dict(schedulers.container_runtimes("local")) == {}
    assert not parse_site({**ct_local_doc(), "container": {"runtime": "none"}}, "l", "l.toml").container.enabled
    for name in ct.RUNTIMES:
        assert schedulers.container_runtime(name).name == name  # type: ignore[union-attr]


def ct_local_doc() -> dict:
    from hpc.core.config import read_toml

    return read_toml(LOCAL)


def test_render_and_submit_on_a_local_site_refuse_a_container_with_exit_2(tmp_path):
    """End to end: the site profile's `[container]` (render) and the job's (submit): exit 2, one line, and no
    run folder left."""
    from tests.conftest import hpcx

    profile = tmp_path / "mine.toml"
    profile.write_text(LOCAL.read_text() + '\n[container]\nruntime = "apptainer"\nimage = "/i.sif"\n')
    out = hpcx("render", str(REPO / "jobs/tiny-ddp.toml"), "--site", str(profile), cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert [x for x in out.stderr.splitlines() if x.strip()] == [
        f"error: {profile}: `container.runtime` = 'apptainer', {NO_CONTAINER}: remove the [container] table, or use a "
        "site whose scheduler runs it"], out.stderr
    root = tmp_path / "runs"
    job = tmp_path / "job.toml"
    job.write_text(f'[job]\nname = "x"\ncommand = ["true"]\nrun_root = "{root}"\n\n[container]\nruntime = "oci"\n'
                   'image = "/b"\n')
    out = hpcx("submit", str(job), "--site", "local", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    (line,) = [x for x in out.stderr.splitlines() if x.strip()]
    assert f"{job}: `container.runtime` = 'oci', {NO_CONTAINER}" in line, out.stderr
    assert not root.exists() or not list(root.iterdir())

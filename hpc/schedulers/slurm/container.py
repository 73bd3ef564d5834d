"""The srun step in the site's container (``hpc.core.container``): only the step enters the image.

The batch shell, the check after srun (``python -m hpc.requeue``), ``scontrol requeue`` and the signal
traps stay on the host, so preemption, the one requeue, drills, cancel and failure records are the
same as without a container. ``wrap_step`` is the one place that puts a runtime on the step:

- ``oci``: Slurm's own OCI support, ``srun --container=BUNDLE``. The site's image is an OCI bundle; hpcx
  writes a per-run bundle (RUN/container/bundle/config.json) that is the image's configuration with its
  root file system by absolute path, the step's mounts and working folder. slurmstepd replaces its
  ``process.args`` and ``process.env`` with the task's and runs the runtime oci.conf names (runc here).
- ``pyxis``: ``srun --container-image=IMAGE --container-mounts=… --container-workdir=…`` (pyxis's
  documented flags; ``--no-container-mount-home`` unless ``mount_home``; ``--container-env`` for ``env``).
- ``apptainer``: the task is ``apptainer exec [--nv] --bind … --pwd … IMAGE COMMAND`` (``--nv`` on a GPU
  site; ``--no-home`` unless ``mount_home``); names in ``env`` are passed as ``APPTAINERENV_NAME``.

In each, the task's command is ``env PYTHONPATH=OVERLAY HPCX_CONTAINER_IMAGE=IMAGE PYTHON -u -c BOOT …``
with the image's ``python``: hpcx's own code comes from the overlay (links into the submitting side's
install, mounted read-only at the same paths).
"""

from __future__ import annotations

import copy
import json
import os
import shlex
import typing as tp
from dataclasses import dataclass, field
from pathlib import Path

from hpc.core.container import BUNDLE, IMAGE_ENV, OVERLAY, Container, Mount, overlay_links, step_mounts, write_overlay


OCI_TASK = "container/oci-task"  # oci_launch = "runc": the task's script on the host (OCI_TASK_SCRIPT)
RUNC = ["runc", "--root=/run/hpcx-runc"]
# Each task's own bundle: the per-run configuration with this task's folder for @TASKDIR@, its environment
# and arguments in files there (NUL-separated: any value), read inside by LOADER before it execs them.
OCI_TASK_SCRIPT = """#!/bin/sh
# hpcx: run this task in the run's OCI bundle with runc (docs/containers.md); "$@" is the task's command
set -eu
run=$(dirname "$(dirname "$0")")
id="hpcx-${SLURM_JOB_ID}-${SLURM_RESTART_COUNT:-0}-${SLURM_STEP_ID:-batch}-${SLURM_PROCID:-0}"
dir="$run/container/tasks/$id"
mkdir -p "$dir/rootfs"  # the image is bound onto it (root.path is rootfs, as Slurm 22.05 wants)
env -0 > "$dir/environ"
printf '%s\\0' "$@" > "$dir/argv"
sed "s|@TASKDIR@|$dir|g" "$run/container/bundle/config.json" > "$dir/config.json"
RUNC delete --force "$id" 2>/dev/null || true
exec RUNC run --bundle "$dir" "$id"
"""
# Inside the image: the task's environment and arguments from its folder, then exec (no hpcx import).
LOADER = ("import os, sys; d = sys.argv[1]; "
          "env = dict(e.split(b'=', 1) for e in open(d + '/environ', 'rb').read().split(bytes(1)) if b'=' in e); "
          "args = open(d + '/argv', 'rb').read().split(bytes(1))[:-1]; os.execvpe(args[0], args, env)")


@dataclass(frozen=True)
class Step:
    """How the srun step runs in the container: srun's own flags, the task's argv, shell lines for the batch
    script before srun (each value taken from the batch shell's environment, never written)."""

    srun_args: list[str]
    argv: list[str]
    setup: list[str] = field(default_factory=list)


HOST_REQUEUE_ENV = "HPCX_HOST_REQUEUE"  # inside the image: where rank 0 asks the host for the one requeue
HOST_REQUEUE = "container/requeue-request"  # under the run folder, + .JOB.RESTARTS


def inner_python(c: Container, run_dir: str) -> list[str]:
    """The interpreter a task runs inside the image, with hpcx's overlay first on its path (and where to
    ask the host for a requeue: the image has no scontrol)."""
    return ["env", f"PYTHONPATH={run_dir}/{OVERLAY}", f"{IMAGE_ENV}={c.image}",
            f"{HOST_REQUEUE_ENV}={run_dir}/{HOST_REQUEUE}", c.python]


def host_requeue_line(run_dir: str) -> str:
    """After srun, in the batch shell on the host: the requeue rank 0 asked for from inside the image."""
    request = f'{shlex.quote(f"{run_dir}/{HOST_REQUEUE}")}."$SLURM_JOB_ID.${{SLURM_RESTART_COUNT:-0}}"'
    return (f'[ ! -e {request} ] || scontrol requeue "$SLURM_JOB_ID"  # asked for by rank 0 inside the image '
            "(it has no scontrol)")


def request_host_requeue(env: tp.Mapping[str, str], job: str, restarts: int) -> bool:
    """Inside the image: leave the request for ``host_requeue_line``; False outside a container."""
    path = env.get(HOST_REQUEUE_ENV)
    if not path:
        return False
    Path(f"{path}.{job}.{restarts}").write_text(f"{job} {restarts}\n")
    return True


def wrap_step(argv: list[str], c: Container, run_dir: str, mounts: list[Mount], workdir: str,
              gpus: bool = False) -> Step:
    """The step for ``argv`` (the task's command, already run by the image's python: ``inner_python``) in
    container ``c``; without a container, ``argv`` as it is."""
    workdir = c.workdir or workdir
    if c.runtime == "oci" and c.oci_launch == "runc":
        return Step([], ["/bin/sh", f"{run_dir}/{OCI_TASK}", *argv])
    if c.runtime == "oci":
        return Step([f"--container={run_dir}/{BUNDLE}"], argv)
    if c.runtime == "pyxis":
        flags = [f"--container-image={c.image}", f"--container-mounts={','.join(m.text() for m in mounts)}",
                 f"--container-workdir={workdir}"]
        flags += [f"--container-env={','.join(c.env)}"] if c.env else []
        flags += [] if c.mount_home else ["--no-container-mount-home"]
        flags += ["--container-writable"] if c.writable else []
        return Step([*flags, *c.flags], argv)
    if c.runtime == "apptainer":
        flags = ["--nv"] if gpus else []
        flags += ["--bind", ",".join(m.text() for m in mounts), "--pwd", workdir]
        flags += [] if c.mount_home else ["--no-home"]
        flags += ["--writable-tmpfs"] if c.writable else []
        setup = [f'[ -z "${{{name}+x}}" ] || export APPTAINERENV_{name}="${name}"  # passed into the image by name'
                 for name in c.env]
        return Step([], ["apptainer", "exec", *flags, *c.flags, c.image, *argv], setup)
    return Step([], argv)


def step_for(c: Container, run_dir: str, folder: str, workdir: str, gpus: bool,
             links: tp.Mapping[str, str] | None = None) -> Step:
    """The trainer's step (``python -m trainer.entry FOLDER`` under the task wrapper) in ``c``."""
    from hpc.core.imports import python_command
    from hpc.schedulers.base import TASK_WRAPPER

    inner = inner_python(c, run_dir)
    argv = [*TASK_WRAPPER, *inner[:-1], *python_command(inner[-1], "trainer.entry", folder, unbuffered=True)]
    mounts = step_mounts(c, str(Path(run_dir).parent), workdir, links if links is not None else overlay_links())
    return wrap_step(argv, c, run_dir, mounts, workdir, gpus)


def prepare_run(c: Container, run_dir: Path, workdir: str, writes: str | None = None) -> None:
    """At submit: the overlay of links and, for ``oci``, the per-run bundle (RUN/container/…); ``writes``:
    the folder mounted read-write (default: the run root, RUN's parent)."""
    links = overlay_links()
    write_overlay(run_dir, links)
    if c.runtime == "oci":
        mounts = step_mounts(c, writes or str(run_dir.parent), workdir, links)
        write_bundle(c, run_dir / BUNDLE, mounts, c.workdir or workdir)
        if c.oci_launch == "runc":
            (run_dir / OCI_TASK).write_text(OCI_TASK_SCRIPT.replace("RUNC", shlex.join(RUNC)))


def bundle_config(image_config: dict[str, tp.Any], image: str, mounts: list[Mount], workdir: str,
                  writable: bool, args: list[str] | None = None) -> dict[str, tp.Any]:
    """The per-run OCI configuration: the image's, its root by absolute path, the step's bind mounts and
    working folder. (slurmstepd sets ``process.args``/``process.env`` per task.)"""
    config = copy.deepcopy(image_config)
    image_root = os.path.realpath(os.path.join(image, config.get("root", {}).get("path", "rootfs")))  # no link
    # Slurm 22.05 takes BUNDLE/rootfs whatever root.path says: the per-run bundle has an empty rootfs/ and
    # the image's root file system is bound onto it first (runc mounts it before the others). The bind is
    # read-write so that runc can make the mount points of the mounts that follow (empty folders, as for any
    # bundle); `root.readonly` then remounts the whole root read-only before the task starts.
    config["root"] = {"path": "rootfs", "readonly": not writable}
    whole = {"destination": "/", "type": "none", "source": image_root, "options": ["rbind", "rw"]}
    config.setdefault("process", {})["cwd"] = workdir
    if args is not None:
        config["process"]["args"] = args
    binds = [{"destination": m.target, "type": "none", "source": m.source,
              "options": ["rbind", "nosuid", "nodev", "ro" if m.readonly else "rw"]} for m in mounts]
    config["mounts"] = [whole, *config.get("mounts", []), *binds]
    return config


def write_bundle(c: Container, bundle: Path, mounts: list[Mount], workdir: str) -> Path:
    image_config = json.loads((Path(c.image) / "config.json").read_text())
    (bundle / "rootfs").mkdir(parents=True, exist_ok=True)
    args = [c.python, "-c", LOADER, "@TASKDIR@"] if c.oci_launch == "runc" else None
    config = bundle_config(image_config, c.image, mounts, workdir, c.writable, args)
    (bundle / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return bundle


def step_text(step: Step) -> str:
    """The srun arguments and command as the batch script has them (for the array tasks' scripts)."""
    return shlex.join([*step.srun_args, *step.argv])

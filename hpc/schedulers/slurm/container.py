"""The srun step in the site's container (``hpc.core.container``): only the step enters the image.

The batch shell, the check after srun (``python -m hpc.requeue``), ``scontrol requeue`` and the signal
traps stay on the host, so preemption, the one requeue, drills, cancel and failure records are the
same as without a container. ``wrap_step`` is the one place that puts a runtime on the step:

- ``oci``: Slurm's own OCI support, ``srun --container=BUNDLE``, or (``oci_launch = "runc"``) each task
  running ``runc run`` itself. The site's image is an OCI bundle; hpcx writes a per-run bundle
  (RUN/container/bundle/config.json, ``hpc.schedulers.slurm.oci``) of its own: the image's root file
  system, environment and user, hpcx's mounts, namespace and working folder; with runc, each node adds
  its devices as the task starts. slurmstepd replaces ``process.args`` and ``process.env`` with the
  task's and runs the runtime oci.conf names (runc here).
- ``pyxis``: ``srun --container-image=IMAGE --container-mounts=… --container-workdir=…`` (pyxis's
  documented flags; ``--no-container-mount-home`` unless ``mount_home``; ``--container-env`` for ``env``).
- ``apptainer``: the task is ``apptainer exec [--nv] --bind … --pwd … IMAGE COMMAND`` (``--nv`` on a GPU
  site; ``--no-home`` unless ``mount_home``); names in ``env`` are passed as ``APPTAINERENV_NAME``.

In each, the task's command is ``env PYTHONPATH=OVERLAY HPCX_CONTAINER_IMAGE=IMAGE PYTHON -u -c BOOT …``
with the image's ``python``: hpcx's own code comes from the overlay (links into the submitting side's
install, mounted read-only at the same paths).
"""

from __future__ import annotations

import os
import shlex
import sys
import typing as tp
from dataclasses import dataclass
from pathlib import Path

from hpc.core.container import (BUNDLE, CDI_NAME, IMAGE_ENV, NODE_DEVICES, OVERLAY, SHM_ENV, Container, Mount,
                                overlay_links, step_mounts, write_overlay)
from hpc.core.errors import UserError
from hpc.core.validate import char_label
from hpc.schedulers.base import TASK_WRAPPER, ContainerRuntime
from hpc.schedulers.slurm.oci import LOADER, write_bundle  # noqa: F401 (LOADER: re-exported)


OCI_TASK = "container/oci-task"  # oci_launch = "runc": the task's script on the host (OCI_TASK_SCRIPT)
# Each task's own bundle: its environment and arguments in files of its folder (NUL-separated: any value),
# read inside by LOADER before it execs them; its config.json written on its node by the host's Python
# (``hpc.schedulers.slurm.oci``: this node's devices), which then execs runc.
OCI_TASK_SCRIPT = """#!/bin/sh
# hpcx: run this task in the run's OCI bundle with runc (docs/containers.md); "$@" is the task's command
set -eu
run=$(dirname "$(dirname "$0")")
id="hpcx-${SLURM_JOB_ID}-${SLURM_RESTART_COUNT:-0}-${SLURM_STEP_ID:-batch}-${SLURM_PROCID:-0}"
dir="$run/container/tasks/$id"
mkdir -p "$dir/rootfs"  # the image is bound onto it (root.path is rootfs, as Slurm 22.05 wants)
env -0 > "$dir/environ"
printf '%s\\0' "$@" > "$dir/argv"
exec HOST_PYTHON "$run" "$dir" "$id"
"""


@dataclass(frozen=True)
class Wrapped:
    """What a runtime makes of a task's command: srun's own flags, the task's argv, shell lines for the batch
    script before srun (each value taken from the batch shell's environment, never written)."""

    srun_args: tuple[str, ...]
    argv: tuple[str, ...]
    setup: tuple[str, ...] = ()


HOST_REQUEUE_ENV = "HPCX_HOST_REQUEUE"  # inside the image: where rank 0 asks the host for the one requeue
HOST_REQUEUE = "container/requeue-request"  # under the run folder, + .JOB.RESTARTS


def inner_python(c: Container, run_dir: str) -> list[str]:
    """The interpreter a task runs inside the image, with hpcx's overlay first on its path (and where to
    ask the host for a requeue: the image has no scontrol)."""
    shm = [f"{SHM_ENV}={c.shm_gb}"] if c.shm_gb else []
    return ["env", f"PYTHONPATH={run_dir}/{OVERLAY}", f"{IMAGE_ENV}={c.image}",
            f"{HOST_REQUEUE_ENV}={run_dir}/{HOST_REQUEUE}", *shm, c.python]


def check_run_folder(run_dir: str) -> None:
    """The run folder is on PYTHONPATH inside the image (split at `:`) and in every runtime's step line."""
    bad = next((ch for ch in run_dir if ch in ":\n"), None)
    if bad:
        shown = "`:`" if bad == ":" else char_label(bad)
        raise UserError([f"the run folder {run_dir!r} holds {shown}, which PYTHONPATH inside the image would split: "
                         "use a run root and job name without `:` or a newline"])


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


# ---------------------------------------------------------------- the runtimes (``ContainerRuntime``)


class NoContainer:
    """``none``: the nodes' own Python; the step as it is."""

    name = "none"
    list_syntax = ""
    binds_node_devices = False
    takes_uris = enroot_names = image_folder = False

    def problems(self, c: Container, prefix: str, gpus: int) -> list[str]:
        return []

    def wrap(self, argv: list[str], c: Container, run_dir: str, mounts: list[Mount], workdir: str,
             gpus: bool) -> Wrapped:
        return Wrapped((), tuple(argv))

    def prepare(self, c: Container, run_dir: Path, mounts: list[Mount], workdir: str, where: str, gpus: int,
                source: str) -> None:
        """Nothing on the nodes beyond the overlay (``prepare_run``)."""


class Pyxis(NoContainer):
    """``srun --container-image=IMAGE --container-mounts=… --container-workdir=…`` (pyxis's documented flags)."""

    name = "pyxis"
    list_syntax = ",:\n"  # --container-mounts splits at `,` (mounts) and `:` (source, target, options)
    binds_node_devices = True
    takes_uris = enroot_names = True  # `nvcr.io#nvidia/pytorch:…`, `ubuntu:24.04`: enroot pulls them

    def problems(self, c: Container, prefix: str, gpus: int) -> list[str]:
        return oci_only_keys(c, prefix)

    def wrap(self, argv: list[str], c: Container, run_dir: str, mounts: list[Mount], workdir: str,
             gpus: bool) -> Wrapped:
        flags = [f"--container-image={c.image}", f"--container-mounts={','.join(m.text() for m in mounts)}",
                 f"--container-workdir={workdir}"]
        flags += [f"--container-env={','.join(c.env)}"] if c.env else []
        flags += [] if c.mount_home else ["--no-container-mount-home"]
        flags += ["--container-writable"] if c.writable else []
        return Wrapped((*flags, *c.flags), tuple(argv))


class Apptainer(Pyxis):
    """The task is ``apptainer exec [--nv] --bind … --pwd … IMAGE COMMAND``; ``env`` as ``APPTAINERENV_NAME``."""

    name = "apptainer"
    enroot_names = False

    def wrap(self, argv: list[str], c: Container, run_dir: str, mounts: list[Mount], workdir: str,
             gpus: bool) -> Wrapped:
        flags = ["--nv"] if gpus else []
        flags += ["--bind", ",".join(m.text() for m in mounts), "--pwd", workdir]
        flags += [] if c.mount_home else ["--no-home"]
        flags += ["--writable-tmpfs"] if c.writable else []
        setup = tuple(f'[ -z "${{{name}+x}}" ] || export APPTAINERENV_{name}="${name}"  # passed into the image by '
                      "name" for name in c.env)
        return Wrapped((), ("apptainer", "exec", *flags, *c.flags, c.image, *argv), setup)


class Oci(NoContainer):
    """Slurm's own OCI support (``srun --container=BUNDLE``) or, with ``oci_launch = "runc"``, each task running
    ``runc run`` itself; the per-run bundle is written at submit (``hpc.schedulers.slurm.oci``)."""

    name = "oci"
    list_syntax = "\n"  # the bundle's mounts are JSON: only the step line's newline splits
    image_folder = True

    def problems(self, c: Container, prefix: str, gpus: int) -> list[str]:
        out = [f"`{prefix}.writable` = true: runtime 'oci' binds one image's root file system into every run, "
               "read-only; write to the mounted folders instead"] if c.writable else []
        return out + oci_device_problems(c, prefix, gpus)

    def wrap(self, argv: list[str], c: Container, run_dir: str, mounts: list[Mount], workdir: str,
             gpus: bool) -> Wrapped:
        if c.oci_launch == "runc":
            return Wrapped((), ("/bin/sh", f"{run_dir}/{OCI_TASK}", *argv))
        return Wrapped((f"--container={run_dir}/{BUNDLE}",), tuple(argv))

    def prepare(self, c: Container, run_dir: Path, mounts: list[Mount], workdir: str, where: str, gpus: int,
                source: str) -> None:
        """The per-run bundle and, for runc, the task's script on the host."""
        from hpc.core.imports import python_command  # lazy: startup

        write_bundle(c, run_dir / BUNDLE, mounts, c.workdir or workdir, where, gpus, source)
        if c.oci_launch == "runc":
            host = shlex.join(python_command(sys.executable, "hpc.schedulers.slurm.oci"))
            (run_dir / OCI_TASK).write_text(OCI_TASK_SCRIPT.replace("HOST_PYTHON", host))


# The one table of container runtimes: every caller asks it by the profile's `container.runtime`.
RUNTIMES: dict[str, ContainerRuntime] = {r.name: r for r in (NoContainer(), Pyxis(), Apptainer(), Oci())}


def oci_only_keys(c: Container, prefix: str) -> list[str]:
    """The device keys an OCI bundle is given on each node, set for a runtime that brings the node's GPUs itself."""
    return [f"`{prefix}.{key}` is for runtime 'oci' ({c.runtime} brings the node's GPUs itself)"
            for key in NODE_DEVICES if getattr(c, key)]


def oci_device_problems(c: Container, prefix: str, gpus: int) -> list[str]:
    """GPUs, InfiniBand and driver libraries of an OCI bundle: given on each node, which only a task that runs
    runc itself can do (``oci_launch = "runc"``)."""
    given = [key for key in NODE_DEVICES if getattr(c, key)] + (["infiniband"] if c.infiniband else [])
    out = [f"`{prefix}.cdi` names {name!r}: expected a CDI device `VENDOR/CLASS=NAME`, e.g. 'nvidia.com/gpu=all'"
           for name in c.cdi if not CDI_NAME.match(name)]
    out += [f"`{prefix}.devices` has {d!r}: expected an absolute path under /dev/" for d in c.devices
            if not d.startswith("/dev/") or "/../" in d or "\n" in d]
    out += [f"`{prefix}.gpu_libraries` has {lib!r}: expected an absolute path without `,`, `:` or a newline"
            for lib in c.gpu_libraries if not os.path.isabs(lib) or any(ch in lib for ch in ",:\n")]
    if c.oci_launch == "scheduler" and (given or gpus):
        what = f"`{prefix}.{given[0]}`" if given else f"a GPU site ({gpus} GPUs per node)"
        out.append(f"{what} needs `{prefix}.oci_launch` = 'runc': devices are found on each node when its task "
                   "starts, and the scheduler's `srun --container` takes the bundle as written at submit")
    elif gpus and not c.cdi and not c.gpu_libraries:
        out.append(f"`{prefix}` runtime 'oci' on a GPU site: expected `cdi` (e.g. ['nvidia.com/gpu=all'], from the "
                   "node's CDI spec) or `gpu_libraries` (the driver's libcuda, libnvidia-ml … on the nodes)")
    return out


# ---------------------------------------------------------------- a step in the site's container


def wrap_step(argv: list[str], c: Container, run_dir: str, mounts: list[Mount], workdir: str,
              gpus: bool = False) -> Wrapped:
    """The step for ``argv`` (the task's command, already run by the image's python: ``inner_python``) in
    container ``c``'s runtime; without a container, ``argv`` as it is."""
    return RUNTIMES[c.runtime].wrap(argv, c, run_dir, mounts, c.workdir or workdir, gpus)


def step_for(c: Container, run_dir: str, folder: str, workdir: str, gpus: bool,
             links: tp.Mapping[str, str] | None = None, reads: tp.Sequence[tuple[str, str]] = ()) -> Wrapped:
    """The trainer's step (``python -m trainer.entry FOLDER`` under the task wrapper) in ``c`` (``reads``: the
    job's input folders, mounted read-only)."""
    return trainer_step(c, run_dir, folder, workdir, gpus, links if links is not None else overlay_links(),
                        reads)[0]


def trainer_step(c: Container, run_dir: str, folder: str, workdir: str, gpus: bool, links: tp.Mapping[str, str],
                 reads: tp.Sequence[tuple[str, str]] = ()) -> tuple[Wrapped, list[Mount]]:
    """``step_for`` and the mounts it was made with (what ``prepare_run`` writes into an OCI bundle)."""
    from hpc.core.imports import python_command  # lazy: startup

    check_run_folder(run_dir)
    inner = inner_python(c, run_dir)
    argv = [*TASK_WRAPPER, *inner[:-1], *python_command(inner[-1], "trainer.entry", folder, unbuffered=True)]
    mounts = step_mounts(c, str(Path(run_dir).parent), workdir, links, reads)
    return wrap_step(argv, c, run_dir, mounts, workdir, gpus), mounts


def prepare_run(c: Container, run_dir: Path, workdir: str, writes: str | None = None,
                reads: tp.Sequence[tuple[str, str]] = (), gpus: int = 0, where: str = "container.image",
                source: str = "", links: tp.Mapping[str, str] | None = None,
                mounts: tp.Sequence[Mount] | None = None) -> None:
    """At submit: the overlay of links and what the runtime needs on the nodes (``oci``: the per-run bundle,
    RUN/container/…); ``writes``: the folder mounted read-write (default: the run root, RUN's parent);
    ``links``, ``mounts``: the step's own when it was just built; ``where``: the file and key that named
    the image, ``source``: the site profile (for messages)."""
    links = overlay_links() if links is None else links
    if mounts is None:
        mounts = step_mounts(c, writes or str(run_dir.parent), workdir, links, reads)
    RUNTIMES[c.runtime].prepare(c, run_dir, list(mounts), workdir, where, gpus, source)
    write_overlay(run_dir, links)


def step_text(step: Wrapped) -> str:
    """The srun arguments and command as the batch script has them (for the array tasks' scripts)."""
    return shlex.join([*step.srun_args, *step.argv])

"""The site's ``[container]`` section: the image every task of a job runs in, and what hpcx brings into it.

The image is used as it is: it provides Python and torch (on a GPU site CUDA and NCCL too) and needs
nothing of hpcx. hpcx brings its own code and its pure-Python dependencies in: an *overlay* folder in the
run folder holds links to hpcx's ``hpc`` and ``trainer`` and to each pure-Python package they need, as
installed where the job is submitted; the folders those links point into are mounted read-only at the
same paths, and the overlay is put first on ``PYTHONPATH`` inside. The run root and the job's folder are
mounted at the same paths as on the host, so every path in resolved.json means the same inside.
Compiled packages (numpy, and for ``hpcx data prepare`` tokenizers, pyarrow, zstandard) must be the
image's own: a host build may not fit the image's Python.

What can be checked before submitting is checked here (strict keys, absolute image paths, mount
strings no runtime would read as another option, the GPU/InfiniBand/shm keys per runtime: ``problems``;
every path hpcx derives itself before it enters a runtime's mount list: ``derived_problems``; at submit,
that the image is there: ``submit_problems``); what only the image can answer (torch importable, at least
``TORCH_FLOOR``, CUDA/NCCL, the size of /dev/shm) is checked by the first task (``inside_problem``), which
fails the start with one line naming the image, not requeued, after the first task of each node printed
what the image holds (``versions_line``). How each runtime is put on the command line is the scheduler's
(``hpc/schedulers/<kind>/container.py``; an OCI bundle's parts: ``hpc/schedulers/slurm/oci.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import typing as tp
import dataclasses
import glob
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from hpc import schedulers
from hpc.core.config import field, load_json_bounded
from hpc.core.errors import ConfigError, UserError
from hpc.core.validate import char_label, open_regular

RUNTIMES = ("none", "pyxis", "apptainer", "oci")
IMAGE_ENV = "HPCX_CONTAINER_IMAGE"  # set inside the step: the image a task runs in (for its start check)
OVERLAY = "container/path"  # under the run folder: links to hpcx's code and its pure-Python dependencies
BUNDLE = "container/bundle"  # under the run folder: the per-run OCI bundle (oci)
# URI schemes of images the login node cannot look at (pulled by the runtime on the node)
IMAGE_URIS = ("docker://", "docker-daemon://", "library://", "oras://", "shub://", "dockerd://", "podman://")
MOUNT_OPTIONS = ("ro", "rw")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class Container:
    runtime: str = field("none", doc="How each task enters the image: `none` (the nodes' own Python), `pyxis` "
                         "(enroot through pyxis), `apptainer` (`apptainer exec`), `oci` (the scheduler's own OCI "
                         "support, an OCI bundle). Slurm runs all four; a `local` site none but `none` (another "
                         "is refused).", choices=RUNTIMES)
    runtimes: list[str] = field(factory=list, doc="The runtimes this site has, for a job's `[container]` to "
                                "choose among (empty: only `runtime`).", max_len=16)
    image: str = field("", doc="pyxis: an enroot URI (`nvcr.io#nvidia/pytorch:25.12-py3`) or an absolute `.sqsh` "
                       "path; apptainer: an absolute `.sif` path (or a `docker://` URI); oci: the absolute path "
                       "of an OCI bundle folder (`config.json` and its root file system).", max_len=4096)
    mounts: list[str] = field(factory=list, doc="More mounts, each `SRC[:DST[:ro|rw]]` with absolute paths "
                              "(no `,`; DST defaults to SRC). The run root, the job's folder and hpcx's own code "
                              "are mounted without being listed.")
    workdir: str = field("", doc="Working folder inside (absolute); empty: the folder the job was submitted "
                         "from, at the same path.")
    env: list[str] = field(factory=list, doc="Names of variables whose values on the submitting side are passed "
                           "into the image over the image's own (pyxis `--container-env`, apptainer `--env`).")
    writable: bool = field(False, doc="Let tasks write to the image's own file system (pyxis "
                           "`--container-writable`, apptainer `--writable-tmpfs`; not oci, whose image all runs share); the "
                           "mounted folders are writable either way.")
    mount_home: bool = field(False, doc="Mount the user's home folder (off by default: a home's Python "
                             "packages would shadow the image's).")
    oci_launch: str = field("scheduler", doc="runtime `oci` only: `scheduler` hands the bundle to the scheduler's own "
                            "OCI support (one task per node on Slurm 22.05); `runc`: each task runs the bundle with "
                            "`runc run` itself (any tasks per node).", choices=("scheduler", "runc"))
    python: str = field("python3", doc="The interpreter inside the image: a name on the image's PATH or an "
                        "absolute path.", max_len=256)
    flags: list[str] = field(factory=list, doc="More options for the runtime, as written (pyxis: on the step "
                             "line; apptainer: after `exec`), each starting with `-`.")
    shm_gb: int = field(0, doc="GiB of /dev/shm inside (NCCL and DataLoader workers need a large one). oci: a "
                        "tmpfs of that size in each task's container; pyxis and apptainer: the node's own /dev/shm "
                        "is bound in, and the first task on each node refuses one smaller than this. 0: the "
                        "node's /dev/shm bound in, unchecked.", minimum=0, maximum=65536)
    infiniband: bool = field(False, doc="Bring the node's /dev/infiniband (the RDMA devices NCCL's IB transport "
                             "opens) into the container: bound in for pyxis and apptainer, each device node "
                             "added for oci.")
    cdi: list[str] = field(factory=list, doc="runtime `oci`: CDI devices to add from the node's CDI specs "
                           "(/etc/cdi, /var/run/cdi; JSON, or YAML where the host Python has PyYAML), e.g. "
                           "`[\"nvidia.com/gpu=all\"]`: their device nodes, mounts, variables and hooks.", max_len=256)
    devices: list[str] = field(factory=list, doc="runtime `oci`: device nodes to add, absolute paths under /dev "
                               "(glob patterns, each of which must match on every node; resolved there at the task's "
                               "start). Empty on a GPU site without `cdi`: `/dev/nvidia*` (add `/dev/nvidia-caps/*` "
                               "for MIG).")
    gpu_libraries: list[str] = field(factory=list, doc="runtime `oci` without `cdi`: the node's driver libraries "
                                     "(absolute paths, glob patterns, e.g. `/usr/lib/x86_64-linux-gnu/libcuda.so*`), "
                                     "bound read-only at the same paths, their folders put first on the image's "
                                     "`LD_LIBRARY_PATH`.")

    @property
    def enabled(self) -> bool:
        return self.runtime != "none"


@dataclass
class JobContainer:
    """A job spec's ``[container]``: what this job changes of its site's (empty: the site's value)."""

    runtime: str = field("", doc="One of the site's `container.runtimes` (`none` runs this job without a "
                         "container); empty: the site's `runtime`. On a site whose scheduler runs no container (`local`) "
                         "any key of this table is refused.", choices=("", *RUNTIMES))
    image: str = field("", doc="Another image for the same runtime; empty: the site's.", max_len=4096)
    mounts: list[str] = field(factory=list, doc="Mounts added to the site's, `SRC[:DST[:ro|rw]]`.")
    env: list[str] = field(factory=list, doc="Variable names passed into the image, added to the site's.")
    workdir: str = field("", doc="Working folder inside; empty: the site's, else the submit folder.")
    python: str = field("", doc="The interpreter inside the image; empty: the site's.", max_len=256)


def for_job(site: Container, job: JobContainer | None) -> Container:
    """The site's container with the job's changes (``problems`` checks the result)."""
    if job is None:
        return site
    return dataclasses.replace(site, runtime=job.runtime or site.runtime, image=job.image or site.image,
                               mounts=[*site.mounts, *job.mounts], env=[*site.env, *job.env],
                               workdir=job.workdir or site.workdir, python=job.python or site.python,
                               runtimes=site.runtimes or [site.runtime])


def job_problems(site: Container, job: JobContainer, prefix: str = "container", gpus: int = 0,
                 kind: str = "") -> list[str]:
    """A job's ``[container]`` against its site's: a runtime the site declares and its scheduler ``kind``
    runs, valid values once merged."""
    if job == JobContainer():
        return []
    if kind and not schedulers.container_runtimes(kind) and not job.runtime:  # nothing it could change
        key = next(f.name for f in dataclasses.fields(job) if getattr(job, f.name) != getattr(JobContainer(), f.name))
        return [f"`{prefix}.{key}` is set, but {runs_none(kind)}: remove the job's [container] table, or submit "
                "it to a site whose scheduler runs containers"]
    return problems(for_job(site, job), prefix, gpus, kind)


def runs_none(kind: str) -> str:
    return f"a {kind!r} site runs no container (its scheduler kind has no container runtime)"


def kind_problem(c: Container, prefix: str, kind: str) -> str | None:
    """A runtime the site's scheduler ``kind`` cannot run (``Scheduler.container_runtimes``), in one line."""
    can = schedulers.container_runtimes(kind)
    asked = [("runtime", c.runtime)] + [("runtimes", r) for r in c.runtimes]
    key, name = next(((k, r) for k, r in asked if r in RUNTIMES and r != "none" and r not in can), ("", ""))
    if not key:
        return None
    shown = f"`{prefix}.runtime` = {name!r}" if key == "runtime" else f"`{prefix}.runtimes` names {name!r}"
    if not can:
        return f"{shown}, but {runs_none(kind)}: remove the [container] table, or use a site whose scheduler runs it"
    return f"{shown}, but a {kind!r} site runs only {', '.join(map(repr, can))}"


def problems(c: Container, prefix: str = "container", gpus: int = 0, kind: str = "") -> list[str]:
    """Every problem with a ``[container]`` section (``prefix``: the name messages give it; ``gpus``: the
    site's GPUs per node, which the runtime must bring in; ``kind``: the site's scheduler kind, whose
    runtimes it may name; a runtime it cannot run is the one line)."""
    refused = kind_problem(c, prefix, kind) if kind else None
    if refused:
        return [refused]
    out: list[str] = []
    declared = c.runtimes or [c.runtime]
    out += [f"`{prefix}.runtimes` names {r!r}: expected some of {', '.join(map(repr, RUNTIMES))}"
            for r in c.runtimes if r not in RUNTIMES]
    if c.runtime not in declared:
        out.append(f"`{prefix}.runtime` = {c.runtime!r} is not among the site's `container.runtimes` "
                   f"({', '.join(declared)})")
    if not c.enabled:
        return out
    out += image_problems(c.runtime, c.image, f"{prefix}.image")
    for i, mount in enumerate(c.mounts):
        out += mount_problems(mount, f"{prefix}.mounts[{i}]")
    if c.workdir and (not os.path.isabs(c.workdir) or "," in c.workdir or ":" in c.workdir):
        out.append(f"`{prefix}.workdir` = {c.workdir!r}: expected an absolute path without `,` or `:`")
    out += [f"`{prefix}.env` names {name!r}: expected a variable name (letters, digits, `_`)"
            for name in c.env if not ENV_NAME.match(name)]
    if not c.python or any(ch.isspace() for ch in c.python) or (os.sep in c.python and not os.path.isabs(c.python)):
        out.append(f"`{prefix}.python` = {c.python!r}: expected a command name or an absolute path, no spaces")
    out += [f"`{prefix}.flags` has {flag!r}: expected options, each starting with `-`"
            for flag in c.flags if not flag.startswith("-")]
    out += [f"`{prefix}.flags` has {flag!r}: hpcx trains on NVIDIA GPUs (CUDA, NCCL); apptainer gets `--nv` "
            "on a GPU site" for flag in c.flags if flag.split("=")[0] == "--rocm"]
    return out + runtime_of(c.runtime).problems(c, prefix, gpus)


def runtime_of(name: str) -> schedulers.ContainerRuntime:
    """The runtime a ``[container] runtime`` names, from the scheduler kinds' table (``RUNTIMES`` lists them)."""
    found = schedulers.container_runtime(name)
    if found is None:  # a name in RUNTIMES that no kind registers: a programming error
        raise LookupError(f"no scheduler kind registers container runtime {name!r}")
    return found


CDI_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]*/[a-zA-Z0-9][a-zA-Z0-9_.-]*=[a-zA-Z0-9_][a-zA-Z0-9_.:-]*$")
NODE_DEVICES = ("devices", "gpu_libraries", "cdi")  # resolved on each node at the task's start (oci, runc)
GPU_DEVICES = ["/dev/nvidia*"]  # `devices` on a GPU site without `cdi` (MIG's /dev/nvidia-caps/*: list it)


def node_devices(c: Container, gpus: int) -> list[str]:
    """The device patterns a task's container gets on its node: `devices`, else the NVIDIA ones on a GPU site
    without CDI; /dev/infiniband's with `infiniband`."""
    found = list(c.devices) or (list(GPU_DEVICES) if gpus and not c.cdi else [])
    return found + (["/dev/infiniband/*"] if c.infiniband else [])


def derived_problems(runtime: str, named: tp.Sequence[tuple[str, str]]) -> list[str]:
    """Each path hpcx derives itself (``named``: (what it is, path)) that the runtime's mount list would
    read as another mount or option: one line naming it."""
    out = []
    for what, path in named:
        bad = next((ch for ch in path if ch in runtime_of(runtime).list_syntax), None)
        if bad is None:
            continue
        shown = char_label(bad) if bad == "\n" else f"`{bad}`"
        out.append(f"{what} {path!r} holds {shown}, which runtime "
                   f"{runtime!r} would read as the start of another mount or option: use a folder without "
                   f"`,`, `:` or a newline")
    return out


def image_problems(runtime: str, image: str, where: str, look: bool = False) -> list[str]:
    """The image: absolute, the right kind for the runtime; with ``look`` (at submit, on the login node), also
    present. A profile loads without looking: `hpcx render` and `hpcx site list` work where the image is not."""
    if not image:
        return [f"`{where}` is empty: expected the image for runtime {runtime!r}"]
    rt = runtime_of(runtime)
    named = rt.enroot_names and not image.startswith((os.sep, "."))
    if image.startswith(IMAGE_URIS) or (named and "#" in image):
        if not rt.takes_uris:
            return [f"`{where}` = {image!r}: runtime {runtime!r} takes the absolute path of an OCI bundle folder"]
        return [f"`{where}` = {image!r}: expected no `,`"] if "," in image else []
    if named and not image.endswith(".sqsh"):
        return [f"`{where}` = {image!r}: expected no `,`"] if "," in image else []  # a registry name, e.g. ubuntu:24.04
    if not os.path.isabs(image):
        return [f"`{where}` = {image!r}: expected an absolute path (the nodes resolve it from their own folder)"]
    if "," in image or ":" in image:
        return [f"`{where}` = {image!r}: expected a path without `,` or `:` (the runtime would split it)"]
    if not look:
        return []
    path = Path(image)
    if rt.image_folder:
        if not (path / "config.json").is_file():
            return [f"`{where}` = {image!r}: no OCI bundle there (expected a folder with config.json)"]
    elif not path.is_file():
        return [f"`{where}` = {image!r}: no such file"]
    return []


def mount_problems(mount: str, where: str) -> list[str]:
    """``SRC[:DST[:ro|rw]]``: absolute paths, nothing the runtimes would read as another mount or option."""
    parts = mount.split(":")
    if "," in mount or len(parts) > 3 or not all(parts[:2]):
        return [f"`{where}` = {mount!r}: expected `SRC[:DST[:ro|rw]]` (no `,`; at most two `:`)"]
    if not all(os.path.isabs(p) for p in parts[:2]):
        return [f"`{where}` = {mount!r}: expected absolute paths"]
    if len(parts) == 3 and parts[2] not in MOUNT_OPTIONS:
        return [f"`{where}` = {mount!r}: expected `ro` or `rw` after the second `:`, not {parts[2]!r}"]
    return []


def image_source(spec: tp.Any, site: tp.Any) -> str:
    """The file that named the job's image: the spec when its own `[container]` gives one, else the site's."""
    job = getattr(spec, "container", None)
    return spec.source if job is not None and job.image else site.source


def submit_problems(c: Container, source: str) -> list[str]:
    """At submit, on the login node: the image is there (an image given by URI is the runtime's to pull)."""
    found = image_problems(c.runtime, c.image, "container.image", look=True) if c.enabled else []
    return [f"{source}: {p}" for p in found]


# ---------------------------------------------------------------- what a step brings into the image


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    readonly: bool

    def text(self) -> str:
        """``SRC:DST[:ro]``, as pyxis and apptainer take it."""
        return f"{self.source}:{self.target}" + (":ro" if self.readonly else "")


def parse_mount(mount: str) -> Mount:
    parts = mount.split(":")
    return Mount(parts[0], parts[1] if len(parts) > 1 else parts[0], len(parts) > 2 and parts[2] == "ro")


def overlay_links() -> dict[str, str]:
    """{name in the overlay: host path}: hpcx's ``hpc`` and ``trainer``, and every pure-Python package
    among hpcx's dependencies (recursively; torch's own are the image's), as this Python imports them."""
    links = {name: _package_dir(name) for name in ("hpc", "trainer")}
    for dist in pure_dependencies():
        for top in _top_level(dist):
            spec = importlib.util.find_spec(top)
            if spec is None or spec.origin in (None, "built-in", "frozen"):
                continue
            origin = str(spec.origin)
            entry = os.path.dirname(origin) if origin.endswith("__init__.py") else origin
            links[os.path.basename(entry)] = entry
    return links


def _package_dir(name: str) -> str:
    return os.path.dirname(os.path.abspath(importlib.import_module(name).__file__ or ""))


# distributions the image provides, never brought in: torch and what comes with it
IMAGE_PROVIDES = ("torch", "numpy", "triton", "sympy", "networkx", "jinja2", "markupsafe", "filelock", "fsspec",
                  "mpmath", "setuptools")


def pure_dependencies() -> list[tp.Any]:
    """hpcx's dependency distributions (recursively) that have no compiled files, less what the image provides."""
    import importlib.metadata as md

    seen: dict[str, tp.Any] = {}
    todo = ["hpcx"]
    while todo:
        name = todo.pop()
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        for req in dist.requires or []:
            if "extra ==" in req:
                continue
            dep = re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
            if dep in seen or dep.replace("-", "_") in IMAGE_PROVIDES or dep in IMAGE_PROVIDES:
                continue
            try:
                seen[dep] = md.distribution(dep)
            except md.PackageNotFoundError:
                continue
            todo.append(dep)
    return [d for d in seen.values() if not any(str(f).endswith((".so", ".pyd")) for f in d.files or [])]


def _top_level(dist: tp.Any) -> list[str]:
    text = dist.read_text("top_level.txt")
    if text:
        return [line.strip() for line in text.splitlines() if line.strip()]
    tops = {str(f).split("/")[0].removesuffix(".py") for f in dist.files or []
            if not str(f).split("/")[0].endswith((".dist-info", ".data")) and not str(f).startswith("..")}
    return sorted(t for t in tops if t.isidentifier())


def write_overlay(run_dir: Path, links: tp.Mapping[str, str]) -> Path:
    """RUN/container/path with one link per entry of ``links``; returns it."""
    overlay = run_dir / OVERLAY
    overlay.mkdir(parents=True, exist_ok=True)
    for name, target in links.items():
        link = overlay / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    return overlay


def step_mounts(c: Container, run_root: str, workdir: str, links: tp.Mapping[str, str],
                reads: tp.Sequence[tuple[str, str]] = ()) -> list[Mount]:
    """What a task sees besides the image: the site's mounts, the run root (read-write) and the job's folder
    at the same paths, the folders the overlay's links point into and ``reads`` ((what, folder): the job's
    data, its init_from …) read-only, the home folder if asked, the node's /dev/infiniband and /dev/shm
    where the site asks (pyxis, apptainer; an OCI bundle has its own: ``oci``). UserError naming each derived
    path the runtime's mount list would split."""
    rw = [("the run root", run_root), ("the folder the job is submitted from", workdir)]
    into: dict[str, list[str]] = {}
    for name, p in sorted(links.items()):
        into.setdefault(os.path.dirname(p), []).append(name)
    ro = [(f"hpcx's install (the folder of its {', '.join(names)})", folder) for folder, names in into.items()]
    ro += list(reads)
    rw += [("the home folder (`container.mount_home`)", os.path.expanduser("~"))] if c.mount_home else []
    found = derived_problems(c.runtime, [*rw, *ro])
    if found:
        raise UserError(found)
    mounts = [parse_mount(m) for m in c.mounts] + [Mount(p, p, False) for _, p in rw]
    mounts += [Mount(p, p, True) for p in sorted({p for _, p in ro})]
    if runtime_of(c.runtime).binds_node_devices:
        mounts += [Mount(d, d, False) for d in (["/dev/infiniband"] if c.infiniband else []) +
                   (["/dev/shm"] if c.shm_gb else [])]
    return _outermost(mounts)


def job_reads(spec: tp.Any) -> list[tuple[str, str]]:
    """(what, folder) of each input a job reads from outside the run folder, mounted read-only: the
    folders of `data.source`, `data.val_source` and `checkpoint.init_from` (absolute once loaded)."""
    named = [("data.source", spec.data.source), ("data.val_source", spec.data.val_source),
             ("checkpoint.init_from", spec.checkpoint.init_from)]
    out = []
    for key, value in named:
        if not value or value in ("synthetic", "none") or not os.path.isabs(value):
            continue
        folder = value if os.path.isdir(value) else os.path.dirname(value)
        out.append((f"{spec.source}: the folder of `{key}`", folder))
    return out


def _outermost(mounts: list[Mount]) -> list[Mount]:
    """The mounts without repeats and without one inside another of the same kind already listed."""
    out: list[Mount] = []
    for m in mounts:
        if any(m.target == o.target or (m.target.startswith(o.target.rstrip("/") + "/") and m.source.startswith(
                o.source.rstrip("/") + "/") and m.readonly >= o.readonly) for o in out):
            continue
        out.append(m)
    return out


def identity(c: Container) -> dict[str, tp.Any]:
    """The runtime, the image, and what identifies the image where the login node sees it: an OCI bundle's
    resolved folder and the digest of its config.json (and its image.json's key, if it has one), an image
    file's size, modification time and inode; an image given by URI is only named."""
    out: dict[str, tp.Any] = {"runtime": c.runtime, "image": c.image}
    if not c.enabled or not os.path.isabs(c.image):
        return out
    path = Path(c.image)
    try:
        if path.is_dir():
            out["resolved"] = str(path.resolve())
            out["config_sha256"] = hashlib.sha256(image_file(path / "config.json", "config.json")).hexdigest()
            info = image_file(path / "image.json", "image.json")
            key = json.loads(info).get("key") if len(info) < 4096 else None
            if isinstance(key, str):
                out["key"] = key
        else:
            st = path.stat()
            out.update(size=st.st_size, mtime=int(st.st_mtime), inode=st.st_ino)
    except (OSError, ValueError, UserError):
        pass
    return out


IMAGE_CONFIG_MAX = 1 << 20  # an OCI runtime configuration is a few KB


def image_file(path: Path, label: str, limit: int = IMAGE_CONFIG_MAX) -> bytes:
    """The bytes of an image's small file: a regular one (no FIFO, no /dev/zero) of at most ``limit``
    bytes, else one line (a ConfigError whose ``label`` names it); b"" when it is absent."""
    if not os.path.lexists(path):
        return b""
    with open_regular(path, label, "a regular file") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ConfigError([f"{label}: larger than {limit >> 20} MiB: expected a file of a few KB"])
    return data


def read_image_config(image: str, where: str) -> dict[str, tp.Any]:
    """An OCI bundle's config.json, bounded in size and depth (``where``: the file and key that named the
    image, which every message starts with)."""
    label = f"{where} = {image!r}: its config.json"
    data = image_file(Path(image) / "config.json", label)
    if not data:
        raise ConfigError([f"{label}: no such file: expected an OCI bundle folder"])
    doc = load_json_bounded(data, label)
    if not isinstance(doc, dict):
        raise ConfigError([f"{label}: a JSON {type(doc).__name__}: expected an object (an OCI runtime configuration)"])
    return doc


# ---------------------------------------------------------------- inside the image, at a task's start


def inside_problem(env: tp.Mapping[str, str], gpus: bool) -> str | None:
    """Why this image cannot run hpcx's trainer, in one line naming the image; None when it can. Run by each
    task before anything imports torch (``hpc.core.imports.main``), only inside a container."""
    image = env.get(IMAGE_ENV)
    if not image:
        return None
    missing = [name for name in ("torch", "numpy") if importlib.util.find_spec(name) is None]
    if missing:
        return (f"the container image {image} has no {' and no '.join(missing)} for its Python "
                f"({sys.executable}): use an image with PyTorch (hpcx brings only its own code and pure-Python "
                f"packages)")
    version = torch_version()
    if release(version) < TORCH_FLOOR:
        return (f"the container image {image} has torch {version or '(no version)'}, below the "
                f"{'.'.join(map(str, TORCH_FLOOR))} hpcx's trainer needs (pyproject.toml's torch range): use an "
                f"image with torch {'.'.join(map(str, TORCH_FLOOR))} or newer (docs/containers.md names some)")
    if gpus:  # a CPU build of torch on a GPU site (its version says +cpu; CUDA builds ship their NCCL)
        if version.endswith("+cpu") or _version("nvidia-nccl-cu12") == "" and not _has_cuda_libs():
            return (f"the container image {image} has torch {version} without CUDA or NCCL on a GPU site: "
                    f"use a PyTorch-CUDA image")
    return shm_problem(image, env)


# The oldest torch hpcx's trainer runs on: the lower bound of pyproject.toml's `torch>=…` (a test keeps them
# equal). Only the release counts: NGC builds call theirs X.Y.0a0+COMMIT, cut from the X.Y release branch.
TORCH_FLOOR = (2, 6)
SHM_ENV = "HPCX_SHM_GB"  # set inside the step when the site sizes /dev/shm (`container.shm_gb`)


def release(version: str) -> tuple[int, ...]:
    """(2, 6, 0) of '2.6.0a0+ecf3bae', (2, 13, 0) of '2.13.0+cpu'; () of no version."""
    found = re.match(r"^(\d+(?:\.\d+)*)", version)
    return tuple(int(x) for x in found.group(1).split(".")) if found else ()


def shm_problem(image: str, env: tp.Mapping[str, str], shm: str = "/dev/shm") -> str | None:
    """A /dev/shm smaller than the site's `container.shm_gb` (the node's own, bound in by pyxis/apptainer)."""
    wanted = int(env.get(SHM_ENV) or 0)
    if not wanted:
        return None
    try:
        st = os.statvfs(shm)
    except OSError as exc:
        return f"the container image {image} has no {shm} ({exc.strerror}): the site asks for {wanted} GiB"
    size = st.f_blocks * st.f_frsize
    if size < wanted << 30:
        import platform  # lazy: startup

        return (f"the container image {image} has a {shm} of {size / 2**30:.2f} GiB on {platform.node()}, below "
                f"the site's `container.shm_gb` = {wanted}: ask the site for nodes with a larger one, or lower it")
    return None


def versions_line(env: tp.Mapping[str, str]) -> str:
    """What the image holds, without importing torch: Python, torch, its CUDA and NCCL (printed by the first
    task on each node, and by ``hpcx container check``)."""
    import platform  # lazy: startup

    cuda, nccl = _torch_file("cuda"), _nccl_version()
    return (f"image {env.get(IMAGE_ENV)} on {platform.node()}: python {platform.python_version()}, torch "
            f"{torch_version() or 'none'}, CUDA {cuda or 'none'}, NCCL {nccl or 'none'}")


def _torch_file(key: str) -> str:
    """A value of torch/version.py (``__version__``, ``cuda``: None in a CPU build), read as text."""
    spec = importlib.util.find_spec("torch")
    for folder in list(spec.submodule_search_locations or []) if spec else []:
        try:
            text = Path(folder, "version.py").read_text(errors="replace")[:10000]
        except OSError:
            continue
        found = re.search(rf"^{re.escape(key)}\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
        return found.group(1) if found else ""
    return ""


def torch_version() -> str:
    """torch's version: its distribution's, else torch/version.py's (a build without metadata)."""
    return _version("torch") or _torch_file("__version__")


def _nccl_version() -> str:
    """NCCL's version: the pip wheel's (nvidia-nccl-cu*), else the library file an NGC image ships."""
    for dist in ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11"):
        if _version(dist):
            return _version(dist)
    for lib in sorted(glob.glob("/usr/lib/*/libnccl.so.2.*") + glob.glob("/usr/local/lib/libnccl.so.2.*")):
        found = re.search(r"libnccl\.so\.(\d+\.\d+\.\d+)$", lib)
        if found:
            return found.group(1)
    return ""


def inside_record(env: tp.Mapping[str, str]) -> dict[str, tp.Any]:
    """For the ledger's start line: the image this start ran in, its Python and torch; {} outside one."""
    image = env.get(IMAGE_ENV)
    if not image:
        return {}
    import platform  # lazy: startup

    return {"container": {"image": image, "python": platform.python_version(), "torch": _version("torch")}}


def _version(dist: str) -> str:
    import importlib.metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return ""


def _has_cuda_libs() -> bool:
    """torch's own CUDA libraries (a CUDA wheel's ``torch/lib/libtorch_cuda.so``), found without importing it."""
    spec = importlib.util.find_spec("torch")
    folders = list(spec.submodule_search_locations or []) if spec else []
    return any(os.path.exists(os.path.join(f, "lib", "libtorch_cuda.so")) for f in folders)

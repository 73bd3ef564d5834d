"""Runtime ``oci``: the per-run bundle hpcx writes at submit, and each task's own configuration on its node.

Of the image's ``config.json`` hpcx takes only its root file system, its process environment and its user;
everything else is hpcx's own: the mounts (``base_mounts`` and the step's binds), one mount namespace, the
devices, no hooks. An image's own mounts could bind any host folder into the job, its namespaces would cut
the task off the node's network and processes (which Slurm, the requeue and NCCL rely on), and a prestart
hook would run on the host as whoever starts runc. The image's config.json is read bounded in size and
depth (``hpc.core.container.read_image_config``).

What differs between nodes is added on each node when its task starts (``oci_launch = "runc"``): the
device nodes the site names (GPUs, /dev/infiniband; ``linux.devices``, so runc makes them and lets the
task's device cgroup open them), the CDI devices of the node's CDI specs, and the driver libraries.
``python -m hpc.schedulers.slurm.oci RUN TASKDIR ID`` (the task script, on the host) writes
TASKDIR/config.json from RUN/container/bundle/{config,node}.json and ``exec``s runc on it.
"""

from __future__ import annotations

import glob
import json
import os
import stat
import subprocess
import sys
import typing as tp
from pathlib import Path

from hpc.core.config import load_json_bounded
from hpc.core.container import BUNDLE, ConfigError, Container, Mount, image_file, node_devices, read_image_config

RUNC = ["runc", "--root=/run/hpcx-runc"]
NODE = "node.json"  # beside the bundle's config.json: what each node adds (``node_plan``)
CDI_DIRS = ("/etc/cdi", "/var/run/cdi")  # where CDI specs live (the CDI specification's default folders)
CDI_MAX = 1 << 20
KEEP_IMAGE_ENV = ("PATH", "LD_LIBRARY_PATH", "PYTHONHOME")  # the image's, never the submitting shell's
# Inside the image: the task's environment and arguments from its folder, then exec (no hpcx import). The
# image's environment (``process.env``) is the base; the task's variables go over it, except the image's
# own search paths (as Apptainer does: a host PATH would find the host's programs' names, not the image's).
LOADER = ("import os, sys; d = sys.argv[1]; keep = {k.encode() for k in %r}; "
          "env = dict(e.split(b'=', 1) for e in open(d + '/environ', 'rb').read().split(bytes(1)) if b'=' in e); "
          "env = {**os.environb, **env, **{k: v for k, v in os.environb.items() if k in keep}}; "
          "args = open(d + '/argv', 'rb').read().split(bytes(1))[:-1]; os.execvpe(args[0], args, env)"
          ) % (KEEP_IMAGE_ENV,)


def loader_args(c: Container) -> list[str]:
    """``process.args`` of each runc task: the image's Python runs LOADER on the task's folder."""
    return [c.python, "-c", LOADER, "@TASKDIR@"]


def base_mounts(shm_gb: int) -> list[dict[str, tp.Any]]:
    """What every task's container has besides the step's binds: /proc, a /dev of its own, /sys read-only,
    a /tmp, and /dev/shm: a tmpfs of ``shm_gb`` GiB, else the node's own bound in."""
    shm: dict[str, tp.Any] = ({"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
                               "options": ["nosuid", "nodev", "mode=1777", f"size={shm_gb}g"]} if shm_gb else
                              {"destination": "/dev/shm", "type": "none", "source": "/dev/shm",
                               "options": ["rbind", "nosuid", "nodev"]})
    return [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
        shm,
        {"destination": "/sys", "type": "none", "source": "/sys", "options": ["rbind", "nosuid", "noexec", "nodev", "ro"]},
        {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=1777"]},
    ]


def image_parts(doc: dict[str, tp.Any], image: str, label: str) -> tuple[str, list[str], dict[str, tp.Any]]:
    """(root file system, process environment, user) of an image's configuration, each checked; the root
    must lie inside the bundle folder."""
    root = doc.get("root") or {}
    process = doc.get("process") or {}
    if not isinstance(root, dict) or not isinstance(process, dict):
        raise ConfigError([f"{label}: `root` and `process` must be objects"])
    path = root.get("path", "rootfs")
    if not isinstance(path, str) or not path:
        raise ConfigError([f"{label}: `root.path` = {path!r}: expected a path"])
    bundle = os.path.realpath(image)
    rootfs = os.path.realpath(os.path.join(image, path))  # runc refuses a root reached through a link
    if rootfs == bundle or not rootfs.startswith(bundle + os.sep):
        raise ConfigError([f"{label}: `root.path` = {path!r} is outside the bundle folder: expected its rootfs"])
    env = process.get("env", [])
    if not isinstance(env, list) or not all(isinstance(e, str) and "=" in e for e in env):
        raise ConfigError([f"{label}: `process.env`: expected a list of NAME=VALUE strings"])
    user = process.get("user", {"uid": 0, "gid": 0})
    ids = {k: user.get(k) for k in ("uid", "gid")} if isinstance(user, dict) else {}
    if not all(type(i) is int and 0 <= i < 2**32 for i in ids.values()) or len(ids) != 2:
        raise ConfigError([f"{label}: `process.user` = {user!r}: expected numeric uid and gid"])
    extra = user.get("additionalGids", [])
    if not isinstance(extra, list) or not all(type(g) is int and 0 <= g < 2**32 for g in extra):
        raise ConfigError([f"{label}: `process.user.additionalGids`: expected numeric group ids"])
    return rootfs, list(env), {**ids, **({"additionalGids": extra} if extra else {})}


def bundle_config(parts: tuple[str, list[str], dict[str, tp.Any]], mounts: list[Mount], workdir: str,
                  writable: bool, shm_gb: int = 0, args: list[str] | None = None) -> dict[str, tp.Any]:
    """The per-run OCI configuration: the image's root file system, environment and user; hpcx's mounts,
    namespace and working folder. (``args``: the task's, else slurmstepd sets them per task.)"""
    rootfs, env, user = parts
    # Slurm 22.05 takes BUNDLE/rootfs whatever root.path says: the per-run bundle has an empty rootfs/ and
    # the image's root file system is bound onto it first (runc mounts it before the others). The bind is
    # read-write so that runc can make the mount points of the mounts that follow (empty folders, as for any
    # bundle); `root.readonly` then remounts the whole root read-only before the task starts.
    whole = {"destination": "/", "type": "none", "source": rootfs, "options": ["rbind", "rw"]}
    binds = [{"destination": m.target, "type": "none", "source": m.source,
              "options": ["rbind", "nosuid", "nodev", "ro" if m.readonly else "rw"]} for m in mounts]
    process = {"terminal": False, "user": user, "args": args or ["true"], "env": env, "cwd": workdir,
               "noNewPrivileges": True}
    return {"ociVersion": "1.0.2", "process": process, "root": {"path": "rootfs", "readonly": not writable},
            "mounts": [whole, *base_mounts(shm_gb), *binds],
            "linux": {"namespaces": [{"type": "mount"}], "devices": [], "resources": {"devices": []}}}


def node_plan(c: Container, gpus: int, source: str) -> dict[str, tp.Any]:
    """What each node adds to a task's configuration (RUN/container/bundle/node.json)."""
    return {"devices": node_devices(c, gpus), "cdi": list(c.cdi), "gpu_libraries": list(c.gpu_libraries),
            "source": source}


def write_bundle(c: Container, bundle: Path, mounts: list[Mount], workdir: str, where: str = "container.image",
                 gpus: int = 0, source: str = "") -> Path:
    """RUN/container/bundle: config.json, node.json and the empty rootfs/ (``where``: the file and key that
    named the image, for messages about it)."""
    parts = image_parts(read_image_config(c.image, where), c.image, f"{where} = {c.image!r}: its config.json")
    (bundle / "rootfs").mkdir(parents=True, exist_ok=True)
    args = loader_args(c) if c.oci_launch == "runc" else None
    config = bundle_config(parts, mounts, c.workdir or workdir, c.writable, c.shm_gb, args)
    (bundle / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (bundle / NODE).write_text(json.dumps(node_plan(c, gpus, source), indent=2) + "\n")
    return bundle


# ---------------------------------------------------------------- on the node, at the task's start


class NodeError(Exception):
    """Something this node lacks that the site profile names: one line, the task exits 2."""


def add_device(config: dict[str, tp.Any], host: str, inside: str | None = None) -> bool:
    """``host``'s device node at ``inside`` (default: the same path) in the container; False if it is
    no device (a folder /dev/nvidia* matches, say)."""
    try:
        st = os.stat(host)
    except OSError:
        return False
    kind = "c" if stat.S_ISCHR(st.st_mode) else "b" if stat.S_ISBLK(st.st_mode) else None
    if kind is None:
        return False
    major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
    linux = config.setdefault("linux", {})
    linux.setdefault("devices", []).append({"path": inside or host, "type": kind, "major": major, "minor": minor,
                                            "fileMode": stat.S_IMODE(st.st_mode), "uid": st.st_uid, "gid": st.st_gid})
    linux.setdefault("resources", {}).setdefault("devices", []).append(
        {"allow": True, "type": kind, "major": major, "minor": minor, "access": "rwm"})
    return True


def add_devices(config: dict[str, tp.Any], patterns: list[str], source: str) -> None:
    for pattern in patterns:
        if not [path for path in sorted(glob.glob(pattern)) if add_device(config, path)]:
            raise NodeError(f"no device node matches {pattern!r} on {os.uname().nodename} (the container's "
                            f"devices, from {source or 'the site profile'})")


def add_libraries(config: dict[str, tp.Any], patterns: list[str], source: str) -> None:
    """Each match bound read-only at its own path, its folder first on the image's LD_LIBRARY_PATH."""
    folders: list[str] = []
    for pattern in patterns:
        found = sorted(glob.glob(pattern))
        if not found:
            raise NodeError(f"no file matches {pattern!r} on {os.uname().nodename} (`container.gpu_libraries` "
                            f"in {source or 'the site profile'})")
        for path in found:
            config["mounts"].append({"destination": path, "type": "none", "source": path,
                                     "options": ["rbind", "nosuid", "nodev", "ro"]})
            folders += [] if os.path.dirname(path) in folders else [os.path.dirname(path)]
    if folders:
        set_env(config, "LD_LIBRARY_PATH", ":".join(folders), prepend=True)


def set_env(config: dict[str, tp.Any], name: str, value: str, prepend: bool = False) -> None:
    env = config["process"].setdefault("env", [])
    old = next((e for e in env if e.startswith(name + "=")), None)
    if old is not None:
        env.remove(old)
        if prepend and old.split("=", 1)[1]:
            value = f"{value}:{old.split('=', 1)[1]}"
    env.append(f"{name}={value}")


def cdi_specs(folders: tp.Sequence[str] | None = None) -> list[tuple[str, dict[str, tp.Any]]]:
    """(file, spec) of each CDI spec in ``folders`` (default ``CDI_DIRS``): JSON, or YAML where PyYAML is
    installed; each bounded in size and depth."""
    out = []
    for folder in CDI_DIRS if folders is None else folders:
        for path in sorted(glob.glob(os.path.join(folder, "*"))):
            if not path.endswith((".json", ".yaml", ".yml")):
                continue
            try:
                data = image_file(Path(path), f"CDI spec {path}", CDI_MAX)
                doc = (load_json_bounded(data, f"CDI spec {path}") if path.endswith(".json") else _yaml(data, path))
            except ConfigError as exc:
                raise NodeError(exc.messages[0]) from None
            if isinstance(doc, dict):
                out.append((path, doc))
    return out


def _yaml(data: bytes, path: str) -> tp.Any:
    try:
        import yaml  # type: ignore[import-untyped]  # lazy: startup
    except ImportError:
        raise NodeError(f"CDI spec {path} is YAML and the host Python has no PyYAML: write it as JSON "
                        "(`nvidia-ctk cdi generate --format=json`)") from None
    try:
        return yaml.safe_load(data)
    except (yaml.YAMLError, RecursionError) as exc:
        raise NodeError(f"CDI spec {path}: not valid YAML: {str(exc).splitlines()[0][:200]}") from None


def add_cdi(config: dict[str, tp.Any], name: str, specs: list[tuple[str, dict[str, tp.Any]]], source: str) -> None:
    """CDI device ``name`` (``VENDOR/CLASS=DEVICE``): its spec's common edits and the device's own."""
    kind, device = name.split("=", 1)
    for path, spec in specs:
        if spec.get("kind") != kind:
            continue
        for entry in spec.get("devices") or []:
            if isinstance(entry, dict) and entry.get("name") == device:
                for edits in (spec.get("containerEdits"), entry.get("containerEdits")):
                    apply_edits(config, edits or {}, path)
                return
    raise NodeError(f"CDI device {name!r} is in no CDI spec on {os.uname().nodename} ({', '.join(CDI_DIRS)}; "
                    f"`container.cdi` in {source or 'the site profile'})")


def apply_edits(config: dict[str, tp.Any], edits: dict[str, tp.Any], path: str) -> None:
    """A CDI spec's ``containerEdits``: variables, device nodes, mounts and hooks (the site's own spec)."""
    try:
        for item in edits.get("env") or []:
            name, _, value = str(item).partition("=")
            set_env(config, name, value)
        for node in edits.get("deviceNodes") or []:
            if not add_device(config, node.get("hostPath") or node["path"], node["path"]):
                raise NodeError(f"CDI spec {path}: device node {node.get('hostPath') or node['path']!r} is no "
                                f"device on {os.uname().nodename}")
        for m in edits.get("mounts") or []:
            config["mounts"].append({"destination": m["containerPath"], "type": m.get("type", "none"),
                                     "source": m["hostPath"], "options": list(m.get("options") or ["rbind", "ro"])})
        for hook in edits.get("hooks") or []:
            entry = {k: hook[k] for k in ("path", "args", "env", "timeout") if k in hook}
            config.setdefault("hooks", {}).setdefault(hook["hookName"], []).append(entry)
    except (KeyError, TypeError, AttributeError) as exc:
        raise NodeError(f"CDI spec {path}: a containerEdits entry lacks {exc}") from None


def task_config(run: Path, taskdir: Path) -> dict[str, tp.Any]:
    """The bundle's configuration with this task's folder and this node's devices, CDI edits and libraries."""
    config = json.loads((run / BUNDLE / "config.json").read_text())
    plan = json.loads((run / BUNDLE / NODE).read_text())
    config["process"]["args"] = [str(taskdir) if a == "@TASKDIR@" else a for a in config["process"]["args"]]
    add_devices(config, plan["devices"], plan["source"])
    specs = cdi_specs() if plan["cdi"] else []
    for name in plan["cdi"]:
        add_cdi(config, name, specs, plan["source"])
    add_libraries(config, plan["gpu_libraries"], plan["source"])
    return config


def main(argv: list[str]) -> None:
    """RUN TASKDIR ID: write TASKDIR/config.json, then become ``runc run`` (which forwards signals)."""
    run, taskdir, name = Path(argv[0]), Path(argv[1]), argv[2]
    try:
        config = task_config(run, taskdir)
    except NodeError as exc:
        print(f"hpcx: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    (taskdir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    subprocess.run([*RUNC, "delete", "--force", name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.execvp(RUNC[0], [*RUNC, "run", "--bundle", str(taskdir), name])


if __name__ == "__main__":
    main(sys.argv[1:])

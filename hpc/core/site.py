"""Site profiles: what one cluster looks like to hpcx.

A profile is found by name on the search path, or given as a path. Selection order:
``--site``, then ``$HPCX_SITE``, then ``job.site`` in the spec, then ``local``.

Search path for names, first match wins (``hpcx site list`` shows where each came from):
``$HPCX_SITE_PATH`` (folders separated by ``:``), ``~/.config/hpcx/sites``, ``/etc/hpcx/sites``,
then the bundled profiles (the repository's ``site/`` folder, shipped in wheels as ``hpc/_sites``).
"""

from __future__ import annotations

import os
import typing as tp
from dataclasses import asdict, dataclass
from pathlib import Path

from hpc import schedulers
from hpc.core import validate as v
from hpc.core.config import ConfigError, build_document, check_table, field, read_toml, suggest

DEFAULT_SITE = "local"
USER_SITES = "~/.config/hpcx/sites"
SYSTEM_SITES = "/etc/hpcx/sites"


@dataclass
class Scheduler:
    kind: str = field("local", doc="`slurm` submits through sbatch; `local` runs on this machine "
                      "with submitit's local executor (no Slurm).", choices=tuple(schedulers.KINDS))
    partition: str | None = field(None, doc="Default Slurm partition (`--partition`); a spec may override.")
    account: str | None = field(None, doc="Default Slurm account (`--account`).")
    qos: str | None = field(None, doc="Default Slurm QOS (`--qos`).")
    gpu_directive: str = field("gpus-per-node", doc="How this Slurm takes GPUs: `gpus-per-node` "
                               "(`--gpus-per-node=N`), `gres` (`--gres=gpu:N`), or `none` on CPU clusters.",
                               choices=("gpus-per-node", "gres", "none"))
    signal_lead_s: int = field(120, doc="Seconds before the time limit at which Slurm sends USR2 "
                               "(`--signal=USR2@LEAD`); must exceed the expected checkpoint save time.",
                               minimum=1, maximum=schedulers.LIMITS["signal_lead_s"])
    max_nodes: int = field(0, doc="Largest job this site can run, in nodes (0: unknown).", minimum=0)
    sbatch: dict[str, str | int | bool] = field(
        doc="Extra sbatch options for every job, e.g. {constraint = \"h100\", exclusive = true}: long option "
        "names without the dashes; a string or integer value, `true` for an option without a value, `false` "
        "to leave it out. Options hpcx sets itself (job-name, nodes, ntasks-per-node, cpus-per-task, time, "
        "signal, requeue, partition, account, qos, gpus-per-node, gres …), options that would move its "
        "logs, environment or user (output, error, open-mode, export, uid …) and abbreviations of them are "
        "refused. Values reach the `#SBATCH` line exactly (sbatch's reading of quotes and backslashes is "
        "accounted for).", factory=dict)


@dataclass
class Node:
    gpus: int = field(0, doc="GPUs per node; 0 for a CPU-only site (gloo backend).", minimum=0,
                      maximum=schedulers.LIMITS["gpus"])
    gpu_model: str = field("", doc="GPU model name, e.g. `NVIDIA H100 80GB HBM3`.")
    gpu_memory_gb: float = field(0.0, doc="Memory per GPU in GB (1e9 bytes).", minimum=0)
    gpu_peak_tflops: float = field(0.0, doc="Dense bf16 peak per GPU in TFLOP/s, for MFU (0: unknown).",
                                   minimum=0)
    cpus: int = field(1, doc="CPU cores per node.", minimum=1, maximum=schedulers.LIMITS["cpus"])
    memory_gb: float = field(0.0, doc="Host memory per node in GB (0: unknown).", minimum=0)
    tasks: int = field(0, doc="Tasks per node on CPU sites (0: one per GPU, or 1 without GPUs).", minimum=0,
                       maximum=schedulers.LIMITS["tasks"])
    intra_link: str = field("none", doc="Link between the GPUs of a node.",
                            choices=("nvswitch", "nvlink", "pcie", "none"))
    intra_bandwidth_gbs: float = field(0.0, doc="Per-GPU bus bandwidth inside a node, GB/s.", minimum=0)
    intra_latency_us: float = field(5.0, doc="Latency of one intra-node collective step, microseconds.",
                                    minimum=0)


@dataclass
class Network:
    fabric: str = field("none", doc="Fabric between nodes.",
                        choices=("infiniband", "roce", "efa", "ethernet", "none"))
    bandwidth_gbs: float = field(0.0, doc="Per-node injection bandwidth between nodes, GB/s.", minimum=0)
    latency_us: float = field(10.0, doc="Latency of one inter-node collective step, microseconds.",
                              minimum=0)


@dataclass
class Storage:
    run_root: str = field("~/hpcx-runs", doc="Where run folders are created; must be on a file system "
                          "every node sees. Absolute, or starting with `~` or `$VAR` (expanded when used; an "
                          "unset variable is an error); no `%` or `\\`, which Slurm would read in log file "
                          "names.", max_len=v.PATH_MAX)
    group_readable: bool = field(False, doc="Create run folders 0750/files 0640 instead of 0700/0600.")


@dataclass
class SiteProfile:
    name: str
    scheduler: Scheduler
    node: Node
    network: Network
    storage: Storage
    nccl: dict[str, str]
    source: str = ""

    @property
    def multi_node(self) -> bool:
        """Whether this site's scheduler can run one job across several nodes."""
        return schedulers.get(self.scheduler.kind).multi_node

    @property
    def backend(self) -> str:
        return "nccl" if self.node.gpus > 0 else "gloo"

    def default_tasks_per_node(self) -> int:
        return self.node.gpus or self.node.tasks or 1

    def run_root(self) -> Path:
        """``storage.run_root`` expanded; ConfigError when a variable in it is unset."""
        where = f"{self.source}: `storage.run_root` = {self.storage.run_root!r}"
        return v.expand_run_root(self.storage.run_root, where)


SECTIONS = {"scheduler": Scheduler, "node": Node, "network": Network, "storage": Storage}


def bundled_dir() -> Path:
    """The profiles shipped with hpcx: ``hpc/_sites`` in an installed wheel, else ``site/`` of the checkout."""
    here = Path(__file__).resolve().parents[1]  # hpc/
    installed = here / "_sites"
    return installed if installed.is_dir() else here.parent / "site"


def search_path() -> list[tuple[Path, str]]:
    """(folder, origin) in lookup order; the first profile of a name wins."""
    folders = [(Path(p).expanduser(), "$HPCX_SITE_PATH")
               for p in os.environ.get("HPCX_SITE_PATH", "").split(os.pathsep) if p]
    folders += [(Path(USER_SITES).expanduser(), "user"), (Path(SYSTEM_SITES), "system"), (bundled_dir(), "bundled")]
    return folders


def find_sites() -> dict[str, tuple[Path, str]]:
    """Every profile name on the search path -> (file, origin), sorted by name; earlier folders shadow later ones."""
    found: dict[str, tuple[Path, str]] = {}
    for folder, origin in search_path():
        for path in sorted(folder.glob("*.toml")) if folder.is_dir() else []:
            found.setdefault(path.stem, (path, origin))
    return dict(sorted(found.items()))


def list_sites() -> list[str]:
    return list(find_sites())


def site_path(name_or_path: str) -> Path:
    """A site name on the search path (``sandbox``) or a path to a profile file."""
    candidate = Path(name_or_path)
    if candidate.suffix == ".toml" or os.sep in name_or_path:
        return candidate
    sites = find_sites()
    if name_or_path not in sites:
        where = ", ".join(str(folder) for folder, _ in search_path())
        raise ConfigError([f"--site {name_or_path!r}: no such site profile ({suggest(name_or_path, sites)}); "
                           f"searched {where}"])
    return sites[name_or_path][0]


def parse_site(doc: dict, name: str, source: str) -> SiteProfile:
    """Build a SiteProfile from a parsed document, raising ConfigError with every problem."""
    errors: list[str] = []
    doc = dict(doc)
    nccl = doc.pop("nccl", {})
    errors += check_table("nccl", nccl, dict[str, str]) or v.check_nccl(nccl)
    sections = build_document(SECTIONS, doc, errors)
    # fields that failed their type checks were left at their defaults: these see only good values
    errors += schedulers.section_problems(sections["scheduler"])
    errors += v.check_run_root("storage.run_root", sections["storage"].run_root)
    site = SiteProfile(name=name, nccl=nccl if not errors else {}, source=source, **sections)
    if not errors:  # cross-checks only make sense on well-typed fields
        errors += cross_check_site(site)
    if errors:
        raise ConfigError([f"{source}: {e}" for e in errors])
    return site


def cross_check_site(site: SiteProfile) -> list[str]:
    errors = schedulers.site_problems(site)  # its kind's own (Slurm: the GPU directive)
    if site.node.gpus and not site.node.gpu_memory_gb:
        errors.append(f"`node.gpu_memory_gb` is unset but `node.gpus` = {site.node.gpus}: expected the memory per GPU")
    if site.node.gpus > 1 and site.node.intra_link == "none":
        errors.append(f"`node.intra_link` = 'none' with {site.node.gpus} GPUs per node: expected nvswitch, nvlink or pcie")
    return errors


def load_site(name_or_path: str) -> SiteProfile:
    path = site_path(name_or_path)
    if v.first_unprintable(path.stem) is not None:  # the name is shown by render, status and site list
        raise ConfigError([f"{v.shown(str(path))}: expected a profile name of printable characters"])
    return parse_site(read_toml(path), path.stem, str(path))


def raw_run_root(path: Path) -> Path | None:
    """``storage.run_root`` of a profile that does not load as a whole, if that one value can be read."""
    try:
        value = read_toml(path).get("storage", {}).get("run_root")
    except (ConfigError, AttributeError):
        return None
    if not isinstance(value, str) or v.check_run_root("storage.run_root", value):
        return None
    try:
        return v.expand_run_root(value, str(path))
    except ConfigError:
        return None


def choose_site(cli: str | None, spec_site: str | None) -> str:
    """--site, then $HPCX_SITE, then the spec's job.site, then `local`."""
    return cli or os.environ.get("HPCX_SITE") or spec_site or DEFAULT_SITE


def site_as_dict(site: SiteProfile) -> dict[str, tp.Any]:
    return asdict(site)

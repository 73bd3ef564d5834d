"""Site profiles: what one cluster looks like to hpcx.

A profile is found by name on the search path, or given as a path. Selection order:
``--site``, then ``$HPCX_SITE``, then ``job.site`` in the spec, then ``local``.

Search path for names, first match wins (``hpcx site list`` shows where each came from):
``$HPCX_SITE_PATH`` (folders separated by ``:``), ``~/.config/hpcx/sites``, ``/etc/hpcx/sites``,
then the bundled profiles (the repository's ``site/`` folder, shipped in wheels as ``hpc/_sites``).
"""

from __future__ import annotations

import dataclasses
import os
import typing as tp
from dataclasses import asdict, dataclass
from pathlib import Path

from hpc import schedulers
from hpc.core import runroot, validate as v
from hpc.core.container import Container, JobContainer, for_job, job_problems, problems as container_problems
from hpc.core.config import (ConfigError, build_document, check_table, field, read_toml, suggest, type_hints,
                             untouched)

from hpc.core.sitepath import find_sites, search_path  # noqa: F401 - find_sites: hpc.cli and others ask it here

DEFAULT_SITE = "local"


@dataclass
class CommonScheduler:
    """A site's ``[scheduler]`` section: these fields, which every kind has, then each kind's own
    (``hpc/schedulers/<kind>/section.py``, joined by ``hpc.schedulers.section_class``)."""

    kind: str = field("local", doc="`slurm` submits through sbatch; `local` runs on this machine "
                      "with submitit's local executor (no Slurm).", choices=tuple(schedulers.KINDS))
    signal_lead_s: int = field(120, doc="Seconds before the time limit at which the scheduler sends USR2 "
                               "(Slurm: `--signal=USR2@LEAD`); must exceed the expected checkpoint save time.",
                               minimum=1, maximum=schedulers.LIMITS["signal_lead_s"])
    max_nodes: int = field(0, doc="Largest job this site can run, in nodes (0: unknown).", minimum=0)


if tp.TYPE_CHECKING:  # the class is built at import time: mypy sees the common fields, each kind's as Any
    class Scheduler(CommonScheduler):
        def __getattr__(self, name: str) -> tp.Any: ...
else:
    Scheduler = schedulers.section_class(CommonScheduler)


@dataclass
class Node:
    gpus: int = field(0, doc="GPUs per node; 0 for a CPU-only site (gloo backend), which then has no GPU "
                      "fields (model, memory, peak, an intra-node link).", minimum=0,
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
    nvlink_domain: int = field(0, doc="GPUs per NVLink island: consecutive GPUs joined by NVLink (e.g. 2 on 4× H100 NVL, "
                               "bridged in pairs over PCIe). 0: the whole node where `intra_link` is nvswitch or "
                               "nvlink, 1 on pcie. Must divide `gpus`. A tensor-parallel group stays inside one "
                               "(`parallel.tp_cross_domain` allows more, at `intra_link`'s speed).", minimum=0,
                               maximum=schedulers.LIMITS["gpus"])
    nvlink_bandwidth_gbs: float = field(0.0, doc="Per-GPU bus bandwidth inside one NVLink island, GB/s (0: "
                                        "`intra_bandwidth_gbs`); needed where the islands are smaller than the node "
                                        "(`intra_link` then is the slower link between them).", minimum=0)
    intra_latency_us: float = field(5.0, doc="Latency of one intra-node ring step (NCCL's Simple protocol), "
                                    "microseconds; NCCL's own figures are 3.4 for NVLink and 5.7 for PCIe.",
                                    minimum=0)
    mfu: float = field(0.0, doc="Model FLOPs utilisation a training step reaches here (fraction of "
                       "`gpu_peak_tflops`), for the planner's compute time; 0: unknown, the planner assumes 0.40. "
                       "`hpcx scale report STUDY --site-draft FILE` writes a measured one.", minimum=0, maximum=1)
    mfu_source: str = field("", doc="Where `mfu` came from (a scale study, a GPU check, a paper), printed "
                            "beside the planner's compute time.", max_len=256)


@dataclass
class Network:
    fabric: str = field("none", doc="Fabric between nodes.",
                        choices=("infiniband", "roce", "efa", "ethernet", "none"))
    bandwidth_gbs: float = field(0.0, doc="Per-node injection bandwidth between nodes, GB/s.", minimum=0)
    latency_us: float = field(10.0, doc="Latency of one inter-node ring step (NCCL's Simple protocol), "
                              "microseconds; NCCL's own figure for InfiniBand is 14.", minimum=0)


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
    container: Container = dataclasses.field(default_factory=Container)

    @property
    def multi_node(self) -> bool:
        """Whether this site's scheduler can run one job across several nodes."""
        return schedulers.get(self.scheduler.kind).multi_node

    @property
    def allocates_cpus(self) -> bool:
        """Whether this site's scheduler gives each task CPUs of its own (``Scheduler.cpus_allocated``;
        Slurm does, unless `overcommit` is among its sbatch options): then a node runs at most ``node.cpus`` tasks."""
        return schedulers.get(self.scheduler.kind).cpus_allocated(self.scheduler)

    @property
    def backend(self) -> str:
        return "nccl" if self.node.gpus > 0 else "gloo"

    def default_tasks_per_node(self) -> int:
        return self.node.gpus or self.node.tasks or 1

    def run_root(self) -> Path:
        """``storage.run_root`` expanded; ConfigError when a variable in it is unset."""
        where = f"{self.source}: `storage.run_root` = {self.storage.run_root!r}"
        return runroot.expand_run_root(self.storage.run_root, where)


SECTIONS = {"scheduler": Scheduler, "node": Node, "network": Network, "storage": Storage, "container": Container}


def list_sites() -> list[str]:
    return list(find_sites())


def site_path(name_or_path: str, label: str | None = None) -> Path:
    """A site name on the search path (``sandbox``) or a path to a profile file. ``label`` says where the
    name came from in a message (default ``--site 'NAME'``)."""
    label = label or f"--site {name_or_path!r}"
    if not name_or_path.strip():
        raise ConfigError([f"{label}: expected a site name (`hpcx site list`) or a path to a profile"])
    candidate = Path(name_or_path)
    if candidate.suffix == ".toml" or os.sep in name_or_path:
        return candidate
    sites = find_sites()
    if name_or_path not in sites:
        where = ", ".join(str(folder) for folder, _ in search_path())
        raise ConfigError([f"{label}: no such site profile ({suggest(name_or_path, sites)}); searched {where}"])
    return sites[name_or_path][0]


def parse_site(doc: dict, name: str, source: str) -> SiteProfile:
    """Build a SiteProfile from a parsed document, raising ConfigError with every problem."""
    errors: list[str] = []
    doc = dict(doc)
    nccl = doc.pop("nccl", {})
    errors += check_table("nccl", nccl, dict[str, str])
    errors += v.check_nccl(_printable_keys(nccl))
    sections = build_document(SECTIONS, doc, errors)
    # fields that failed their type checks were left at their defaults: the names in tables are read raw
    raw = dataclasses.replace(sections["scheduler"], **{key: _printable_keys(_raw_table(doc, "scheduler", key))
                                                        for key in _TABLE_FIELDS})
    errors += schedulers.section_problems(raw)
    errors += runroot.check_run_root("storage.run_root", sections["storage"].run_root)
    # (a field of the wrong type was left at its default; a runtime the kind cannot run is refused here)
    errors += container_problems(sections["container"], gpus=sections["node"].gpus, kind=sections["scheduler"].kind)
    site = SiteProfile(name=name, nccl=nccl if not errors else {}, source=source, **sections)
    if untouched(errors, CROSS_CHECKED):  # cross-checks see the values given, not defaults left by a type error
        errors += cross_check_site(site)
    if errors:
        raise ConfigError([f"{source}: {e}" for e in errors])
    return site


# the [scheduler] fields that are tables (Slurm's sbatch options): the kinds' rules see their names as written
_TABLE_FIELDS = tuple(f.name for f in dataclasses.fields(Scheduler) if tp.get_origin(type_hints(Scheduler)[f.name]) is dict)


def _raw_table(doc: dict, section: str, key: str) -> dict[str, tp.Any]:
    """``doc[section][key]`` as written when it is a table (its values unchecked), else ``{}``."""
    table = doc.get(section)
    value = table.get(key) if isinstance(table, dict) else None
    return value if isinstance(value, dict) else {}


def _printable_keys(table: tp.Any) -> dict[str, tp.Any]:
    """The entries of a table whose names the loader found printable (it reports the others)."""
    return {k: x for k, x in table.items() if v.first_unprintable(k) is None} if isinstance(table, dict) else {}


# The fields ``cross_check_site`` reads.
CROSS_CHECKED = ("scheduler.kind", "node.gpus", "node.gpu_model", "node.gpu_memory_gb", "node.gpu_peak_tflops",
                 "node.intra_link", "node.nvlink_domain", "node.nvlink_bandwidth_gbs") + schedulers.cross_checked()


def cross_check_site(site: SiteProfile) -> list[str]:
    errors = schedulers.site_problems(site)  # its kind's own (e.g. how the kind takes GPUs)
    if site.node.gpus and not site.node.gpu_memory_gb:
        errors.append(f"`node.gpu_memory_gb` is unset but `node.gpus` = {site.node.gpus}: expected the memory per GPU")
    if site.node.gpus > 1 and site.node.intra_link == "none":
        errors.append(f"`node.intra_link` = 'none' with {site.node.gpus} GPUs per node: expected nvswitch, nvlink or pcie")
    return errors + _domain_problems(site.node) + _gpu_fields_without_gpus(site.node)


def nvlink_domain(node: Node) -> int:
    """GPUs of one NVLink island: ``node.nvlink_domain``, else the node's on an nvswitch or nvlink site, else 1."""
    if node.nvlink_domain:
        return node.nvlink_domain
    return node.gpus if node.intra_link in ("nvswitch", "nvlink") and node.gpus else 1


def nvlink_bandwidth(node: Node) -> float:
    """Bus bandwidth inside one NVLink island, GB/s (``node.nvlink_bandwidth_gbs``, else the node's)."""
    return node.nvlink_bandwidth_gbs or node.intra_bandwidth_gbs


def _domain_problems(node: Node) -> list[str]:
    """``node.nvlink_domain`` against the node: it divides the GPUs, and islands smaller than an NVLink node
    or on a pcie node say their own bandwidth."""
    domain, gpus = node.nvlink_domain, node.gpus
    if not domain or not gpus:
        return []
    if domain > gpus or gpus % domain:
        return [f"`node.nvlink_domain` = {domain} does not divide `node.gpus` = {gpus}: expected the GPUs of one "
                f"NVLink island, a divisor of {gpus}"]
    if domain > 1 and node.intra_link == "pcie" and not node.nvlink_bandwidth_gbs:
        return [f"`node.nvlink_domain` = {domain} on a pcie node (`node.intra_link`) but `node.nvlink_bandwidth_gbs` "
                "is unset: expected the bus bandwidth inside one NVLink island (e.g. NV12 × 25 GB/s = 300)"]
    return []


def _gpu_fields_without_gpus(node: Node) -> list[str]:
    """`gpus = 0` beside fields that describe GPUs: planned as a CPU site (gloo) without a word otherwise."""
    if node.gpus:
        return []
    named = [f"`node.{key}` = {getattr(node, key)!r}" for key in ("gpu_model", "gpu_memory_gb", "gpu_peak_tflops",
                                                                   "nvlink_domain", "nvlink_bandwidth_gbs")
             if getattr(node, key)]
    named += [f"`node.intra_link` = {node.intra_link!r}"] if node.intra_link != "none" else []
    if not named:
        return []
    verb = "describe" if len(named) > 1 else "describes"
    return [f"`node.gpus` = 0 makes this a CPU site (gloo, no GPUs), but {', '.join(named)} {verb} GPUs: expected "
            "`node.gpus` = the GPUs per node, or no GPU fields on a CPU site"]


def load_site(name_or_path: str, label: str | None = None) -> SiteProfile:
    """The profile ``name_or_path`` names (``label``: where that came from, for messages)."""
    path = site_path(name_or_path, label)
    if v.first_unprintable(path.stem) is not None:  # the name is shown by render, status and site list
        raise ConfigError([f"{v.shown(str(path))}: expected a profile name of printable characters"])
    return parse_site(read_toml(path), path.stem, str(path))


def written_run_root(path: Path) -> str | None:
    """``storage.run_root`` as written in a profile that does not load as a whole, if it is a string
    every kind accepts; None otherwise."""
    try:
        value = read_toml(path).get("storage", {}).get("run_root")
    except (ConfigError, AttributeError):
        return None
    if not isinstance(value, str) or runroot.check_run_root("storage.run_root", value):
        return None
    return value


def choose_site(cli: str | None, spec_site: str | None) -> str:
    """--site, then $HPCX_SITE, then the spec's job.site, then `local`."""
    return site_choice(cli, spec_site)[0]


def site_choice(cli: str | None, spec_site: str | None, spec_source: str = "the spec") -> tuple[str, str]:
    """(name or path, where it came from for a message): ``--site`` (also when empty: an error, not a fall
    back), then ``$HPCX_SITE`` (empty counts as unset), then the spec's ``job.site``, then `local`."""
    if cli is not None:
        return cli, f"--site {cli!r}"
    env = os.environ.get("HPCX_SITE")
    if env:
        return env, f"$HPCX_SITE = {v.shown(env)!r}"
    if spec_site is not None:
        return spec_site, f"{spec_source}: `job.site` = {v.shown(spec_site)!r}"
    return DEFAULT_SITE, f"the default site {DEFAULT_SITE!r}"


def select_site(cli: str | None, spec: tp.Any) -> SiteProfile:
    """The site a command runs ``spec`` on (``site_choice``), loaded; a message names where it came from."""
    name, label = site_choice(cli, spec.job.site, spec.source)
    return job_site(load_site(name, label), spec)


def job_site(site: SiteProfile, spec: tp.Any) -> SiteProfile:
    """The site as this job runs on it: its ``[container]`` with the spec's changes (``container.for_job``)."""
    job = getattr(spec, "container", None)
    if job is None or job == JobContainer():
        return site
    found = job_problems(site.container, job, gpus=site.node.gpus, kind=site.scheduler.kind)
    if found:
        raise ConfigError([f"{spec.source}: {m} (the job's [container] over {site.source})" for m in found])
    return dataclasses.replace(site, container=for_job(site.container, job))


def site_as_dict(site: SiteProfile) -> dict[str, tp.Any]:
    return asdict(site)

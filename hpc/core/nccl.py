"""NCCL's ``NCCL_DEBUG=INFO`` lines: which transport each channel used, checked against the site.

NCCL prints one line per channel connection while it builds a communicator, e.g.::

    host:pid:tid [0] NCCL INFO Channel 00/0 : 8[0] -> 15[7] via P2P/IPC
    host:pid:tid [6] NCCL INFO Channel 06/0 : 7[7] -> 14[6] [receive] via NET/IB/6/GDRDMA
    host:pid:tid [3] NCCL INFO Channel 00 : 3[b1000] -> 0[18000] via direct shared memory   (2.7)

plus ``Using network IB|Socket|Libfabric`` and ``NCCL version 2.27.5+cuda12.9`` (bare, without the
``host … NCCL INFO`` prefix, before 2.8). Several ranks often write into one file, so lines can be
spliced together; every pattern is searched anywhere in a line and an unreadable line is skipped.

Transports are reduced to the names the seeds use: ``P2P/IPC``, ``P2P/CUMEM``, ``P2P/MNNVL``,
``P2P/direct pointer`` (one process driving several GPUs), ``SHM`` (``SHM/direct/direct`` and 2.7's
``direct shared memory``), ``NET/IB``, ``NET/Socket``, ``NET/Libfabric`` … The full text after ``via``
is kept as ``detail`` (``NET/IB/6/GDRDMA`` says GPUDirect RDMA is on).
"""

from __future__ import annotations

import re
import typing as tp
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from hpc.core.runs import RunDir
from hpc.core.site import SiteProfile

CHANNEL = re.compile(
    r"Channel (\d+)(?:/\d+)? : (\d+)\[[0-9a-fA-F]+\] -> (\d+)\[[0-9a-fA-F]+\]"
    r"(?: \[(send|receive)\])? via (direct shared memory|P2P/direct pointer(?:/[\w.-]+)*|[A-Z][A-Z0-9]*(?:/[\w.-]+)*)")
VERSION = re.compile(r"NCCL version (\d+\.\d+\.\d+\S*)")
NETWORK = re.compile(r"NCCL INFO Using network (\w+)")
NET_DEVICES = re.compile(r"NCCL INFO (NET/\w+ : (?:Using \S.*|No device found\.))")
HOST = re.compile(r"^([\w.-]+):\d+:\d+ \[\d+\] NCCL INFO Channel")
NVLINK_LINKS = ("nvlink", "nvswitch")
IB_FABRICS = ("infiniband", "roce")


@dataclass(frozen=True)
class Connection:
    """One channel's connection from rank ``src`` to rank ``dst``."""

    channel: int
    src: int
    dst: int
    transport: str  # normalised: P2P/IPC, SHM, NET/IB …
    detail: str  # everything after "via", e.g. NET/IB/6/GDRDMA
    direction: str | None = None  # "send" / "receive" on network connections
    host: str | None = None  # host of the rank that printed the line


@dataclass
class NcclInfo:
    """What the INFO lines of one run (any number of files) say."""

    versions: list[str] = field(default_factory=list)
    networks: list[str] = field(default_factory=list)
    net_devices: list[str] = field(default_factory=list)
    connections: list[Connection] = field(default_factory=list)

    @property
    def found(self) -> bool:
        return bool(self.versions or self.networks or self.connections)

    def transports(self) -> Counter:
        """Connections per transport, most used first."""
        return Counter(c.transport for c in self.connections)


def normalise(via: str) -> str:
    """``NET/IB/6/GDRDMA`` -> ``NET/IB``; ``SHM/direct/direct`` and ``direct shared memory`` -> ``SHM``."""
    if via == "direct shared memory" or via.startswith("SHM"):
        return "SHM"
    if via.startswith("P2P/direct pointer"):
        return "P2P/direct pointer"
    parts = via.split("/")
    return "/".join(parts[:2])


def _add_unique(items: list[str], value: str) -> None:
    if value not in items:
        items.append(value)


def parse_lines(lines: tp.Iterable[str], info: NcclInfo | None = None) -> NcclInfo:
    """Collect versions, networks and channel connections from log lines (other lines are ignored)."""
    info = info or NcclInfo()
    for line in lines:
        if "NCCL" not in line and "Channel" not in line:
            continue
        for m in VERSION.finditer(line):
            _add_unique(info.versions, m.group(1))
        for m in NETWORK.finditer(line):
            _add_unique(info.networks, m.group(1))
        for m in NET_DEVICES.finditer(line):
            _add_unique(info.net_devices, m.group(1))
        host = HOST.match(line)
        for m in CHANNEL.finditer(line):
            info.connections.append(Connection(int(m.group(1)), int(m.group(2)), int(m.group(3)),
                                               normalise(m.group(5)), m.group(5), m.group(4),
                                               host.group(1) if host else None))
    return info


def parse_files(paths: tp.Iterable[Path]) -> NcclInfo:
    info = NcclInfo()
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                parse_lines(f, info)
        except OSError:
            continue
    return info


def run_log_files(run_dir: Path) -> list[Path]:
    """The trainer's per-rank logs and submitit's per-task stdout/stderr of a run folder."""
    files = sorted(RunDir(run_dir).logs.glob("*.log"))
    for pattern in ("*_log.out", "*_log.err"):
        files += sorted((run_dir / "submitit").glob(pattern))
    return files


def same_node(c: Connection, tasks_per_node: int | None, single_node: bool) -> bool | None:
    """Whether both ends share a node: ranks are placed in blocks of ``tasks_per_node`` (Slurm's default)."""
    if single_node:
        return True
    if not tasks_per_node:
        return None
    return c.src // tasks_per_node == c.dst // tasks_per_node


def check(info: NcclInfo, site: SiteProfile, nodes: int, tasks_per_node: int | None) -> list[str]:
    """Mismatches between the transports NCCL chose and what the site profile promises."""
    problems = []
    single = nodes == 1
    if site.node.intra_link in NVLINK_LINKS:
        slow = Counter(c.transport for c in info.connections
                       if (c.transport == "SHM" or c.transport.startswith("NET/"))
                       and same_node(c, tasks_per_node, single))
        for transport, count in slow.items():
            problems.append(
                f"{count} intra-node connections use {transport}, but site {site.name!r} promises "
                f"{site.node.intra_link} between the GPUs of a node: P2P is off or blocked (check "
                "NCCL_P2P_DISABLE, NCCL_P2P_LEVEL, and that each task sees all its node's GPUs)")
    if site.network.fabric in IB_FABRICS and not single:
        sockets = sum(1 for c in info.connections if c.transport == "NET/Socket")
        if sockets or "Socket" in info.networks:
            seen = f"{sockets} connections use NET/Socket" if sockets else "NCCL chose `Using network Socket`"
            found = [d for d in info.net_devices if d.startswith("NET/IB")]
            problems.append(f"{seen}, but site {site.name!r} promises {site.network.fabric}"
                            + (f" ({found[0]})" if found else "")
                            + ": check NCCL_IB_DISABLE, NCCL_IB_HCA and that the IB/RoCE devices are visible "
                            "in the job")
    return problems


def describe(info: NcclInfo, tasks_per_node: int | None = None, nodes: int = 0) -> str:
    """One line: version, network, and connections per transport (intra/inter-node where known)."""
    if not info.found:
        return "no NCCL INFO lines (run with NCCL_DEBUG=INFO to check transports)"
    parts = [f"NCCL {', '.join(info.versions) or 'version not printed'}",
             f"network {', '.join(info.networks) or 'not printed'}"]
    counts = []
    for transport, count in info.transports().most_common():
        where = {same_node(c, tasks_per_node, nodes == 1) for c in info.connections if c.transport == transport}
        label = "intra-node" if where == {True} else "inter-node" if where == {False} else ""
        counts.append(f"{transport} ×{count}" + (f" ({label})" if label else ""))
    return "; ".join(parts + [", ".join(counts) or "no channel lines"])

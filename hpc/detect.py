"""Draft a site profile from what a GPU node's tools print.

Inputs, each optional: ``nvidia-smi topo -m`` (GPU/NIC link matrix), ``nvidia-smi
--query-gpu=name,memory.total --format=csv`` and ``scontrol show node``. The parsers are
pure functions on text, tolerant of what real outputs contain: ANSI underline escapes on the
header, tabs or runs of spaces, trailing empty cells, NIC columns named ``NIC#`` (with a
"NIC Legend") or ``mlx5_#`` (older drivers), and ``topo -mp`` output without NV# entries.
Everything the tools cannot tell is listed in ``Draft.unknown`` instead of being guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

ANSI = re.compile(r"\x1b\[[0-9;]*m")
NV = re.compile(r"^NV(\d+)$")
NVLINK_GBS_PER_LINK = 25.0  # NVLink 2/3/4 on datacenter GPUs: 25 GB/s per link per direction
BRIDGE_GBS_PER_LINK = 14.0  # GeForce/RTX workstation bridges (e.g. RTX A6000: 14.06 GB/s per link)
PCIE_GBS = 25.0  # PCIe Gen4 x16 achieved; Gen5 is about twice that
# Dense BF16 tensor TFLOP/s from NVIDIA datasheets (without sparsity), matched by substring.
PEAK_TFLOPS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0), ("L40S", 362.0),
               ("A6000", 154.8), ("V100", 125.0))


@dataclass
class Topology:
    """The GPU part of ``nvidia-smi topo -m``."""

    gpus: list[str]
    nics: list[str]  # NIC names (mlx5_0 …), from the legend or the column headers
    links: dict[tuple[int, int], str]  # (i, j) -> "NV18", "PIX", "SYS" … for GPU pairs
    numa: list[str]  # NUMA affinity per GPU ("" where not printed)
    gpu_nic: dict[int, list[str]] = field(default_factory=dict)  # GPU -> path to each NIC

    def nvlink_counts(self) -> list[int]:
        """NV# link counts of all GPU pairs (0 for a PCIe path)."""
        return [int(m.group(1)) if (m := NV.match(v)) else 0 for v in self.links.values()]


def _cells(line: str) -> list[str]:
    line = ANSI.sub("", line).rstrip("\n")
    if "\t" in line:
        return [c.strip() for c in line.split("\t")]
    return [c.strip() for c in re.split(r"\s{2,}", line)]


def parse_topo(text: str) -> Topology:
    """Parse ``nvidia-smi topo -m`` (or ``-mp``) output; raises ValueError if there is no matrix."""
    lines = [ANSI.sub("", raw) for raw in text.splitlines()]
    # The header's first cell is empty (the row labels' column); rows start with their label.
    header_at = next((i for i, ln in enumerate(lines) if ln[:1] in ("\t", " ") and re.search(r"\bGPU0\b", ln)), None)
    if header_at is None:
        raise ValueError("no `nvidia-smi topo -m` matrix found (expected a header line with GPU0 GPU1 …)")
    header = [c for c in _cells(lines[header_at]) if c]
    columns = [c for c in header if "Affinity" not in c and "NUMA" not in c]
    gpus = [c for c in columns if re.fullmatch(r"GPU\d+", c)]
    rows = _matrix_rows(lines[header_at + 1:], columns)
    links, numa, gpu_nic = {}, [], {}
    for i, g in enumerate(gpus):
        cells = rows.get(g, [])
        for j, other in enumerate(columns):
            value = cells[j] if j < len(cells) else ""
            if other in gpus and other != g:
                links[(i, gpus.index(other))] = value
            elif other not in gpus:
                gpu_nic.setdefault(i, []).append(value)
        numa.append(cells[len(columns) + 1] if len(cells) > len(columns) + 1 else "")
    nic_columns = [c for c in columns if c not in gpus]
    return Topology(gpus, _nic_names(lines, nic_columns), links, numa, gpu_nic)


def _matrix_rows(lines: list[str], columns: list[str]) -> dict[str, list[str]]:
    rows: dict[str, list[str]] = {}
    for line in lines:
        if not line.strip():
            break
        parts = line.split()
        if parts and parts[0] in columns:
            rows[parts[0]] = parts[1:]  # cells hold no spaces; " X " and empty trailing cells vanish
    return rows


def _nic_names(lines: list[str], nic_columns: list[str]) -> list[str]:
    legend = {}
    for line in lines:
        m = re.match(r"^\s*(NIC\d+):\s*(\S+)\s*$", line)
        if m:
            legend[m.group(1)] = m.group(2)
    return [legend.get(c, c) for c in nic_columns]


@dataclass
class GpuQuery:
    names: list[str]
    memory_gb: list[float]  # 1e9 bytes


def parse_query_gpu(text: str) -> GpuQuery:
    """Parse ``nvidia-smi --query-gpu=name,memory.total --format=csv`` (with or without units)."""
    names, memory = [], []
    for raw in text.splitlines():
        line = ANSI.sub("", raw).strip()
        if not line or line.lower().startswith("name"):
            continue
        name, _, mem = line.rpartition(",")
        m = re.match(r"^\s*([\d.]+)\s*(MiB|GiB)?\s*$", mem)
        if not name or not m:
            raise ValueError(f"unexpected line in nvidia-smi --query-gpu output: {line!r}")
        mib = float(m.group(1)) * (1024 if m.group(2) == "GiB" else 1)
        names.append(name.strip())
        memory.append(round(mib * 2**20 / 1e9, 1))
    if not names:
        raise ValueError("no GPUs in the nvidia-smi --query-gpu output")
    return GpuQuery(names, memory)


@dataclass
class SlurmNode:
    name: str
    cpus: int | None
    memory_gb: float | None  # RealMemory (MiB) in 1e9 bytes
    gpus: int | None  # from Gres=gpu[:type]:N
    partitions: list[str]


def parse_scontrol_nodes(text: str) -> list[SlurmNode]:
    """Parse ``scontrol show node``: ``Key=Value`` tokens, one node per blank-line-separated record."""
    nodes = []
    for record in re.split(r"\n\s*\n", text.strip()):
        fields = dict(re.findall(r"(\w+)=(\S*)", record))
        if "NodeName" not in fields:
            continue
        nodes.append(SlurmNode(
            name=fields["NodeName"],
            cpus=int(fields["CPUTot"]) if fields.get("CPUTot", "").isdigit() else None,
            memory_gb=round(int(fields["RealMemory"]) * 2**20 / 1e9, 1) if fields.get("RealMemory", "").isdigit() else None,
            gpus=_gres_gpus(fields.get("Gres", "")),
            partitions=[p for p in fields.get("Partitions", "").split(",") if p]))
    return nodes


def _gres_gpus(gres: str) -> int | None:
    """``gpu:8``, ``gpu:h100:8(S:0-1)``, ``gpu:a100:4,shard:8`` -> GPU count; ``(null)`` -> 0."""
    if not gres or gres == "(null)":
        return 0
    total = 0
    for item in gres.split(","):
        parts = re.sub(r"\(.*?\)", "", item).split(":")
        if parts[0] == "gpu" and parts[-1].isdigit():
            total += int(parts[-1])
    return total


@dataclass
class Draft:
    """A site profile draft: TOML-ready values, how each was found, and what is unknown."""

    name: str
    node: dict[str, object] = field(default_factory=dict)
    network: dict[str, object] = field(default_factory=dict)
    scheduler: dict[str, object] = field(default_factory=dict)
    nccl: dict[str, str] = field(default_factory=dict)
    found: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)


def draft_site(name: str, topo: Topology | None, query: GpuQuery | None, slurm: list[SlurmNode] | None) -> Draft:
    """Combine whatever was parsed into a draft profile."""
    d = Draft(name)
    d.scheduler = {"kind": "slurm" if slurm else "local", "gpu_directive": "gpus-per-node"}
    _from_query(d, query)
    if topo is not None:
        _from_topo(d, topo, query)
    else:
        d.unknown.append("node.intra_link, node.intra_bandwidth_gbs: no `nvidia-smi topo -m` output")
    _from_slurm(d, slurm)
    if not d.node.get("gpus"):
        d.scheduler["gpu_directive"] = "none"
        d.node.setdefault("intra_link", "none")
    d.unknown.append("network.bandwidth_gbs, network.latency_us: not printed by these tools "
                     "(ibstat gives each port's rate; add them up for the node)")
    d.unknown.append("storage.run_root: a folder every node sees")
    return d


def _from_query(d: Draft, query: GpuQuery | None) -> None:
    if query is None:
        d.unknown.append("node.gpu_model, node.gpu_memory_gb: no `nvidia-smi --query-gpu` output")
        return
    d.node["gpus"] = len(query.names)
    d.node["gpu_model"] = query.names[0]
    d.node["gpu_memory_gb"] = min(query.memory_gb)
    d.found.append(f"{len(query.names)} GPUs from nvidia-smi --query-gpu: {query.names[0]}, "
                   f"{min(query.memory_gb):g} GB (1e9 bytes) each")
    if len(set(query.names)) > 1:
        d.found.append(f"mixed GPU models ({', '.join(sorted(set(query.names)))}): the profile uses the smallest memory")
    peak = next((t for key, t in PEAK_TFLOPS if key in query.names[0]), None)
    if peak:
        d.node["gpu_peak_tflops"] = peak
        d.found.append(f"gpu_peak_tflops = {peak:g}: dense BF16 from NVIDIA's datasheet for {query.names[0]}")
    else:
        d.unknown.append(f"node.gpu_peak_tflops: {query.names[0]!r} is not in the planner's table")


def _from_topo(d: Draft, topo: Topology, query: GpuQuery | None) -> None:
    n = len(topo.gpus)
    d.node.setdefault("gpus", n)
    if query is not None and len(query.names) != n:
        d.found.append(f"topo -m shows {n} GPUs but --query-gpu lists {len(query.names)}")
    counts = topo.nvlink_counts()
    link, gbs, why = _intra_link(n, counts, query)
    d.node["intra_link"] = link
    if gbs:
        d.node["intra_bandwidth_gbs"] = gbs
    d.node["intra_latency_us"] = 3.0 if link in ("nvswitch", "nvlink") else 8.0
    d.found.append(why)
    numa = sorted({x for x in topo.numa if x and x != "N/A"})
    if len(numa) > 1:
        d.found.append(f"GPUs sit on {len(numa)} NUMA nodes ({', '.join(numa)})")
    _from_nics(d, topo)


def _intra_link(n: int, counts: list[int], query: GpuQuery | None) -> tuple[str, float, str]:
    if n <= 1:
        return "none", 0.0, "one GPU: no intra-node link"
    per_link = BRIDGE_GBS_PER_LINK if query and any("RTX" in x for x in query.names) else NVLINK_GBS_PER_LINK
    if counts and all(counts) and len(set(counts)) == 1:
        kind = "nvswitch" if n > 4 else "nvlink"
        gbs = counts[0] * per_link
        return kind, gbs, (f"every GPU pair is NV{counts[0]}: {kind}, {counts[0]} links × {per_link:g} GB/s = "
                           f"{gbs:g} GB/s per direction (assumed per-link speed; "
                           f"{'switch inferred from >4 fully connected GPUs' if kind == 'nvswitch' else 'a direct mesh or a switch cannot be told apart'})")
    if any(counts):
        pairs = sum(1 for c in counts if c) // 2
        return "pcie", PCIE_GBS, (f"NVLink joins only {pairs} of {n * (n - 1) // 2} GPU pairs; a ring over all {n} "
                                  f"GPUs runs at PCIe speed: pcie, {PCIE_GBS:g} GB/s assumed (Gen4 x16)")
    return "pcie", PCIE_GBS, f"no NVLink between the {n} GPUs: pcie, {PCIE_GBS:g} GB/s assumed (Gen4 x16; Gen5 ≈ 2×)"


def _from_nics(d: Draft, topo: Topology) -> None:
    if not topo.nics:
        d.network["fabric"] = "ethernet"
        d.unknown.append("network.fabric: topo -m shows no RDMA NICs; assumed ethernet (sockets)")
        return
    names = ", ".join(topo.nics)
    close = sum(1 for paths in topo.gpu_nic.values() if any(p in ("PIX", "PXB") for p in paths))
    d.found.append(f"{len(topo.nics)} NICs ({names}); {close} of {len(topo.gpus)} GPUs share a PCIe switch "
                   "with one (GPUDirect RDMA friendly)")
    if all(x.startswith("mlx5") for x in topo.nics):
        d.network["fabric"] = "infiniband"
        d.nccl["NCCL_IB_HCA"] = "mlx5"
        d.unknown.append("network.fabric: mlx5 ports can be InfiniBand or RoCE; drafted as infiniband "
                         "(check `ibstat`: Link layer)")
    else:
        d.unknown.append(f"network.fabric: NICs {names} not recognised")


def _from_slurm(d: Draft, slurm: list[SlurmNode] | None) -> None:
    if not slurm:
        d.unknown.append("scheduler.partition, node.cpus, node.memory_gb: no `scontrol show node` output")
        return
    node = slurm[0]
    if node.cpus:
        d.node["cpus"] = node.cpus
    if node.memory_gb:
        d.node["memory_gb"] = node.memory_gb
    if node.partitions:
        d.scheduler["partition"] = node.partitions[0]
    if node.gpus and "gpus" not in d.node:
        d.node["gpus"] = node.gpus
    elif node.gpus is not None and d.node.get("gpus") not in (None, node.gpus):
        d.found.append(f"Slurm's Gres says {node.gpus} GPUs per node but this node shows {d.node['gpus']}")
    d.found.append(f"from scontrol ({node.name}): {node.cpus} CPUs, RealMemory {node.memory_gb} GB, "
                   f"partitions {','.join(node.partitions) or '?'}")
    d.unknown.append("scheduler.gpu_directive: both --gpus-per-node and --gres work with GRES; drafted gpus-per-node")


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_toml(d: Draft) -> str:
    """The draft as a site profile file, with what was found and what was not as comments."""
    out = [f"# Site profile draft for {d.name!r}, written by `hpcx site detect`. Check every value."]
    out += [f"# found: {f}" for f in d.found]
    out += [f"# unknown: {u}" for u in d.unknown]
    for section in ("scheduler", "node", "network", "nccl"):
        table = getattr(d, section)
        if table:
            out += ["", f"[{section}]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    out += ["", "[storage]", 'run_root = "$HOME/hpcx-runs"', ""]
    return "\n".join(out)

"""Draft a site profile from what a GPU node's tools print.

Inputs, each optional: ``nvidia-smi topo -m`` (GPU/NIC link matrix), ``nvidia-smi
--query-gpu=name,memory.total,mig.mode.current --format=csv`` (the MIG column may be left out) and
``scontrol show node``. The parsers are pure functions on text, tolerant of what real outputs
contain: ANSI underline escapes on the header, tabs or runs of spaces (or both mixed), trailing empty cells, NIC columns named ``NIC#`` (with a
"NIC Legend") or ``mlx5_#`` (older drivers), a header clipped before its NIC columns, and
``topo -mp`` output (PCIe paths only: NVLink is then unknown, never "absent").

They are strict about what would make a draft wrong: a matrix that is not square (a GPU row
missing or cut short), not symmetric, or holds a cell the legend does not define is refused
with one line (``ValueError``), as is a ``--query-gpu`` line cut before its unit. Everything
the tools cannot tell is listed in ``Draft.unknown``, and every value the draft had to assume
(PCIe generation, NVLink speed per link, latencies) in ``Draft.assumed``. Another tool's output
(``rocm-smi``, ``nvidia-smi -L``) is refused naming that tool, and ``render_toml`` always writes a
file that parses as TOML, whatever the tools printed.

MIG: hpcx plans whole GPUs, so a MIG device is never counted as one. ``mig.mode.current`` in the
query output puts the advice (disable MIG for training, or write the profile by hand) in the draft's
comments; a ``nvidia-smi -L`` listing with MIG devices, or a matrix whose labels are MIG devices
(``GPU0/1/0``, ``MIG 1g.10gb Device 0``, ``MIG-…``), is refused with that advice in one line. No
recorded ``topo -m`` of a MIG-enabled node was found (the recorded matrices label GPUs ``GPU#`` and
NICs ``NIC#``/``mlx5_#`` only), so the topo side is a guard: a MIG label is never read as a NIC
column or row, nor counted as a GPU.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import typing as tp
from dataclasses import dataclass, field
from pathlib import Path

from hpc.core.config import ConfigError

from hpc.core.validate import shown

ANSI = re.compile(r"\x1b\[[0-9;]*m")
NV = re.compile(r"^NV(\d+)$")
GPU_LABEL = re.compile(r"^GPU(\d+)$")
COLUMN_LABEL = re.compile(r"^(GPU\d+|NIC\d+|mlx\d+_\d+)$")
# Cells `nvidia-smi topo` prints when its legend is cut off (SOC is the pre-2017 name of SYS).
KNOWN_CELLS = ("X", "SYS", "SOC", "NODE", "PHB", "PXB", "PIX")
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
    nics: list[str]  # NIC names (mlx5_0 …), from the NIC legend, the column headers or the NIC rows
    links: dict[tuple[int, int], str]  # (i, j) -> "NV18", "PIX", "SYS" … for GPU pairs
    numa: list[str]  # NUMA affinity per GPU ("" where not printed)
    gpu_nic: dict[int, list[str]] = field(default_factory=dict)  # GPU -> path to each NIC
    nvlink_visible: bool | None = True  # False for `topo -mp`; None when the output cannot tell

    def nvlink_counts(self) -> list[int]:
        """NV# link counts of all GPU pairs (0 for a PCIe path)."""
        return [int(m.group(1)) if (m := NV.match(v)) else 0 for v in self.links.values()]


@dataclass
class Legend:
    """What the legends under the matrix say: the cell names it defines, and NIC# -> device name."""

    cells: set[str] | None  # None: no legend printed
    nv: bool  # the legend defines NV# (absent under `topo -mp`)
    nics: dict[str, str]


def _cells(line: str) -> list[str]:
    """Header cells: separated by tabs, by runs of spaces, or a mix of both (a matrix pasted from a
    terminal, or edited); single spaces stay inside a cell (``CPU Affinity``) unless they only
    separate column labels (``GPU0 GPU1``)."""
    line = ANSI.sub("", line).rstrip("\n")
    cells: list[str] = []
    for cell in (c.strip() for c in re.split(r"\t| {2,}", line)):
        words = cell.split()
        cells += words if len(words) > 1 and all(COLUMN_LABEL.match(w) for w in words) else [cell]
    return cells


def _legend(lines: list[str]) -> Legend:
    cells, nics, seen = set(), {}, False
    for line in lines:
        if line.strip() == "Legend:":
            seen = True
        if m := re.match(r"^\s+(X|[A-Z]{2,4}#?)\s+=\s", line):
            cells.add(m.group(1))
        if m := re.match(r"^\s*(NIC\d+):\s*(\S+)\s*$", line):
            nics[m.group(1)] = m.group(2)
    return Legend(cells if seen else None, "NV#" in cells, nics)


def _valid_cell(value: str, legend: Legend) -> bool:
    if NV.match(value):
        return legend.cells is None or legend.nv
    return value in (legend.cells if legend.cells is not None else KNOWN_CELLS)


# What other tools print, recognised so that a wrong file is named for what it is.
ROCM_SMI = re.compile(r"ROCm System Management Interface|End of ROCm SMI Log|(Weight|Hops) between two GPUs|"
                      r"Link Type between two GPUs|\[Model : Revision\]|\[0x[0-9a-f]{4} : 0x[0-9a-f]{2}\]|AMD Instinct")
SMI_LIST = re.compile(r"^\s*(GPU \d+: .*\(UUID: GPU-|MIG \S+\s+Device\s+\d+: \(UUID: MIG-)", re.M)
SMI_LIST_LINE = re.compile(r"^\s*(?:GPU (\d+): |(MIG) \S+\s+Device\s+\d+: )")
# A MIG device where a matrix has a GPU or NIC label: GPU0/1/0 (GPU/GI/CI), `MIG 1g.10gb Device 0`, a MIG- UUID.
MIG_LABEL = re.compile(r"^(GPU(\d+)/\d+/\d+|MIG\b.*|MIG-\S+)$")


def mig_advice(gpus: tp.Iterable[int | str], source: str) -> str:
    """One line: MIG is enabled on these GPUs (as ``source`` shows), hpcx plans whole GPUs, and what to do."""
    listed = ", ".join(map(str, gpus))
    which = f"GPU {listed}" if listed else "this node's GPUs"
    off = f"`sudo nvidia-smi -i {listed.replace(', ', ',')} -mig 0`" if listed else "`sudo nvidia-smi -mig 0`"
    return (f"MIG is enabled on {which} ({source}): hpcx plans whole GPUs and never counts a MIG device as one "
            "(a task there sees a slice, and one NCCL job cannot span MIG devices); for training, disable MIG "
            f"({off}) on the nodes hpcx runs on, or write the profile by hand (docs/site.md)")


def smi_list_mig(text: str) -> dict[int, int]:
    """``nvidia-smi -L``: GPU index -> how many MIG devices are listed under it (GPUs without any left out)."""
    devices: dict[int, int] = {}
    gpu = None
    for line in text.splitlines():
        if not (m := SMI_LIST_LINE.match(line)):
            continue
        if m.group(1) is not None:
            gpu = int(m.group(1))
        elif gpu is not None:
            devices[gpu] = devices.get(gpu, 0) + 1
    return devices


def other_tool(text: str, expected: str) -> None:
    """ValueError naming the tool when ``text`` is another tool's output than ``expected``; a GPU listing
    with MIG devices also says what MIG means for the draft."""
    if ROCM_SMI.search(text):
        raise ValueError(f"this is `rocm-smi` output (AMD GPUs), not `{expected}`: `hpcx site detect` reads "
                         "NVIDIA's tools; write the profile by hand (docs/site.md)")
    if SMI_LIST.search(text):
        mig = smi_list_mig(text)
        if not mig and not re.search(r"^\s*MIG \S+\s+Device", text, re.M):
            raise ValueError(f"this is `nvidia-smi -L` output, not `{expected}`")
        count = sum(mig.values())
        shown_count = f"{count} MIG device{'s' if count != 1 else ''}" if count else "MIG devices"
        raise ValueError(f"this is `nvidia-smi -L` output with {shown_count}, not `{expected}`; "
                         + mig_advice(sorted(mig), "`nvidia-smi -L` lists MIG devices"))


def parse_topo(text: str) -> Topology:
    """Parse ``nvidia-smi topo -m`` (or ``-mp``); raises ValueError, one line, when there is no matrix
    or it is not one a draft can be built on (see ``check_matrix``), or when it is another tool's output."""
    other_tool(text, "nvidia-smi topo -m")
    lines = [ANSI.sub("", raw) for raw in text.splitlines()]
    check_no_mig(lines)
    # The header's first cell is empty (the row labels' column); rows start with their label.
    header_at = next((i for i, ln in enumerate(lines) if ln[:1] in ("\t", " ") and re.search(r"\bGPU0\b", ln)), None)
    if header_at is None:
        raise ValueError("no `nvidia-smi topo -m` matrix found (expected a header line with GPU0 GPU1 …)")
    header = [c for c in _cells(lines[header_at]) if c]
    gpus = [c for c in header if GPU_LABEL.match(c)]
    legend = _legend(lines[header_at + 1:])
    rows = _matrix_rows(lines[header_at + 1:])
    check_matrix(gpus, rows, legend)
    check_nic_cells(gpus, rows, legend, _nic_columns(header, gpus))
    nic_labels = _nic_labels(header, gpus, rows, legend)
    n = len(gpus)
    links = {(i, j): rows[g][j] for i, g in enumerate(gpus) for j in range(n) if i != j}
    gpu_nic = {i: rows[g][n:n + len(nic_labels)] for i, g in enumerate(gpus)}
    numa = [_numa(rows[g][n:]) for g in gpus]
    nvlink = True if legend.nv or any(NV.match(v) for v in links.values()) else (False if legend.cells else None)
    return Topology(gpus, [legend.nics.get(c, c) for c in nic_labels], links, numa, gpu_nic, nvlink)


def check_no_mig(lines: list[str]) -> None:
    """Refuse a matrix whose header cells or row labels are MIG devices (``GPU0/1/0``, ``MIG 1g.10gb
    Device 0``, ``MIG-…``): read as they stand they would become NICs, or GPUs the draft counts."""
    labels = [c for ln in lines if ln.strip() for c in (_cells(ln) if ln[:1] in ("\t", " ") else _cells(ln)[:1])]
    mig = list(dict.fromkeys(c for c in labels if MIG_LABEL.match(c)))
    if not mig:
        return
    parents = sorted({int(m.group(2)) for c in mig if (m := MIG_LABEL.match(c)) and m.group(2)})
    named = ", ".join(shown(c, 40) for c in mig[:3]) + (" …" if len(mig) > 3 else "")
    raise ValueError(f"the matrix labels MIG devices ({named}) where GPUs belong; "
                     + mig_advice(parents, "`nvidia-smi topo -m`"))


def _matrix_rows(lines: list[str]) -> dict[str, list[str]]:
    """Row label -> its cells, up to the first blank line (cells hold no spaces; " X " and empty
    trailing cells vanish)."""
    rows: dict[str, list[str]] = {}
    for line in lines:
        if not line.strip():
            break
        parts = line.split()
        if parts and not line[:1].isspace():
            rows[parts[0]] = parts[1:]
    return rows


def check_matrix(gpus: list[str], rows: dict[str, list[str]], legend: Legend) -> None:
    """Refuse a matrix a draft would misread: GPU rows missing or cut short, an asymmetric pair,
    a cell the legend does not define, or a GPU's own cell that is not X."""
    n = len(gpus)
    if gpus != [f"GPU{i}" for i in range(n)]:
        raise ValueError(f"the matrix header names {', '.join(gpus)}: expected GPU0 … GPU{n - 1} in order")
    have = [g for g in gpus if g in rows]
    extra = sorted(r for r in rows if GPU_LABEL.match(r) and r not in gpus)
    if len(have) < n or extra:
        got = f"rows for {len(have)} ({', '.join(have) or 'none'})" + (f" and for {', '.join(extra)}" if extra else "")
        raise ValueError(f"the matrix is not square: its header lists {n} GPUs but {got} follow; the output looks "
                         "cut short or pasted from two machines")
    lengths = {g: len(rows[g]) for g in gpus}
    if len(set(lengths.values())) > 1:
        short = min(lengths, key=lambda g: lengths[g])
        raise ValueError(f"the matrix is not square: {short}'s row has {lengths[short]} cells where other GPU rows have "
                         f"{max(lengths.values())}; the output looks cut short")
    for g in gpus:
        cells = rows[g][:n]
        if len(cells) < n:
            raise ValueError(f"the matrix is not square: {g}'s row has {len(cells)} cells for {n} GPU columns; the "
                             "output looks cut short")
        bad = next((c for c in cells if not _valid_cell(c, legend)), None)
        if bad is not None:
            defined = "its legend's" if legend.cells is not None else "the known"
            raise ValueError(f"{g}'s row holds {bad!r}, which is not one of {defined} cell names "
                             f"({', '.join(sorted(legend.cells or KNOWN_CELLS))}{', NV#' if legend.nv or legend.cells is None else ''})")
    _check_symmetry(gpus, rows)


def _check_symmetry(gpus: list[str], rows: dict[str, list[str]]) -> None:
    for i, a in enumerate(gpus):
        if rows[a][i] != "X":
            raise ValueError(f"{a}'s own cell is {rows[a][i]!r}: expected X on the diagonal")
        for j in range(i + 1, len(gpus)):
            b = gpus[j]
            if rows[a][j] != rows[b][i]:
                raise ValueError(f"the matrix is not symmetric: {a}→{b} is {rows[a][j]} but {b}→{a} is "
                                 f"{rows[b][i]}")


def check_nic_cells(gpus: list[str], rows: dict[str, list[str]], legend: Legend, columns: list[str]) -> None:
    """The GPU rows' NIC cells: as many as the header has NIC columns, each a defined cell name (a row
    cut inside them would misplace the NICs); with a clipped header, whichever of them were printed."""
    n = len(gpus)
    for g in gpus:
        after = rows[g][n:]
        cells = after[:len(columns)] if columns else [c for c in after if re.match(r"^[A-Za-z?]", c) and c != "N/A"]
        if len(cells) < len(columns):
            raise ValueError(f"{g}'s row has {len(cells)} NIC cells for {len(columns)} NIC columns; the output looks "
                             "cut short")
        bad = next((c for c in cells if not _valid_cell(c, legend)), None)
        if bad is not None:
            raise ValueError(f"{g}'s row holds {bad!r} in its NIC columns, which is not a cell name "
                             "`nvidia-smi topo` defines; the output looks cut short or edited")


def _nic_columns(header: list[str], gpus: list[str]) -> list[str]:
    return [c for c in header if c not in gpus and "Affinity" not in c and "NUMA" not in c]


def _nic_labels(header: list[str], gpus: list[str], rows: dict[str, list[str]], legend: Legend) -> list[str]:
    """NIC columns: from the header, else (a header clipped before them) from the NIC rows and the legend."""
    columns = _nic_columns(header, gpus)
    nic_rows = [r for r in rows if not GPU_LABEL.match(r)]
    return max((columns, nic_rows, list(legend.nics)), key=len)


def _numa(after_gpus: list[str]) -> str:
    """NUMA affinity: the cell after the CPU affinity (the first cell that is a CPU list like 0-63,128-191)."""
    at = next((i for i, c in enumerate(after_gpus) if re.fullmatch(r"[\d,\-]+", c) and "-" in c), None)
    if at is None or at + 1 >= len(after_gpus):
        return ""
    return after_gpus[at + 1]


@dataclass
class GpuQuery:
    names: list[str]
    memory_gb: list[float]  # 1e9 bytes
    mig: list[bool] = field(default_factory=list)  # mig.mode.current is Enabled, per GPU (when queried)


QUERY_COMMAND = ["nvidia-smi", "--query-gpu=name,memory.total,mig.mode.current", "--format=csv"]
MIG_MODES = {"enabled": True, "disabled": False, "[n/a]": False, "n/a": False}


def parse_query_gpu(text: str) -> GpuQuery:
    """Parse ``nvidia-smi --query-gpu=name,memory.total[,mig.mode.current] --format=csv`` (with or
    without units); a value without the unit its header announces is a line cut short, and refused."""
    other_tool(text, "nvidia-smi --query-gpu=name,memory.total --format=csv")
    out, unit = GpuQuery([], []), None
    for number, raw in enumerate(text.splitlines(), 1):
        line = ANSI.sub("", raw).strip()
        if line.lower().startswith("name"):
            unit = re.search(r"\[(MiB|GiB)\]", line)
            continue
        if line:
            _query_line(out, number, line, unit.group(1) if unit else None)
    if not out.names:
        raise ValueError("no GPUs in the nvidia-smi --query-gpu output")
    return out


def _query_line(out: GpuQuery, number: int, line: str, unit: str | None) -> None:
    """One ``name, memory[, mig mode]`` line into ``out``."""
    rest, _, last = line.rpartition(",")
    mig = MIG_MODES.get(last.strip().lower())
    if mig is not None:
        line = rest
    name, _, mem = line.rpartition(",")
    m = re.match(r"^\s*([\d.]+)\s*(MiB|GiB)?\s*$", mem)
    if not name or not m:
        raise ValueError(f"line {number} of the nvidia-smi --query-gpu output is not 'name, memory': {line!r}")
    if unit is not None and m.group(2) != unit:
        raise ValueError(f"line {number} of the nvidia-smi --query-gpu output, {line!r}, lacks the unit its "
                         f"header announces ({unit}): the output looks cut short")
    mib = float(m.group(1)) * (1024 if m.group(2) == "GiB" else 1)
    out.names.append(name.strip())
    out.memory_gb.append(round(mib * 2**20 / 1e9, 1))
    out.mig.append(bool(mig))


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


@dataclass(frozen=True)
class Host:
    """This machine, for a draft without Slurm: CPU cores and memory."""

    cpus: int
    memory_gb: float  # MemTotal in 1e9 bytes

    @classmethod
    def here(cls) -> Host | None:
        """``os.cpu_count()`` and ``/proc/meminfo``'s MemTotal; None where they cannot be read."""
        try:
            with open("/proc/meminfo", encoding="ascii") as f:
                kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
        except (OSError, StopIteration, ValueError, IndexError):
            return None
        return cls(os.cpu_count() or 1, round(kib * 1024 / 1e9, 1))


@dataclass
class Draft:
    """A site profile draft: TOML-ready values, how each was found, what was assumed, what is unknown."""

    name: str
    node: dict[str, object] = field(default_factory=dict)
    network: dict[str, object] = field(default_factory=dict)
    scheduler: dict[str, object] = field(default_factory=dict)
    nccl: dict[str, str] = field(default_factory=dict)
    storage: dict[str, object] = field(default_factory=dict)
    found: list[str] = field(default_factory=list)
    assumed: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)


def draft_site(name: str, topo: Topology | None, query: GpuQuery | None, slurm: list[SlurmNode] | None,
               host: Host | None = None) -> Draft:
    """Combine whatever was parsed into a draft profile: a Slurm site when ``scontrol`` answered,
    else a ``local`` site that runs jobs on this machine (``host``: its CPUs and memory)."""
    d = Draft(name)
    _check_gpu_counts(topo, query)
    _from_query(d, query)
    if topo is not None:
        _from_topo(d, topo, query)
    else:
        d.unknown.append("node.intra_link, node.intra_bandwidth_gbs: no `nvidia-smi topo -m` output")
    if slurm:
        _slurm_site(d, slurm)
    else:
        _local_site(d, host)
    if not d.node.get("gpus"):
        d.scheduler["gpu_directive"] = "none"
        d.node["intra_link"] = "none"
    return d


def _check_gpu_counts(topo: Topology | None, query: GpuQuery | None) -> None:
    if topo is not None and query is not None and len(topo.gpus) != len(query.names):
        raise ValueError(f"`nvidia-smi topo -m` shows {len(topo.gpus)} GPUs but --query-gpu lists "
                         f"{len(query.names)}: one of the two outputs is cut short or from another machine")


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
    mig = [i for i, on in enumerate(query.mig) if on]
    if mig:
        d.unknown.append(mig_advice(mig, "mig.mode.current"))
    peak = next((t for key, t in PEAK_TFLOPS if key in query.names[0]), None)
    if peak:
        d.node["gpu_peak_tflops"] = peak
        d.found.append(f"gpu_peak_tflops = {peak:g}: dense BF16 from NVIDIA's datasheet for {query.names[0]}")
    else:
        d.unknown.append(f"node.gpu_peak_tflops: {query.names[0]!r} is not in the planner's table")


def _from_topo(d: Draft, topo: Topology, query: GpuQuery | None) -> None:
    n = len(topo.gpus)
    d.node.setdefault("gpus", n)
    link, gbs, why = _intra_link(n, topo, query)
    d.node["intra_link"] = link
    if gbs:
        d.node["intra_bandwidth_gbs"] = gbs
    if n > 1:
        d.node["intra_latency_us"] = 3.0 if link in ("nvswitch", "nvlink") else 8.0
        d.assumed.append(f"node.intra_latency_us = {d.node['intra_latency_us']:g}: typical for {link}, not measured")
    d.found.append(why[0])
    d.assumed += why[1:]
    _nvlink_islands(d, n, topo, link, query)
    numa = sorted({x for x in topo.numa if x and x != "N/A"})
    if len(numa) > 1:
        d.found.append(f"GPUs sit on {len(numa)} NUMA nodes ({', '.join(numa)})")
    _from_nics(d, topo)


def nvlink_islands(n: int, topo: Topology) -> list[list[int]]:
    """The GPUs NVLink joins, as islands (connected by NV# cells), in GPU order; a GPU without NVLink is its own."""
    island = list(range(n))

    def root(i: int) -> int:
        while island[i] != i:
            i = island[i]
        return i

    for (i, j), cell in topo.links.items():
        if NV.match(cell):
            island[root(i)] = root(j)
    groups: dict[int, list[int]] = {}
    for i in range(n):
        groups.setdefault(root(i), []).append(i)
    return sorted(groups.values())


def island_domain(n: int, topo: Topology) -> tuple[int, int, str]:
    """(GPUs per NVLink island, the fewest NV# links inside one, why): islands of one size k, each k consecutive GPUs
    joined pairwise, give k (a tensor-parallel group of consecutive ranks then stays on NVLink); otherwise 1."""
    islands = nvlink_islands(n, topo)
    sizes = sorted({len(x) for x in islands})
    shown = " ".join("{" + ",".join(f"GPU{i}" for i in x) + "}" for x in islands if len(x) > 1)
    if sizes == [1]:
        return 1, 0, ""
    k = len(islands[0])
    consecutive = all(x == list(range(x[0], x[0] + k)) for x in islands)
    counts = [int(m.group(1)) for x in islands for i in x for j in x if i != j
              if (m := NV.match(topo.links[(i, j)]))]
    clique = len(counts) == len(islands) * k * (k - 1)
    if len(sizes) == 1 and consecutive and clique:
        return k, min(counts), f"NVLink islands of {k} GPUs: {shown}"
    why = ("islands of different sizes" if len(sizes) > 1 else "islands that are not consecutive GPUs"
           if not consecutive else "islands whose GPUs are not all joined pairwise")
    return 1, 0, f"NVLink joins {shown} only, {why}: nvlink_domain = 1 (no tensor-parallel group stays on NVLink)"


def _nvlink_islands(d: Draft, n: int, topo: Topology, link: str, query: GpuQuery | None) -> None:
    """``node.nvlink_domain`` (and the islands' own bandwidth) on a node whose NVLink joins only some GPU pairs."""
    if n <= 1 or link in ("nvswitch", "nvlink") or topo.nvlink_visible is not True:
        return
    domain, links, why = island_domain(n, topo)
    if not why:
        return
    d.node["nvlink_domain"] = domain
    d.found.append(why)
    if domain > 1:
        rtx = bool(query and any("RTX" in x for x in query.names))
        per_link = BRIDGE_GBS_PER_LINK if rtx else NVLINK_GBS_PER_LINK
        d.node["nvlink_bandwidth_gbs"] = links * per_link
        d.assumed.append(f"node.nvlink_bandwidth_gbs = {links * per_link:g}: NV{links} × {per_link:g} GB/s per link per "
                         f"direction inside an island ({'RTX bridge' if rtx else 'NVLink 2–4'})")


def _intra_link(n: int, topo: Topology, query: GpuQuery | None) -> tuple[str, float, list[str]]:
    """(link, GB/s, [what was found, then what was assumed])."""
    if n <= 1:
        return "none", 0.0, ["one GPU: no intra-node link"]
    counts = topo.nvlink_counts()
    pcie = (f"node.intra_bandwidth_gbs = {PCIE_GBS:g}: PCIe Gen4 x16 assumed (Gen5 is about twice that; "
            "`nvidia-smi -q -d PCIE` shows the generation)")
    if topo.nvlink_visible is False:
        return "pcie", PCIE_GBS, [f"`nvidia-smi topo -mp` output: PCIe paths between the {n} GPUs only; NVLink is "
                                  "not shown by -mp, so whether the GPUs have it is unknown",
                                  "node.intra_link = pcie: the lower bound until `nvidia-smi topo -m` shows the "
                                  "NVLinks (-mp cannot)", pcie]
    if counts and all(counts):
        return _nvlink(n, counts, query)
    if any(counts):
        pairs = sum(1 for c in counts if c) // 2
        return "pcie", PCIE_GBS, [f"NVLink joins only {pairs} of {n * (n - 1) // 2} GPU pairs; a ring over all {n} "
                                  "GPUs runs at PCIe speed: pcie", pcie]
    if topo.nvlink_visible is None:
        return "pcie", PCIE_GBS, [f"no NV# cells between the {n} GPUs", "node.intra_link = pcie: the output has no "
                                  "legend, so it cannot tell `topo -m` output (which shows NVLinks) from `topo -mp` "
                                  "output (which never does)", pcie]
    return "pcie", PCIE_GBS, [f"no NVLink between the {n} GPUs (every pair is a PCIe path in `topo -m`): pcie", pcie]


def _nvlink(n: int, counts: list[int], query: GpuQuery | None) -> tuple[str, float, list[str]]:
    """Every GPU pair joined by NVLink: a switch when more than 4 GPUs see the same count everywhere,
    else a direct mesh (NV1/NV2 mixed, as on V100 boards) whose slowest pair bounds a ring."""
    rtx = bool(query and any("RTX" in x for x in query.names))
    per_link = BRIDGE_GBS_PER_LINK if rtx else NVLINK_GBS_PER_LINK
    links, uniform = min(counts), len(set(counts)) == 1
    kind = "nvswitch" if n > 4 and uniform else "nvlink"
    gbs = links * per_link
    if uniform:
        how = "switch inferred from >4 fully connected GPUs" if kind == "nvswitch" else \
            "a direct mesh or a switch cannot be told apart"
        found = f"every GPU pair is NV{links}: {kind} ({how})"
    else:
        found = (f"every GPU pair is joined by NVLink, NV{links} to NV{max(counts)} links: nvlink (a direct mesh; "
                 "a switch would give every pair the same count)")
    slowest = "" if uniform else f" (the slowest pair's NV{links}: a ring over all {n} GPUs runs at its speed)"
    return kind, gbs, [found, f"node.intra_bandwidth_gbs = {gbs:g}: {links} links × {per_link:g} GB/s per link per "
                       f"direction assumed ({'RTX bridge' if rtx else 'NVLink 2–4'}){slowest}"]


def _from_nics(d: Draft, topo: Topology) -> None:
    if not topo.nics:
        d.network["fabric"] = "ethernet"
        d.assumed.append("network.fabric = ethernet: topo -m shows no RDMA NICs (sockets)")
        return
    names = ", ".join(topo.nics)
    close = sum(1 for paths in topo.gpu_nic.values() if any(p in ("PIX", "PXB") for p in paths))
    d.found.append(f"{len(topo.nics)} NICs ({names}); {close} of {len(topo.gpus)} GPUs share a PCIe switch "
                   "with one (GPUDirect RDMA friendly)")
    if all(x.startswith("mlx5") for x in topo.nics):
        d.network["fabric"] = "infiniband"
        d.nccl["NCCL_IB_HCA"] = "mlx5"
        d.assumed.append("network.fabric = infiniband: mlx5 ports can be InfiniBand or RoCE (check `ibstat`: "
                         "Link layer)")
    else:
        d.unknown.append(f"network.fabric: NICs {names} not recognised")


def _slurm_site(d: Draft, slurm: list[SlurmNode]) -> None:
    d.scheduler = {"kind": "slurm", "gpu_directive": "gpus-per-node"}
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
    d.assumed.append("scheduler.gpu_directive = gpus-per-node: both --gpus-per-node and --gres work with GRES")
    d.unknown.append("network.bandwidth_gbs, network.latency_us: not printed by these tools "
                     "(ibstat gives each port's rate; add them up for the node)")
    d.unknown.append("storage.run_root: a folder every node sees")
    d.storage["run_root"] = "$HOME/hpcx-runs"


def _local_site(d: Draft, host: Host | None) -> None:
    """No Slurm: a `local` site; jobs run on this machine, one process per GPU (NCCL), no network."""
    d.scheduler = {"kind": "local", "gpu_directive": "none"}
    d.network = {"fabric": "none"}
    d.nccl.pop("NCCL_IB_HCA", None)
    d.assumed = [a for a in d.assumed if not a.startswith("network.fabric")]
    d.storage["run_root"] = "~/hpcx-runs"
    gpus = d.node.get("gpus") or 0
    d.found.append("no Slurm: a `local` site; `hpcx submit` runs the job on this machine"
                   + (f", one process per GPU ({gpus}, NCCL)" if gpus else ", CPU processes (gloo)"))
    if host is None:
        d.unknown.append("node.cpus, node.memory_gb: this machine's were not read (detect from saved files)")
        return
    d.node["cpus"] = host.cpus
    d.node["memory_gb"] = host.memory_gb
    d.found.append(f"this machine: {host.cpus} CPUs (os.cpu_count), {host.memory_gb:g} GB memory (MemTotal)")


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    text = shown(str(v), 1000)  # printable: what a tool printed may hold escapes a profile refuses
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _comment(kind: str, text: str) -> list[str]:
    """``# kind: text`` as comment lines: every line of a message of several lines (a tool's stderr)
    commented, unprintable characters escaped (TOML comments hold no control characters)."""
    lines = str(text).splitlines() or [""]
    return [f"# {kind}: {shown(lines[0], 1000)}"] + [f"#   {shown(line, 1000)}" for line in lines[1:]]


def render_toml(d: Draft) -> str:
    """The draft as a site profile file, with what was found, assumed and not known as comments. It
    always parses as TOML: every comment line starts with `#`, every string value is escaped."""
    out = [f"# Site profile draft for {shown(d.name)!r}, written by `hpcx site detect`. Check every value."]
    out += [line for f in d.found for line in _comment("found", f)]
    out += [line for a in d.assumed for line in _comment("assumed", a)]
    out += [line for u in d.unknown for line in _comment("unknown", u)]
    for section in ("scheduler", "node", "network", "nccl", "storage"):
        table = getattr(d, section)
        if table:
            out += ["", f"[{section}]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- `hpcx site detect`


def detect_site(name: str, topo: str | None, query: str | None, scontrol: str | None) -> str:
    """The draft profile's TOML, from this node's nvidia-smi and scontrol or from the saved outputs
    given (paths); ConfigError when an output does not parse or the GPU matrix is refused."""
    problems: list[str] = []
    topo_text = _text(topo, ["nvidia-smi", "topo", "-m"], problems)
    query_text = _text(query, QUERY_COMMAND, problems)
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    slurm_text = _text(scontrol, ["scontrol", "show", "node", node], problems)
    parsed_topo = _parse(parse_topo, topo_text, topo or "`nvidia-smi topo -m`")
    parsed_query = _parse(parse_query_gpu, query_text, query or "`nvidia-smi --query-gpu`")
    parsed_slurm = _parse(parse_scontrol_nodes, slurm_text, scontrol or "`scontrol show node`")
    host = None if topo or query else Host.here()  # this machine's CPUs and memory, when it is the GPU node
    try:
        draft = draft_site(name, parsed_topo, parsed_query, parsed_slurm or None, host)
    except ValueError as exc:
        raise ConfigError([f"{topo or 'nvidia-smi'}: {exc}"]) from None
    draft.unknown[:0] = problems
    return render_toml(draft)


def _text(path: str | None, command: list[str], problems: list[str]) -> str | None:
    if path:
        try:
            return Path(path).read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise ConfigError([f"{path}: cannot read: {exc}"]) from None
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        problems.append(f"could not run `{' '.join(command)}`: {exc}")
        return None
    if done.returncode != 0:
        problems.append(f"`{' '.join(command)}` exited {done.returncode}: {done.stderr.strip()[:200]}")
        return None
    return done.stdout


def _parse(parser: tp.Callable[[str], tp.Any], text: str | None, source: str) -> tp.Any:
    """Parsed output, or None when there was none; output that does not parse is refused (a draft built
    on half of it would be confidently wrong)."""
    if text is None:
        return None
    try:
        return parser(text)
    except ValueError as exc:
        raise ConfigError([f"{source}: {exc}"]) from None

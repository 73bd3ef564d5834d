"""hpcx's NCCL model (hpc.plan.collectives), checked three ways: it reproduces the tuning table NCCL itself
printed in a recorded log, its hierarchical ring matches the rings NCCL built in the recorded 2-node
H100 logs, and it lands near published nccl-tests figures (tests/data/published, sources there)."""

from __future__ import annotations

import math
import re

import pytest

from hpc.plan import collectives as nc
from hpc.plan.comm import Group, group_topology
from hpc.core import nccl
from hpc.core.site import parse_site

from tests.conftest import REPO, RECORDED

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

A100_PAIR = "nccl-debug-info_1node-2x-a100-80gb-pcie-nvlink-bridge_nccl-2.27.7_p2p-direct-pointer_nccl-tests.txt"
H100_2NODE = {"nccl-debug-info_2node-h100_nccl-2.27.5_net-ib-roce-gdrdma_p2p-ipc.txt": range(8, 16),
              "nccl-debug-info_2node-h100_nccl-2.29.3_net-ib-roce-gdrdma_p2p-ipc.txt": range(0, 8)}
PUBLISHED = REPO / "tests" / "data" / "published" / "nccl-tests-figures.toml"
KINDS = {"AllReduce": "all_reduce", "AllGather": "all_gather", "ReduceScatter": "reduce_scatter"}


# --- NCCL's own tuning table, recorded ------------------------------------------------------------

def recorded_table(path) -> dict[tuple[str, str, str], tuple[float, float]]:
    """{(function, algorithm, protocol): (latency µs, bandwidth GB/s)} from the first tuning block rank 0
    printed (NCCL_DEBUG_SUBSYS=TUNING): the Tree, Ring and CollNetDirect columns."""
    lines = path.read_text(errors="replace").splitlines()
    start = next(i for i, line in enumerate(lines) if re.search(r"\[0\] NCCL INFO\s+Algorithm\s+\|\s+Tree", line))
    algos = re.findall(r"(\w+)\s+\|", lines[start].split("Algorithm", 1)[1])
    table = {}
    for line in lines[start + 3:start + 12]:
        m = re.search(r"\[0\] NCCL INFO\s+(\w+) \|(.*)", line)
        if not m or m.group(1) not in KINDS and m.group(1) not in ("Broadcast", "Reduce"):
            continue
        cells = re.findall(r"([\d.]+)/\s*([\d.]+)", m.group(2))
        for i, (lat, bw) in enumerate(cells):
            table[(m.group(1), algos[i // 3].lower(), nc.PROTOCOLS[i % 3])] = (float(lat), float(bw))
    return table


def a100_pair() -> nc.Topology:
    """The recorded machine as NCCL saw it: 2 ranks on one node over NVLink (``type NVL``), the ring
    graph 12 channels × 20 GB/s, the tree graph 12 × 40 GB/s (``Pattern 4 … nChannels 12, bw 20``,
    ``Pattern 1 … bw 40``), Ampere; hop latency NCCL's own NVLink Simple ring figure (3.4 µs)."""
    return nc.Topology(ranks=2, nodes=1, intra="nvlink", ring_gbs=240.0, tree_gbs=480.0, intra_latency_us=3.4,
                       inter_latency_us=14.0, channels=12, generation="ampere", nvls=False)


def test_the_model_reproduces_ncclS_recorded_tuning_table():
    table = recorded_table(RECORDED / A100_PAIR)
    topo, checked = a100_pair(), 0
    for (func, algo, proto), (lat, bw) in table.items():
        if func not in KINDS or algo not in ("tree", "ring"):
            continue
        p = nc.PROTOCOLS.index(proto)
        if not nc.enabled(KINDS[func], algo, p, topo):
            assert bw == 0.0, (func, algo, proto)
            continue
        bus = nc.bus_gbs(KINDS[func], algo, p, topo)
        assert nc.algorithm_bandwidth(KINDS[func], algo, bus, 2) == pytest.approx(bw, abs=0.051), (func, algo, proto)
        assert nc.latency_us(KINDS[func], algo, p, topo) == pytest.approx(lat, abs=0.051), (func, algo, proto)
        checked += 1
    assert checked == 3 * 3 + 3  # ring × 3 functions × 3 protocols, tree all-reduce × 3 protocols


# --- the hierarchical ring, as NCCL built it ------------------------------------------------------

@pytest.mark.parametrize("name", sorted(H100_2NODE))
def test_recorded_rings_cross_each_node_once(name):
    """Every one of NCCL's 16 rings over 2 × 8 H100 enters and leaves this node once (NET/IB) and runs
    7 hops inside it (P2P/IPC): of a ring's 16 hops, 2 cross nodes, so only those pay the fabric's latency."""
    lines = (RECORDED / name).read_text(errors="replace").splitlines()
    rings_done = next(i for i, line in enumerate(lines) if "Connected all rings" in line)
    local = H100_2NODE[name]
    per_channel: dict[int, list] = {}
    for c in nccl.parse_lines(lines[:rings_done]).connections:
        per_channel.setdefault(c.channel, []).append(c)
    assert len(per_channel) == 16
    for channel, conns in per_channel.items():
        inside = [c for c in conns if c.src in local and c.dst in local]
        out = [c for c in conns if c.direction == "send" and c.src in local and c.dst not in local]
        into = [c for c in conns if c.direction == "receive" and c.dst in local and c.src not in local]
        assert (len(inside), len(out), len(into)) == (7, 1, 1), channel
        assert all(c.transport == "P2P/IPC" for c in inside) and all(c.transport == "NET/IB" for c in out + into)
    # the model charges exactly those: 2(p-1) steps, 2(n-1) of them across nodes
    topo = nc.Topology(16, 2, "nvlink", 370.0, 370.0, 3.4, 14.0, generation="hopper")
    simple = nc.latency_us("all_reduce", "ring", 2, topo)
    assert simple == pytest.approx(8.4 + (30 - 2) * 3.4 + 2 * 14.0)


def test_tree_latency_grows_with_log2_of_the_nodes_and_the_ring_linearly():
    def topo(nodes):
        return nc.Topology(8 * nodes, nodes, "nvlink", 370.0, 370.0, 3.4, 14.0, generation="hopper")

    tree = [nc.latency_us("all_reduce", "tree", 2, topo(n)) for n in (2, 4, 8, 16, 64)]
    steps = [b - a for a, b in zip(tree, tree[1:])]
    assert steps[:3] == pytest.approx([2 * 14.0] * 3)  # one more level of the tree per doubling
    assert tree[-1] - tree[-2] == pytest.approx(2 * 2 * 14.0)  # 16 -> 64 nodes: two levels
    # the ring: 2·511 steps at 64 nodes, 2·63 of them across nodes, the rest at NVLink's hop
    assert nc.latency_us("all_reduce", "ring", 2, topo(64)) == pytest.approx(8.4 + (1022 - 126) * 3.4 + 126 * 14.0)
    big = nc.latency_us("all_reduce", "ring", 2, topo(64), nbytes=2**30)  # NCCL's ring plateau, ×1.4
    assert big == pytest.approx(1.4 * (8.4 + (1022 - 126) * 3.4 + 126 * 14.0))


def test_the_pick_changes_with_size_as_ncclS_does():
    """Many nodes: tree (LL) for small messages, ring or NVLS tree for large; one NVSwitch node: NVLS."""
    many = nc.Topology(512, 64, "nvlink", 370.0, 370.0, 3.4, 14.0, generation="hopper", nvls=True)
    assert nc.best("all_reduce", 8, many).label == "tree/LL"
    assert nc.best("all_reduce", 4 * 2**30, many).algorithm in ("ring", "nvls_tree")
    node = nc.Topology(8, 1, "nvlink", 370.0, 370.0, 3.4, 14.0, generation="hopper", nvls=True)
    assert nc.best("all_reduce", 4 * 2**30, node).algorithm == "nvls"
    assert nc.best("all_gather", 4 * 2**30, node).label == "ring/Simple"  # NVLS all-gather moves less per channel
    ampere = nc.Topology(8, 1, "nvlink", 240.0, 240.0, 3.4, 14.0, generation="ampere", nvls=False)
    assert nc.best("all_reduce", 4 * 2**30, ampere).algorithm == "ring"


def test_bus_bandwidth_is_ncclTests_definition():
    """A large ring all-reduce's busBw (algBw × 2(p-1)/p) is the ring's bus bandwidth."""
    topo = nc.Topology(32, 4, "nvlink", 400.0, 400.0, 3.4, 14.0, generation="hopper", algorithms=("ring",))
    e = nc.best("all_reduce", 16 * 2**30, topo)
    bus = 16 * 2**30 / e.seconds / 1e9 * nc.bus_factor("all_reduce", 32)
    assert bus == pytest.approx(400.0, rel=0.01) and nc.bus_factor("all_gather", 32) == pytest.approx(31 / 32)


def test_the_site_maps_to_ncclS_inputs():
    doc = {"scheduler": {"kind": "slurm"}, "network": {"fabric": "infiniband", "bandwidth_gbs": 400, "latency_us": 5},
           "node": {"gpus": 8, "gpu_model": "NVIDIA H100 80GB HBM3", "gpu_memory_gb": 80, "intra_link": "nvswitch",
                    "intra_bandwidth_gbs": 450, "intra_latency_us": 3}}
    site = parse_site(doc, "h", "<test>")
    world = group_topology(Group(32, 8), site, 8)
    assert (world.ranks, world.nodes, world.ring_gbs, world.tree_gbs, world.net_gbs) == (32, 4, 400, 400, 400)
    assert world.generation == "hopper" and world.nvls
    pair = group_topology(Group(16, 8), site, 8)
    assert pair.tree_gbs == 450  # two nodes: the tree may use twice the 400 GB/s share, up to NVLink's 450
    replicas = group_topology(Group(4, 1), site, 8)  # HSDP's cross-replica groups, 8 side by side
    assert (replicas.ring_gbs, replicas.per_node, replicas.net_gbs) == (50, 1, 50)
    # ppn = 1: NCCL charges the tree's network latency (exposed), scaled to the site's 5 µs hop
    assert nc.latency_us("all_reduce", "ring", 2, replicas) == pytest.approx(8.4 + 6 * 14.0 * 5 / 14)


# --- published nccl-tests figures -------------------------------------------------------------------

FIGURES = tomllib.loads(PUBLISHED.read_text())["figure"]


def figure_topology(f: dict) -> nc.Topology:
    nodes, ppn = f["nodes"], f["gpus_per_node"]
    ring = f["intra_gbs"] if nodes == 1 else min(f["intra_gbs"], f["net_gbs"])
    tree = min(f["intra_gbs"], 2 * f["net_gbs"]) if nodes == 2 else ring
    algos = tuple(f["algorithms"]) or ("ring", "tree", "nvls", "nvls_tree")
    nvls = f["nvswitch"] and f["generation"] in ("hopper", "blackwell")
    net = f["net_gbs"] if nodes > 1 else 0.0
    return nc.Topology(nodes * ppn, nodes, "nvlink", ring, tree, 3.4, 14.0, 16, f["generation"], nvls, algos, net)


@pytest.mark.parametrize("f", FIGURES, ids=[f["id"] for f in FIGURES])
def test_published_figures(f):
    topo = figure_topology(f)
    e = nc.best("all_reduce", f["bytes"], topo)
    if "busbw_gbs" in f:
        bus = f["bytes"] / e.seconds / 1e9 * nc.bus_factor("all_reduce", topo.ranks)
        assert bus == pytest.approx(f["busbw_gbs"], rel=f["tolerance"]), (e.label, bus)
    else:
        assert e.seconds * 1e6 == pytest.approx(f["time_us"], rel=f["tolerance"]), e.label
    assert f["source"].startswith("https://github.com/") and f["quote"]


def test_published_figures_cover_one_two_and_many_nodes():
    nodes = {f["nodes"] for f in FIGURES}
    assert {1, 2, 4, 8} <= nodes and max(nodes) >= 64
    assert any("time_us" in f and f["nodes"] == 1 for f in FIGURES)
    assert any("time_us" in f and f["nodes"] == 2 for f in FIGURES)
    assert math.isclose(nc.bus_factor("all_reduce", 2), 1.0)

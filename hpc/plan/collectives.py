"""The time of one NCCL collective, from NCCL's own tuning model (``src/graph/tuning.cc``).

NCCL estimates every (algorithm, protocol) pair as ``latency + bytes / algorithm bandwidth`` and runs
the fastest. hpcx keeps that shape and these of its terms (the constants are NCCL 2.2x's defaults):

- **algorithms**: ring (all-reduce, all-gather, reduce-scatter), tree (all-reduce only), NVLS
  (NVLink SHARP, one NVSwitch node of Hopper or later) and NVLS tree (all-reduce across NVSwitch
  nodes). CollNet (SHARP in the switch) and PAT (one GPU per node) are not modelled.
- **protocols**: LL, LL128 and Simple, each with NCCL's base latency and its bandwidth factors
  (LL halves the bus bandwidth and is capped, LL128 keeps 92 %; tree caps per channel).
- **latency**: the ring is hierarchical: of its ``2(p-1)`` all-reduce steps (``p-1`` for all-gather
  and reduce-scatter) only ``2(n-1)`` (``n-1``) cross nodes and pay the fabric's hop latency, the
  others pay the intra-node link's (at least NCCL's 3 µs proxy overhead on multi-node rings; ×1.4
  on large multi-node ring all-reduces, NCCL's "plateau"). The tree pays ``2((p/n-1)·intra +
  log2(n)·inter)``; NVLS one NVLink hop (+ ``2·log2(n)`` fabric hops for NVLS tree).
- **hop latencies**: NCCL's per-algorithm, per-protocol hardware latencies for NVLink, PCIe and the
  network, scaled so that a Simple ring hop costs the site's ``node.intra_latency_us`` inside a node
  and ``network.latency_us`` across nodes (NCCL's own values are 3.4, 5.7 and 14 µs).
- **bandwidth**: the ring's bus bandwidth is ``nChannels × per-channel bandwidth``, which hpcx takes
  as the smaller of the intra-node link and the node's network share (``hpc.plan.comm.group_link``);
  the algorithm bandwidth is bus bandwidth × ``p / nsteps`` (ring, NVLS) or × 1/2 (tree), so a ring
  all-reduce of ``M`` bytes moves ``2(p-1)/p · M`` through each link: nccl-tests' ``busBw``.
  On two nodes the tree (and NVLS tree) may run at twice the network share, as NCCL allows.
- **chunk pipelining**: a collective's latency is paid once per call, not once per chunk: chunks
  stream through the ring, so the bandwidth term is the whole message over the bus bandwidth.

Pure Python, no torch: the planner calls it for every collective of every candidate layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1e9
PROTOCOLS = ("LL", "LL128", "Simple")
# tuning.cc baseLatencies (µs) per protocol (LL, LL128, Simple)
BASE_LATENCY_US = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4), "nvls": (0.0, 0.0, 0.0),
                   "nvls_tree": (0.0, 0.0, 0.0)}
# tuning.cc hwLatencies (µs): per hop, by hardware class, algorithm and protocol
HW_LATENCY_US = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "nvls": (0.0, 0.0, 25.0),
               "nvls_tree": (0.0, 0.0, 25.0)},
    "pcie": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7), "nvls": (0.0, 0.0, 0.0), "nvls_tree": (0.0, 0.0, 0.0)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0), "nvls": (0.0, 0.0, 18.0),
            "nvls_tree": (0.0, 0.0, 20.9)},
}
NET_OVERHEAD_US = 1.0  # getNetOverhead (Intel x86); ×3 for Simple: a multi-node ring step costs at least this
RING_PLATEAU = 1.4  # ring Simple all-reduce latency factor across nodes on compute capability ≥ 8.0
# per GPU generation (tuning.cc): LL's bandwidth cap by node count (1, 2, >2), per-channel caps
LL_MAX_GBS = {"volta": (39.0, 39.0, 20.4), "ampere": (87.7, 22.5, 19.0), "hopper": (141.0, 45.0, 35.0),
              "blackwell": (282.0, 90.0, 70.0)}
RING_LL128_PER_CHANNEL = {"volta": (20.0,) * 3, "ampere": (20.0,) * 3, "hopper": (36.7,) * 3,
                          "blackwell": (40.0,) * 3}
TREE_LL128_PER_CHANNEL = {"volta": (20.0,) * 3, "ampere": (20.0,) * 3, "hopper": (36.7, 36.7, 29.0),
                          "blackwell": (55.6, 31.67, 20.0)}
TREE_PER_CHANNEL = {"volta": (26.5, 18.5, 10.0), "ampere": (24.0, 23.6, 17.8), "hopper": (38.7, 41.4, 36.0),
                    "blackwell": (70.0, 42.8, 24.0)}
NVLS_TREE_PER_CHANNEL = {"hopper": (0.0, 57.7, 45.5), "blackwell": (0.0, 96.0, 80.0)}
NVLS_EFFICIENCY = {"hopper": 0.85, "blackwell": 0.74}
# treeCorrectionFactor: tree bandwidth at medium sizes, powers of two from 64 B
TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
}


@dataclass(frozen=True)
class Topology:
    """What NCCL's tuning reads about one communicator: ``ranks`` over ``nodes``, bus bandwidths (GB/s)
    and Simple-ring hop latencies (µs) inside and across nodes."""

    ranks: int
    nodes: int
    intra: str  # NCCL's hardware class of the intra-node path: "nvlink" or "pcie"
    ring_gbs: float  # ring bus bandwidth: nChannels × per-channel bandwidth
    tree_gbs: float  # tree bus bandwidth before NCCL's caps (on two nodes up to twice the network share)
    intra_latency_us: float
    inter_latency_us: float
    channels: int = 16
    generation: str = "ampere"  # NCCL's compute-capability class: volta, ampere, hopper, blackwell
    nvls: bool = False  # NVLink SHARP: an NVSwitch node of Hopper or later
    algorithms: tuple[str, ...] = ("ring", "tree", "nvls", "nvls_tree")
    net_gbs: float = 0.0  # the group's share of a node's network (NVLS tree's inter-node term); 0: ring_gbs

    @property
    def per_node(self) -> float:
        return self.ranks / max(1, self.nodes)


@dataclass(frozen=True)
class Estimate:
    """One call: the algorithm and protocol NCCL would pick, and its time split in two."""

    algorithm: str
    protocol: str
    latency_s: float
    bandwidth_s: float
    bus_gbs: float  # the bus bandwidth of the pick (nccl-tests' busBw at large sizes)

    @property
    def seconds(self) -> float:
        return self.latency_s + self.bandwidth_s

    @property
    def label(self) -> str:
        return f"{self.algorithm}/{self.protocol}"


def nsteps(kind: str, p: int) -> int:
    """NCCL's steps of a ring collective over ``p`` ranks."""
    return 2 * (p - 1) if kind == "all_reduce" else p - 1


def bus_factor(kind: str, p: int) -> float:
    """nccl-tests' busBw / algBw (doc/PERFORMANCE.md): 2(p-1)/p for all-reduce, (p-1)/p for
    all-gather and reduce-scatter; the bytes each rank sends per byte of the (full) message."""
    return nsteps(kind, p) / p if p > 1 else 0.0


def _node_index(nodes: int) -> int:
    return 0 if nodes <= 1 else (1 if nodes == 2 else 2)


def _hop_us(topo: Topology, where: str, algo: str, proto: int) -> float:
    """NCCL's per-hop hardware latency, scaled to the site's Simple ring hop."""
    if where == "net":
        return HW_LATENCY_US["net"][algo][proto] * topo.inter_latency_us / HW_LATENCY_US["net"]["ring"][2]
    table = HW_LATENCY_US[topo.intra]
    return table[algo][proto] * topo.intra_latency_us / table["ring"][2]


def latency_us(kind: str, algo: str, proto: int, topo: Topology, nbytes: float = 0.0) -> float:
    """NCCL's latency of one call (tuning.cc ``latencies`` and the ring plateau of ``getAlgoTime``)."""
    p, n = topo.ranks, topo.nodes
    base = BASE_LATENCY_US[algo][proto]
    intra = _hop_us(topo, "intra", algo, proto)
    inter = _hop_us(topo, "net", "tree" if topo.per_node == 1 else algo, proto)
    if algo == "ring":
        if n > 1:
            intra = max(intra, NET_OVERHEAD_US * (3 if proto == 2 else 1))
        inter_steps = 0 if n == 1 else nsteps(kind, n)
        lat = base + (nsteps(kind, p) - inter_steps) * intra + inter_steps * inter
        big = nbytes / (topo.channels * p) >= 64
        return lat * RING_PLATEAU if proto == 2 and n > 1 and kind == "all_reduce" and big else lat
    if algo == "tree":
        return base + 2 * ((topo.per_node - 1) * intra + math.log2(n) * inter)
    if algo == "nvls":
        return intra
    return base + intra + 2 * math.log2(n) * inter  # nvls_tree


def bus_gbs(kind: str, algo: str, proto: int, topo: Topology) -> float:
    """NCCL's bus bandwidth of (algorithm, protocol) for this communicator; 0 where it does not run."""
    i, gen, ch = _node_index(topo.nodes), topo.generation, topo.channels
    if algo == "ring":
        bw = topo.ring_gbs
        if proto == 0:
            return min(LL_MAX_GBS[gen][i], bw * 0.5)
        return min(bw * 0.92, ch * RING_LL128_PER_CHANNEL[gen][i]) if proto == 1 else bw
    if algo == "tree":
        bw = min(topo.tree_gbs * 0.92, ch * TREE_PER_CHANNEL[gen][i])
        if proto == 0:
            return min(bw / 3.8, LL_MAX_GBS[gen][i])
        if proto == 1:
            return min(bw * (7 / 9 if topo.nodes == 1 else 120 / 128), ch * TREE_LL128_PER_CHANNEL[gen][i])
        return bw
    return _nvls_gbs(kind, algo, topo)


def _nvls_gbs(kind: str, algo: str, topo: Topology) -> float:
    """NVLS: each of ``ppn`` channels pulls from one GPU through the switch (efficiency, one channel
    spent); all-reduce pipelines two operations. NVLS tree is capped by the network and per channel."""
    ppn = topo.per_node
    ch = max(2, min(int(ppn), 32))
    per_channel = topo.ring_gbs / ch * NVLS_EFFICIENCY[topo.generation] * (ch - 1) / ch
    per_channel *= 2.0 if kind == "all_reduce" else (ppn - 1) / ppn
    if algo == "nvls":
        return ch * per_channel
    net = (topo.net_gbs or topo.ring_gbs) * (2 if topo.nodes <= 2 else 1) / ch  # doubled on two nodes, as NCCL does
    return ch * min(per_channel, net, NVLS_TREE_PER_CHANNEL[topo.generation][_node_index(topo.nodes)])


def enabled(kind: str, algo: str, proto: int, topo: Topology) -> bool:
    """Which (algorithm, protocol) NCCL considers here (tuning.cc's loops and its disable rules)."""
    if algo not in topo.algorithms:
        return False
    if algo in ("nvls", "nvls_tree"):
        return proto == 2 and topo.nvls and (algo == "nvls") == (topo.nodes == 1) and topo.per_node > 1 \
            and (kind == "all_reduce" or algo == "nvls")
    if algo == "tree":
        return kind == "all_reduce"
    return True


def algorithm_bandwidth(kind: str, algo: str, bus: float, p: int) -> float:
    """Bus bandwidth to algorithm bandwidth (bytes of the message per second), as tuning.cc converts."""
    if algo != "ring" and kind != "all_reduce":
        return bus  # NVLS all-gather and reduce-scatter: already per message byte
    if algo == "tree":
        return bus * 0.5
    return bus * p / nsteps(kind, p)


def call_time(kind: str, algo: str, proto: int, nbytes: float, topo: Topology) -> Estimate | None:
    """NCCL's ``getAlgoTime`` for one call of ``nbytes`` (the full message); None where it does not run."""
    if not enabled(kind, algo, proto, topo):
        return None
    bus = bus_gbs(kind, algo, proto, topo)
    if bus <= 0:
        return None
    algbw = algorithm_bandwidth(kind, algo, bus, topo.ranks)
    size_class = int(math.log2(nbytes / 64)) if nbytes >= 64 else -1
    if algo == "tree" and 0 <= size_class < 23:
        algbw *= TREE_CORRECTION[PROTOCOLS[proto]][size_class]
    lat = latency_us(kind, algo, proto, topo, nbytes) * 1e-6
    return Estimate(algo, PROTOCOLS[proto], lat, nbytes / (algbw * GB), bus)


def best(kind: str, nbytes: float, topo: Topology) -> Estimate | None:
    """The fastest (algorithm, protocol) for one call of ``nbytes``: what NCCL runs; None when the
    communicator has one rank or no known bandwidth."""
    if topo.ranks <= 1 or topo.ring_gbs <= 0:
        return None
    options = [call_time(kind, a, p, nbytes, topo) for a in topo.algorithms for p in range(3)]
    return min((e for e in options if e is not None), key=lambda e: e.seconds, default=None)


def generation(gpu_model: str, peak_tflops: float = 0.0) -> str:
    """NCCL's compute-capability class from a GPU model name, else from the dense bf16 peak (≥ 1500
    TFLOP/s Blackwell, ≥ 500 Hopper); ampere when neither tells (no NVLS assumed)."""
    name = gpu_model.upper()
    if not name.strip():
        return "blackwell" if peak_tflops >= 1500 else "hopper" if peak_tflops >= 500 else "ampere"
    if any(k in name for k in ("B100", "B200", "B300", "GB200", "GB300")):
        return "blackwell"
    if any(k in name for k in ("H100", "H200", "H800", "H20", "GH200")):
        return "hopper"
    if "V100" in name:
        return "volta"
    return "ampere"

"""Communication per optimizer step: bytes each rank sends, timed with a ring α-β model.

A ring collective over ``p`` ranks on a message of ``M`` bytes (the full, unsharded size):

- all-reduce: each rank sends 2(p-1)/p · M; time 2(p-1)/p · M / B + 2(p-1) · α
- all-gather or reduce-scatter: (p-1)/p · M; time (p-1)/p · M / B + (p-1) · α

B is the group's bus bandwidth. Inside a node it is the site's per-GPU intra-node bandwidth.
A ring that crosses nodes carries, through each node's network links, as many bytes as one
rank sends; when ``k`` groups run at once (one per local rank of the orthogonal mesh
dimension), they share the node's links: B = min(intra, network · ranks-per-node-in-group /
tasks-per-node). α is the intra-node or network latency.

Which collectives run (per micro-batch unless said otherwise):

- ddp: one all-reduce of the fp32 gradients per optimizer step (``no_sync`` on the
  accumulation micro-batches), in 25 MB buckets.
- fsdp full_shard: all-gather (compute dtype) in forward, again in backward (except the root,
  which stays gathered), reduce-scatter (fp32) of the gradients.
- fsdp shard_grad_op: one all-gather (forward) and the reduce-scatter.
- hsdp: the fsdp collectives inside the shard group, plus an all-reduce of the sharded fp32
  gradients across the replicas once per optimizer step (FSDP2 ``set_requires_all_reduce(False)``
  on the accumulation micro-batches).
- fsdp no_shard (FSDP2 on a (world, 1) mesh): the all-reduce across replicas, once per step.
- CPU offload adds, every micro-batch, host→GPU copies of the fp32 parameter shard before each
  all-gather and GPU→host copies of the fp32 gradient shard, at HOST_LINK_GBS per GPU.

Each part says which compute it can hide under (``phase``: a micro-batch's forward or backward)
and how often it runs per step (``repeat``); ``hpc.plan.timing`` turns that into a step time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hpc.plan.memory import DDP_BUCKET_BYTES, GB, PARAM_BYTES, REDUCE_BYTES, Config, compute_bytes
from hpc.core.models import ModelFacts
from hpc.core.site import SiteProfile

HOST_LINK_GBS = 25.0  # PCIe Gen4 x16 host<->GPU copies, achieved (assumed; not in the site profile)


@dataclass(frozen=True)
class Group:
    """A communicator: ``size`` ranks, ``per_node`` of them on each node it spans."""

    size: int
    per_node: int

    @property
    def nodes(self) -> int:
        return max(1, self.size // max(1, self.per_node))


@dataclass
class Link:
    """Bandwidth (GB/s) and latency (µs) of one group on a site; bandwidth 0 = unknown."""

    bandwidth_gbs: float
    latency_us: float
    name: str


def group_link(group: Group, site: SiteProfile, tasks_per_node: int) -> Link:
    intra = site.node.intra_bandwidth_gbs
    if group.nodes <= 1:
        return Link(intra, site.node.intra_latency_us, site.node.intra_link)
    net = site.network.bandwidth_gbs * group.per_node / max(1, tasks_per_node)
    bw = min(intra, net) if group.per_node > 1 and intra else net
    return Link(bw, site.network.latency_us, site.network.fabric)


def ring_bytes(kind: str, message: float, p: int) -> float:
    """Bytes each rank sends for one collective on a ``message``-byte (unsharded) tensor."""
    if p <= 1:
        return 0.0
    factor = 2.0 if kind == "all_reduce" else 1.0
    return factor * (p - 1) / p * message


def ring_seconds(kind: str, message: float, p: int, link: Link, calls: int = 1) -> float | None:
    """α-β time of ``calls`` ring collectives that together move ``message`` bytes; None if unknown."""
    if p <= 1:
        return 0.0
    if not link.bandwidth_gbs:
        return None
    steps = (2 if kind == "all_reduce" else 1) * (p - 1) * calls
    return ring_bytes(kind, message, p) / (link.bandwidth_gbs * GB) + steps * link.latency_us * 1e-6


@dataclass
class Part:
    what: str
    gb: float  # sent per rank per optimizer step
    seconds: float | None  # per optimizer step (all ``repeat`` runs)
    link: str
    phase: str = "backward"  # the compute it can hide under: "forward" or "backward" of a micro-batch
    repeat: int = 1  # runs per optimizer step: every micro-batch (grad_accum), or once (the last one's backward)
    unhidden_s: float = 0.0  # per run: the call nothing can overlap (the first gather, the last reduction)


@dataclass
class Comm:
    """Communication of one optimizer step for one rank."""

    parts: list[Part] = field(default_factory=list)

    @property
    def gb(self) -> float:
        return sum(p.gb for p in self.parts)

    @property
    def seconds(self) -> float | None:
        times = [p.seconds for p in self.parts]
        return None if any(t is None for t in times) else sum(times)  # type: ignore[misc]

    @property
    def slowest_link(self) -> str:
        timed = [p for p in self.parts if p.seconds]
        return max(timed, key=lambda p: p.seconds).link if timed else ""


@dataclass(frozen=True)
class Collective:
    """One collective of a step: ``calls`` rings (one per FSDP unit or DDP bucket) over ``message``
    bytes in all; ``edge`` bytes go in the call that cannot overlap compute."""

    what: str
    kind: str
    message: float
    calls: int
    edge: float
    phase: str = "backward"


def _add(comm: Comm, c: Collective, group: Group, link: Link, repeat: int) -> None:
    sent = ring_bytes(c.kind, c.message, group.size) * repeat
    t = ring_seconds(c.kind, c.message, group.size, link, c.calls)
    if sent:
        edge = ring_seconds(c.kind, c.edge, group.size, link) or 0.0
        comm.parts.append(Part(c.what, sent / GB, None if t is None else t * repeat, link.name, c.phase, repeat,
                               edge))


def step_comm(facts: ModelFacts, cfg: Config, site: SiteProfile, nodes: int, tasks_per_node: int,
              grad_accum: int) -> Comm | None:
    """Per-rank communication of one optimizer step; None when the parameter count is unknown."""
    if facts.n_params is None:
        return None
    n, world, root = facts.n_params, nodes * tasks_per_node, facts.root_params or 0
    comm = Comm()
    if cfg.dims.replicated:  # ddp, fsdp no_shard
        everyone = Group(world, tasks_per_node)
        grads = n * REDUCE_BYTES
        if cfg.dims.ddp_enabled:  # 25 MB buckets, the last one after backward
            buckets = math.ceil(grads / DDP_BUCKET_BYTES)
            reduce = Collective("all-reduce gradients", "all_reduce", grads, buckets, min(grads, DDP_BUCKET_BYTES))
        else:  # one all-reduce per FSDP unit; the root's (embeddings) comes last
            reduce = Collective("all-reduce gradients", "all_reduce", grads, facts.n_units + 1, root * REDUCE_BYTES)
        _add(comm, reduce, everyone, group_link(everyone, site, tasks_per_node), 1)
    elif cfg.dims.fsdp_enabled:
        _sharded_comm(comm, facts, cfg, site, tasks_per_node, grad_accum)
    if cfg.offload:
        _offload_copies(comm, facts, cfg, grad_accum)
    return comm


def _offload_copies(comm: Comm, facts: ModelFacts, cfg: Config, grad_accum: int) -> None:
    """FSDP2 CPUOffloadPolicy: each micro-batch copies the fp32 parameter shard to the GPU before each
    all-gather (forward, and backward again under full_shard) and the reduced fp32 gradient shard
    back to the host, over each GPU's own PCIe link."""
    shard, root = (facts.n_params or 0) / cfg.dims.dp_shard, (facts.root_params or 0) / cfg.dims.dp_shard
    gathers = [("forward", "host→GPU parameter shard (offload)")]
    if cfg.dims.reshard_after_forward:
        gathers.append(("backward", "host→GPU parameter shard again (offload)"))
    copies = [(phase, what, PARAM_BYTES) for phase, what in gathers]
    copies.append(("backward", "GPU→host gradient shard (offload)", REDUCE_BYTES))
    bandwidth = HOST_LINK_GBS * GB
    for phase, what, width in copies:
        total = shard * width * grad_accum
        comm.parts.append(Part(what, total / GB, total / bandwidth, "pcie-host", phase, grad_accum,
                               root * width / bandwidth))


def _sharded_comm(comm: Comm, facts: ModelFacts, cfg: Config, site: SiteProfile, tasks_per_node: int,
                  grad_accum: int) -> None:
    """FSDP/HSDP: gathers and reduce-scatters inside the shard group, HSDP's all-reduce across it."""
    n, root, unit, units = facts.n_params or 0, facts.root_params or 0, facts.unit_params or 0, facts.n_units + 1
    c, degree = compute_bytes(cfg.mixed_precision), cfg.dims.dp_shard
    shard = Group(degree, min(degree, tasks_per_node))
    link = group_link(shard, site, tasks_per_node)
    # forward gathers the root first; backward gathers the blocks again (the root stays gathered)
    _add(comm, Collective("all-gather forward", "all_gather", n * c, units, root * c, "forward"), shard, link,
         grad_accum)
    if cfg.dims.reshard_after_forward:
        _add(comm, Collective("all-gather backward", "all_gather", (n - root) * c, units - 1, unit * c), shard,
             link, grad_accum)
    _add(comm, Collective("reduce-scatter gradients", "reduce_scatter", n * REDUCE_BYTES, units,
                          root * REDUCE_BYTES), shard, link, grad_accum)
    replicas = cfg.dims.dp_replicate
    if replicas > 1:
        across = Group(replicas, max(1, tasks_per_node // degree))
        _add(comm, Collective("all-reduce across replicas", "all_reduce", n * REDUCE_BYTES / degree, units,
                              root * REDUCE_BYTES / degree), across, group_link(across, site, tasks_per_node), 1)

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
- CPU offload adds host↔device copies of the shards at HOST_LINK_GBS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hpc.memory import DDP_BUCKET_BYTES, GB, PARAM_BYTES, REDUCE_BYTES, Config, compute_bytes
from hpc.models import ModelFacts
from hpc.site import SiteProfile

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
    seconds: float | None
    link: str


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


def _add(comm: Comm, what: str, kind: str, message: float, group: Group, link: Link, repeat: int,
         calls: int) -> None:
    sent = ring_bytes(kind, message, group.size) * repeat
    t = ring_seconds(kind, message, group.size, link, calls)
    if sent:
        comm.parts.append(Part(what, sent / GB, None if t is None else t * repeat, link.name))


def step_comm(facts: ModelFacts, cfg: Config, site: SiteProfile, nodes: int, tasks_per_node: int,
              grad_accum: int) -> Comm | None:
    """Per-rank communication of one optimizer step; None when the parameter count is unknown."""
    if facts.n_params is None:
        return None
    n, world = facts.n_params, nodes * tasks_per_node
    comm = Comm()
    if cfg.dims.replicated:  # ddp, fsdp no_shard
        everyone = Group(world, tasks_per_node)
        calls = math.ceil(n * REDUCE_BYTES / DDP_BUCKET_BYTES) if cfg.dims.ddp_enabled else facts.n_units + 1
        _add(comm, "all-reduce gradients", "all_reduce", n * REDUCE_BYTES, everyone,
             group_link(everyone, site, tasks_per_node), 1, calls)
    elif cfg.dims.fsdp_enabled:
        _sharded_comm(comm, facts, cfg, site, nodes, tasks_per_node, grad_accum)
    return comm


def _sharded_comm(comm: Comm, facts: ModelFacts, cfg: Config, site: SiteProfile, nodes: int,
                  tasks_per_node: int, grad_accum: int) -> None:
    n, root, units = facts.n_params or 0, facts.root_params or 0, facts.n_units + 1
    c, degree = compute_bytes(cfg.mixed_precision), cfg.dims.dp_shard
    shard = Group(degree, min(degree, tasks_per_node))
    link = group_link(shard, site, tasks_per_node)
    _add(comm, "all-gather forward", "all_gather", n * c, shard, link, grad_accum, units)
    if cfg.dims.reshard_after_forward:
        _add(comm, "all-gather backward", "all_gather", (n - root) * c, shard, link, grad_accum, units - 1)
    _add(comm, "reduce-scatter gradients", "reduce_scatter", n * REDUCE_BYTES, shard, link, grad_accum, units)
    replicas = cfg.dims.dp_replicate
    if replicas > 1:
        across = Group(replicas, max(1, tasks_per_node // degree))
        _add(comm, "all-reduce across replicas", "all_reduce", n * REDUCE_BYTES / degree, across,
             group_link(across, site, tasks_per_node), 1, units)
    if cfg.offload:
        shard_bytes = n / degree * (2 * PARAM_BYTES + REDUCE_BYTES) * grad_accum
        comm.parts.append(Part("host<->GPU copies (offload)", shard_bytes / GB,
                               shard_bytes / (HOST_LINK_GBS * GB), "pcie-host"))

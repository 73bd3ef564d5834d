"""Communication per optimizer step: bytes each rank sends, timed with NCCL's own cost model.

Bytes: a collective over ``p`` ranks on a message of ``M`` bytes (the full, unsharded size) sends
2(p-1)/p · M per rank for an all-reduce and (p-1)/p · M for an all-gather or reduce-scatter
(nccl-tests' bus-bandwidth factors). Time: ``hpc.plan.collectives`` (NCCL's tuning model: ring, tree,
NVLS; LL, LL128, Simple; the fastest per call size) on the group's ``Topology``:

- bus bandwidth: inside a node the site's per-GPU intra-node bandwidth. A ring that crosses nodes
  carries, through each node's network links, as many bytes as one rank sends; when ``k`` groups
  run at once (one per local rank of the orthogonal mesh dimension), they share the node's links:
  B = min(intra, network · ranks-per-node-in-group / tasks-per-node).
- latency: per call (chunks pipeline), intra-node hops at ``node.intra_latency_us`` and only the
  inter-node hops at ``network.latency_us`` (see ``hpc.plan.collectives``).

Which collectives run (per micro-batch unless said otherwise):

- ddp: one all-reduce of the fp32 gradients per optimizer step (``no_sync`` on the
  accumulation micro-batches), in 25 MB buckets.
- fsdp full_shard: all-gather (compute dtype) in forward, again in backward (except final norm +
  head, and the root, which stay gathered: ``ModelFacts.kept_params``; the embedding unit is gathered
  again), reduce-scatter (fp32) of the gradients.
- fsdp shard_grad_op: one all-gather (forward) and the reduce-scatter.
- hsdp: the fsdp collectives inside the shard group, plus an all-reduce of the sharded fp32
  gradients across the replicas once per optimizer step (FSDP2 ``set_requires_all_reduce(False)``
  on the accumulation micro-batches).
- fsdp no_shard (FSDP2 on a (world, 1) mesh): the all-reduce across replicas, once per step.
- tensor parallelism (``tp`` > 1, with sequence parallelism as torchtitan applies it) adds, every
  micro-batch, inside the tp group of one node: per block in forward two all-gathers (the inputs
  of attention and MLP) and two reduce-scatters (their outputs) of tokens × dim in the compute
  dtype, plus the head's input all-gather and the embedding's reduce-scatter; backward runs the
  same the other way round, and the recomputed forward (activation checkpointing) again. They wait
  on the layer before and after them, so none of their time hides under compute (``unhidden_s``).
  FSDP's collectives then run over the data-parallel shard group on ``1/tp`` of each unit, with
  ``tasks_per_node / tp`` ranks of a group on each node.
- LoRA (``[lora]``): the gradient collectives (all-reduces, reduce-scatters) carry the trained share
  of the parameters only (``memory.trained_share``: DDP buckets and FSDP2 reduces only parameters
  that require gradients); the all-gathers carry them all.
- CPU offload adds, every micro-batch, host→GPU copies of the fp32 parameter shard before each
  all-gather and GPU→host copies of the fp32 gradient shard, at HOST_LINK_GBS per GPU.

Each part says which compute it can hide under (``phase``: a micro-batch's forward or backward)
and how often it runs per step (``repeat``); ``hpc.plan.timing`` turns that into a step time.
"""

from __future__ import annotations

import dataclasses
import math
import typing as tp
from dataclasses import dataclass, field

from hpc.plan import collectives
from hpc.plan.memory import (DDP_BUCKET_BYTES, GB, PARAM_BYTES, REDUCE_BYTES, Config, compute_bytes, sharded_numel,
                             trained_share)
from hpc.core.models import ModelFacts, family_of
from hpc.core.models.tp_plan import tp_plan_of
from hpc.core.site import SiteProfile, nvlink_bandwidth, nvlink_domain

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
    """The group's bus bandwidth and its link: one node's, or the node's network share across nodes."""
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
    """The textbook α-β ring: every step at one latency (``link.latency_us``); None if unknown. Kept for
    comparison: the planner times collectives with ``hpc.plan.collectives`` (hierarchical ring, tree, NVLS)."""
    if p <= 1:
        return 0.0
    if not link.bandwidth_gbs:
        return None
    steps = (2 if kind == "all_reduce" else 1) * (p - 1) * calls
    return ring_bytes(kind, message, p) / (link.bandwidth_gbs * GB) + steps * link.latency_us * 1e-6


def group_topology(group: Group, site: SiteProfile, tasks_per_node: int) -> collectives.Topology:
    """What NCCL's tuning model sees of ``group`` on ``site``: its bus bandwidths and hop latencies."""
    link = group_link(group, site, tasks_per_node)
    ring = link.bandwidth_gbs
    tree = ring
    if group.nodes == 2:  # NCCL's trees on two nodes can use twice the network share (tuning.cc)
        net = 2 * site.network.bandwidth_gbs * group.per_node / max(1, tasks_per_node)
        tree = min(site.node.intra_bandwidth_gbs, net) if group.per_node > 1 and site.node.intra_bandwidth_gbs else net
    node = site.node
    share = site.network.bandwidth_gbs * group.per_node / max(1, tasks_per_node) if group.nodes > 1 else 0.0
    nvlink = node.intra_link in ("nvswitch", "nvlink")
    gen = collectives.generation(node.gpu_model, node.gpu_peak_tflops)
    return collectives.Topology(
        ranks=group.size, nodes=group.nodes, intra="nvlink" if nvlink else "pcie", ring_gbs=ring, tree_gbs=tree,
        intra_latency_us=node.intra_latency_us, inter_latency_us=site.network.latency_us,
        channels=16 if nvlink else 4, generation=gen,
        nvls=node.intra_link == "nvswitch" and gen in ("hopper", "blackwell"),
        algorithms=("ring", "tree", "nvls", "nvls_tree") if node.gpus else ("ring",), net_gbs=share)


@dataclass(frozen=True)
class Timing:
    """``calls`` calls of one collective as NCCL would run them: the pick per call, summed."""

    algorithm: str  # e.g. "tree/LL128"; the edge call may differ
    latency_s: float
    bandwidth_s: float

    @property
    def seconds(self) -> float:
        return self.latency_s + self.bandwidth_s


def collective_seconds(kind: str, message: float, calls: int, topo: collectives.Topology) -> Timing | None:
    """``calls`` equal calls moving ``message`` bytes in all; None where a bandwidth is unknown."""
    if topo.ranks <= 1:
        return Timing("", 0.0, 0.0)
    est = collectives.best(kind, message / max(1, calls), topo)
    if est is None:
        return None
    return Timing(est.label, est.latency_s * calls, est.bandwidth_s * calls)


@dataclass
class Part:
    what: str
    gb: float  # sent per rank per optimizer step
    seconds: float | None  # per optimizer step (all ``repeat`` runs)
    link: str
    phase: str = "backward"  # the compute it can hide under: "forward" or "backward" of a micro-batch
    repeat: int = 1  # runs per optimizer step: every micro-batch (grad_accum), or once (the last one's backward)
    unhidden_s: float = 0.0  # per run: the call nothing can overlap (the first gather, the last reduction)
    kind: str = ""  # all_reduce, all_gather, reduce_scatter, host_copy
    message_gb: float = 0.0  # the full message of one run (all its calls)
    calls: int = 1  # calls per run (FSDP units, DDP buckets)
    group: int = 1  # ranks in the communicator
    nodes: int = 1  # nodes it spans
    algorithm: str = ""  # NCCL's pick per call, e.g. "ring/Simple", "tree/LL128", "nvls/Simple"
    latency_s: float | None = None  # per step: the latency part of ``seconds``
    bandwidth_s: float | None = None  # per step: the bandwidth part of ``seconds``
    cross_node_gb: float = 0.0  # per node per step, through the node's network links

    def to_dict(self) -> dict:
        """Every term of this part, for ``hpcx plan --json``."""
        return {"what": self.what, "kind": self.kind, "gb": self.gb, "message_gb": self.message_gb,
                "calls_per_run": self.calls, "runs_per_step": self.repeat, "group_ranks": self.group,
                "group_nodes": self.nodes, "algorithm": self.algorithm, "link": self.link, "phase": self.phase,
                "seconds": self.seconds, "latency_s": self.latency_s, "bandwidth_s": self.bandwidth_s,
                "unhidden_per_run_s": self.unhidden_s, "cross_node_gb_per_node": self.cross_node_gb}


@dataclass
class Comm:
    """Communication of one optimizer step for one rank."""

    parts: list[Part] = field(default_factory=list)

    @property
    def gb(self) -> float:
        return sum(p.gb for p in self.parts)

    @property
    def seconds(self) -> float | None:
        times = [p.seconds for p in self.parts if p.seconds is not None]
        return sum(times) if len(times) == len(self.parts) else None

    @property
    def cross_node_gb(self) -> float:
        """GB per node per step through the node's network links."""
        return sum(p.cross_node_gb for p in self.parts)

    @property
    def slowest_link(self) -> str:
        timed = [p for p in self.parts if p.seconds]
        return max(timed, key=lambda p: p.seconds or 0.0).link if timed else ""


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


def island_site(site: SiteProfile, tp: int) -> SiteProfile:
    """The site a tensor-parallel group of ``tp`` GPUs sees: inside one NVLink island (``node.nvlink_domain``)
    its link is NVLink at ``nvlink_bandwidth``; wider (``parallel.tp_cross_domain``), the node's own link."""
    domain = nvlink_domain(site.node)
    if tp > domain or site.node.intra_link in ("nvswitch", "nvlink") or domain <= 1:
        return site
    node = dataclasses.replace(site.node, intra_link="nvlink", intra_bandwidth_gbs=nvlink_bandwidth(site.node))
    return dataclasses.replace(site, node=node)


def _add(comm: Comm, c: Collective, group: Group, site: SiteProfile, tasks_per_node: int, repeat: int) -> None:
    sent = ring_bytes(c.kind, c.message, group.size) * repeat
    if not sent:
        return
    topo = group_topology(group, site, tasks_per_node)
    t = collective_seconds(c.kind, c.message, c.calls, topo)
    edge = collective_seconds(c.kind, c.edge, 1, topo)
    side_by_side = tasks_per_node / max(1, group.per_node)  # groups sharing one node's links
    cross = sent * side_by_side if group.nodes > 1 else 0.0
    link = group_link(group, site, tasks_per_node)
    comm.parts.append(Part(c.what, sent / GB, None if t is None else t.seconds * repeat, link.name, c.phase, repeat,
                           edge.seconds if edge else 0.0, c.kind, c.message / GB, c.calls, group.size, group.nodes,
                           t.algorithm if t else "", None if t is None else t.latency_s * repeat,
                           None if t is None else t.bandwidth_s * repeat, cross / GB))


def step_comm(facts: ModelFacts, cfg: Config, site: SiteProfile, nodes: int, tasks_per_node: int,
              grad_accum: int) -> Comm | None:
    """Per-rank communication of one optimizer step; None when the parameter count is unknown."""
    if facts.n_params is None:
        return None
    n, world, root = facts.n_params, nodes * tasks_per_node, facts.root_params or 0
    share = trained_share(facts)
    comm = Comm()
    if cfg.dims.replicated:  # ddp, fsdp no_shard
        everyone = Group(world, tasks_per_node)
        grads = n * share * REDUCE_BYTES
        if cfg.dims.ddp_enabled:  # 25 MB buckets, the last one after backward
            buckets = max(1, math.ceil(grads / DDP_BUCKET_BYTES))
            reduce = Collective("all-reduce gradients", "all_reduce", grads, buckets, min(grads, DDP_BUCKET_BYTES))
        else:  # one all-reduce per FSDP unit; the root's (embeddings) comes last
            reduce = Collective("all-reduce gradients", "all_reduce", grads, facts.n_units + 1,
                                root * share * REDUCE_BYTES)
        _add(comm, reduce, everyone, site, tasks_per_node, 1)
    elif cfg.dims.fsdp_enabled:
        _sharded_comm(comm, facts, cfg, site, tasks_per_node, grad_accum)
    if cfg.dims.tp > 1:
        _tp_comm(comm, facts, cfg, site, tasks_per_node, grad_accum)
    if cfg.offload:
        _offload_copies(comm, facts, cfg, grad_accum)
    return comm


def _offload_copies(comm: Comm, facts: ModelFacts, cfg: Config, grad_accum: int) -> None:
    """FSDP2 CPUOffloadPolicy: each micro-batch copies the fp32 parameter shard to the GPU before each
    all-gather (forward, and backward again under full_shard) and the reduced fp32 gradient shard
    back to the host, over each GPU's own PCIe link."""
    ranks = cfg.dims.dp_shard * cfg.dims.tp
    shard, root = (facts.n_params or 0) / ranks, (facts.root_params or 0) / ranks
    gathers = [("forward", "host→GPU parameter shard (offload)")]
    if cfg.reshards:
        gathers.append(("backward", "host→GPU parameter shard again (offload)"))
    copies = [(phase, what, PARAM_BYTES) for phase, what in gathers]
    copies.append(("backward", "GPU→host gradient shard (offload)", REDUCE_BYTES))
    bandwidth = HOST_LINK_GBS * GB
    for phase, what, width in copies:
        total = shard * width * grad_accum
        comm.parts.append(Part(what, total / GB, total / bandwidth, "pcie-host", phase, grad_accum,
                               root * width / bandwidth, "host_copy", shard * width / GB, 1, 1, 1, "copy",
                               0.0, total / bandwidth))


def _sharded_comm(comm: Comm, facts: ModelFacts, cfg: Config, site: SiteProfile, tasks_per_node: int,
                  grad_accum: int) -> None:
    """FSDP/HSDP: gathers and reduce-scatters inside the shard group, HSDP's all-reduce across it."""
    t = cfg.dims.tp  # each rank gathers and reduces its TP slice of every unit
    n, root, unit = (facts.n_params or 0) / t, (facts.root_params or 0) / t, (facts.unit_params or 0) / t
    kept = root if facts.kept_params is None else facts.kept_params / t  # gathered through backward
    units = facts.n_units + 1
    c, degree = compute_bytes(cfg.mixed_precision), cfg.dims.dp_shard
    share = trained_share(facts)  # gradients exist for the trained parameters only
    trained = n * share
    if t == 1:  # FSDP2 pads each tensor's dim 0 to a multiple of the shard group: the messages are padded
        n, trained = padded(n, facts.param_shapes, degree), padded(
            trained, facts.trainable_shapes if facts.trainable_params is not None else facts.param_shapes, degree)
    dp_per_node = max(1, tasks_per_node // t)
    shard = Group(degree, min(degree, dp_per_node))
    # forward gathers the root first; backward gathers all but ``kept`` again. Kept gathered
    # (reshard_after_forward = false): the first micro-batch's forward gathers, nothing after it does.
    _add(comm, Collective("all-gather forward", "all_gather", n * c, units, root * c, "forward"), shard, site,
         tasks_per_node, 1 if cfg.keeps_gathered else grad_accum)
    if cfg.reshards:
        _add(comm, Collective("all-gather backward", "all_gather", (n - kept) * c, units - 1, unit * c), shard,
             site, tasks_per_node, grad_accum)
    _add(comm, Collective("reduce-scatter gradients", "reduce_scatter", trained * REDUCE_BYTES, units,
                          root * share * REDUCE_BYTES), shard, site, tasks_per_node, grad_accum)
    replicas = cfg.dims.dp_replicate
    if replicas > 1:
        across = Group(replicas, max(1, dp_per_node // degree))
        _add(comm, Collective("all-reduce across replicas", "all_reduce", trained * REDUCE_BYTES / degree, units,
                              root * share * REDUCE_BYTES / degree), across, site, tasks_per_node, 1)


def padded(numel: float, shapes: tp.Sequence[tuple[int, ...]], degree: int) -> float:
    """``numel`` elements as FSDP2 shards them over ``degree`` ranks, padding included (``shapes``: the
    tensors; without them, ``numel``)."""
    return float(sharded_numel(int(numel), degree, shapes) * degree) if shapes and degree > 1 else numel


def tp_calls(facts: ModelFacts, checkpointing: bool) -> dict[tuple[str, str], int]:
    """Sequence-parallel collectives of one micro-batch, by (phase, kind): per block an all-gather into
    each module the family's plan gathers (attention and MLP: ``BlockTp.sequence_exchanges``) and a
    reduce-scatter out of it forward (+ the head's gather, the embedding's scatter), the mirror image
    backward, and the forward again in backward when blocks are recomputed."""
    plan = tp_plan_of(family_of(facts))
    per_block = plan.block.sequence_exchanges if plan is not None else 2  # no plan: tp is refused, bound by two
    layers = facts.n_units
    fwd = per_block * layers + 1
    again = per_block * layers if checkpointing else 0
    return {("forward", "all_gather"): fwd, ("forward", "reduce_scatter"): fwd,
            ("backward", "all_gather"): fwd + again, ("backward", "reduce_scatter"): fwd + again}


def _tp_comm(comm: Comm, facts: ModelFacts, cfg: Config, site: SiteProfile, tasks_per_node: int,
             grad_accum: int) -> None:
    """Tensor parallelism with sequence parallelism: activations gathered and scattered over the tp ranks
    of one node, every micro-batch; none of it hides under compute."""
    t, c = cfg.dims.tp, compute_bytes(cfg.mixed_precision)
    d = getattr(facts.shape, "d_model", 0)
    tokens = cfg.micro_batch * facts.seq_len
    group = Group(t, t)
    site = island_site(site, t)  # NVLink inside an island, the node's link across islands
    before = len(comm.parts)
    for (phase, kind), calls in tp_calls(facts, cfg.checkpointing).items():
        what = f"tp {'all-gather' if kind == 'all_gather' else 'reduce-scatter'} activations {phase}"
        message = tokens * d * c  # the full (gathered) activation of one call
        _add(comm, Collective(what, kind, message * calls, calls, message, phase), group, site, tasks_per_node,
             grad_accum)
    for part in comm.parts[before:]:  # on the critical path: every call waits for its layer
        part.unhidden_s = (part.seconds or 0.0) / max(1, part.repeat)

"""The parallel layout of a run, decided once: ``ParallelDims``.

Every module that needs to know how a strategy splits the ranks asks one frozen value built by
``parallel_dims`` (login side: resolve, plan, scale, render; job side: the trainer's launch refit,
its device mesh, and checkpoint inference). Nothing else maps a strategy name to degrees.

==========================  ============  ========  ==============================  ==========
strategy / sharding         dp_replicate  dp_shard  mesh (names)                    reshard
==========================  ============  ========  ==============================  ==========
none                        1             1         none (one process)              -
dp (nn.DataParallel)        1             1         none (one process per node)     -
ddp                         world         1         none (the default group)        -
fsdp full_shard             1             world     (world,) ("dp_shard",)          yes
fsdp shard_grad_op          1             world     (world,) ("dp_shard",)          no
fsdp no_shard               world         1         (world, 1) (dp_replicate,       no
                                                    dp_shard): FSDP2, DDP semantics
hsdp (any sharding)         world/shard   shard     (replicate, shard) (dp_replicate,  full_shard
                                                    dp_shard)
==========================  ============  ========  ==============================  ==========

``tp`` (tensor parallel, ``parallel.tp``) multiplies the world: fsdp and hsdp only, the data-parallel
degrees above are then of ``world / tp`` ranks and the mesh gains an innermost dimension ``"tp"``
(``(dp_shard, tp)`` or ``(dp_replicate, dp_shard, tp)``), so the ``tp`` ranks of a group are
consecutive: one node (its NVLink domain). FSDP shards over the data-parallel dimensions only
(``fsdp_dim_names``); data is split over ``dp_world`` ranks. Torch-free.
"""

from __future__ import annotations

import typing as tp
from dataclasses import asdict, dataclass
from typing import Any  # in ParallelDims, `tp` is the tensor-parallel degree

STRATEGIES = ("none", "dp", "ddp", "fsdp", "hsdp")
SHARDINGS = ("full_shard", "shard_grad_op", "no_shard")
FSDP_STRATEGIES = ("fsdp", "hsdp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of one run's parallelism; checks its own arithmetic and says the numbers."""

    strategy: str
    sharding: str
    dp_replicate: int
    dp_shard: int
    tp: int = 1

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy {self.strategy!r}: expected one of {', '.join(STRATEGIES)}")
        if self.sharding not in SHARDINGS:
            raise ValueError(f"sharding {self.sharding!r}: expected one of {', '.join(SHARDINGS)}")
        for name in ("dp_replicate", "dp_shard", "tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)}: expected a degree >= 1")
        if self.tp != 1 and not self.fsdp_enabled:
            raise ValueError(f"tp = {self.tp} with strategy {self.strategy!r}: tensor parallelism runs inside "
                             "fsdp or hsdp (expected tp = 1, or strategy fsdp/hsdp)")
        if self.single_process and self.world_size != 1:
            raise ValueError(f"strategy {self.strategy!r} runs one process, but dp_replicate={self.dp_replicate} "
                             f"× dp_shard={self.dp_shard} = {self.world_size} ranks")
        if self.strategy == "ddp" and self.dp_shard != 1:
            raise ValueError(f"ddp replicates whole parameters, but dp_shard = {self.dp_shard}")
        if self.strategy == "fsdp" and (self.dp_shard if self.sharding == "no_shard" else self.dp_replicate) != 1:
            raise ValueError(f"fsdp {self.sharding} on dp_replicate={self.dp_replicate} × dp_shard={self.dp_shard}: "
                             "fsdp shards over every rank, except no_shard, which replicates over every rank")
        if self.strategy == "hsdp" and self.sharding == "no_shard":
            raise ValueError("hsdp with sharding no_shard would shard nothing: use hsdp full_shard or "
                             "shard_grad_op, or fsdp no_shard / ddp to replicate")

    # ---- what the strategy is

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp_world(self) -> int:
        """Ranks that see different data: the data-parallel degrees (the ``tp`` ranks of a group share a batch)."""
        return self.dp_replicate * self.dp_shard

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def single_process(self) -> bool:
        """none and dp: one process (dp drives every GPU of its node from it)."""
        return self.strategy in ("none", "dp")

    @property
    def needs_process_group(self) -> bool:
        """DDP and FSDP2 need a process group, even at world size 1."""
        return not self.single_process

    @property
    def dp_enabled(self) -> bool:
        """nn.DataParallel."""
        return self.strategy == "dp"

    @property
    def ddp_enabled(self) -> bool:
        return self.strategy == "ddp"

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP2 ``fully_shard`` (fsdp with any sharding, and hsdp)."""
        return self.strategy in FSDP_STRATEGIES

    @property
    def hsdp_enabled(self) -> bool:
        return self.strategy == "hsdp"

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def replicated(self) -> bool:
        """Every rank holds whole parameters and all-reduces gradients over all ranks (ddp, fsdp no_shard)."""
        return self.needs_process_group and self.dp_shard == 1 and self.dp_replicate == self.world_size

    def dp_rank(self, rank: int) -> int:
        """The data-parallel index of global ``rank`` (``tp`` is the innermost mesh dimension)."""
        return rank // self.tp

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP2 frees the gathered parameters after forward only under full_shard (shard_grad_op keeps
        them until backward; no_shard's 1-wide shard group has nothing to free)."""
        return self.fsdp_enabled and self.sharding == "full_shard"

    # ---- the device mesh

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        """Names of the data-parallel mesh dimensions; None where no mesh is built (none, dp, ddp)."""
        if not self.fsdp_enabled:
            return None
        names: tuple[str, ...] = ("dp_shard",) if self.strategy == "fsdp" and self.sharding != "no_shard" \
            else ("dp_replicate", "dp_shard")
        return names + (("tp",) if self.tp > 1 else ())

    @property
    def fsdp_dim_names(self) -> tuple[str, ...] | None:
        """The mesh dimensions FSDP shards and replicates over (every one but ``tp``)."""
        names = self.mesh_dim_names
        return None if names is None else tuple(n for n in names if n != "tp")

    @property
    def mesh_shape(self) -> tuple[int, ...] | None:
        names = self.mesh_dim_names
        if names is None:
            return None
        return tuple(getattr(self, name) for name in names)

    # ---- words

    def describe(self) -> str:
        """One phrase for people, with the numbers: what is sharded over how many ranks."""
        if self.tp > 1:
            return f"{_data_parallel(self).describe()} × tp {self.tp} (tensor parallel within groups of {self.tp})"
        world = self.world_size
        if self.strategy == "none":
            return "none (one process)"
        if self.dp_enabled:
            return "dp (nn.DataParallel: one process drives every GPU of the node)"
        if self.ddp_enabled:
            return f"ddp (whole parameters on each of {world} ranks; gradients all-reduced)"
        if self.strategy == "fsdp" and self.sharding == "no_shard":
            return (f"fsdp no_shard (whole parameters on each of {world} ranks, mesh replicate={self.dp_replicate} "
                    f"× shard={self.dp_shard}; gradients all-reduced)")
        if self.strategy == "fsdp":
            return f"fsdp {self.sharding} (sharded over {self.dp_shard} ranks){self._tp_text()}"
        return (f"hsdp {self.sharding} (mesh replicate={self.dp_replicate} × shard={self.dp_shard}: sharded within "
                f"groups of {self.dp_shard}, replicated across {self.dp_replicate}){self._tp_text()}")

    def _tp_text(self) -> str:
        return f" × tp {self.tp} (each layer split over {self.tp} ranks of a node)" if self.tp > 1 else ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> "ParallelDims":
        return cls(**doc)


def _data_parallel(dims: ParallelDims) -> ParallelDims:
    """The same layout without its tensor-parallel dimension (for words)."""
    return ParallelDims(dims.strategy, dims.sharding, dims.dp_replicate, dims.dp_shard)


def parallel_dims(strategy: str, sharding: str, world_size: int, tasks_per_node: int = 1,
                  shard_size: int = 0, tp: int = 1) -> ParallelDims:
    """The one mapping from a strategy to degrees. ``shard_size`` is HSDP's shard group (0: one node's
    ``tasks_per_node`` ranks); it is ignored by every other strategy. ``tp`` > 1 (fsdp, hsdp) takes groups
    of ``tp`` ranks within a node out of the data-parallel degrees (HSDP's default shard group is then
    the node's ``tasks_per_node / tp`` groups). Raises ValueError with the numbers."""
    if world_size < 1:
        raise ValueError(f"world size {world_size}: expected at least one rank")
    if tp > 1:
        return _with_tp(strategy, sharding, world_size, tasks_per_node, shard_size, tp)
    if strategy in ("none", "dp"):
        return ParallelDims(strategy, sharding, 1, 1) if world_size == 1 else _one_process(strategy, world_size)
    if strategy == "ddp" or (strategy == "fsdp" and sharding == "no_shard"):
        return ParallelDims(strategy, sharding, world_size, 1)
    if strategy == "fsdp":
        return ParallelDims(strategy, sharding, 1, world_size)
    if strategy == "hsdp":
        shard = hsdp_shard_size(tasks_per_node, shard_size)
        if shard < 1 or world_size % shard:
            raise ValueError(f"hsdp shard group of {shard} ranks does not divide the world of {world_size} ranks")
        return ParallelDims(strategy, sharding, world_size // shard, shard)
    raise ValueError(f"strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")


def _with_tp(strategy: str, sharding: str, world_size: int, tasks_per_node: int, shard_size: int,
             tp: int) -> ParallelDims:
    if strategy not in FSDP_STRATEGIES:
        raise ValueError(f"tp = {tp} with strategy {strategy!r}: tensor parallelism runs inside fsdp or hsdp")
    if world_size % tp or tasks_per_node % tp:
        raise ValueError(f"tp = {tp} does not divide the {tasks_per_node} ranks of a node ({world_size} in all): "
                         "a tensor-parallel group stays within one node")
    dp = world_size // tp
    inner = parallel_dims(strategy, sharding, dp, tasks_per_node // tp, shard_size)
    return ParallelDims(strategy, sharding, inner.dp_replicate, inner.dp_shard, tp)


def tasks_per_node(strategy: str, requested: int, site_default: int) -> int:
    """Tasks per node: the spec's (``requested``), else one for the one-process strategies (none, and dp,
    whose process drives every GPU of its node), else the site's default (one per GPU)."""
    if requested:
        return requested
    return 1 if strategy in ("none", "dp") else site_default


def hsdp_shard_size(tasks_per_node: int, shard_size: int = 0) -> int:
    """HSDP's shard group: ``parallel.shard_size`` when set, else one node's ranks."""
    return shard_size or tasks_per_node


def _one_process(strategy: str, world_size: int) -> tp.NoReturn:
    raise ValueError(f"strategy {strategy!r} runs one process, but {world_size} ranks were asked for")


def dims_from_mesh(mesh_dim_names: tp.Sequence[str] | None, mesh_shape: tp.Sequence[int], ddp: bool,
                   sharding: str = "full_shard") -> ParallelDims:
    """The layout a model shows after parallelization (for checkpoint inference): the names and shape
    of its parameters' device mesh, or a DDP wrapper, or neither. Under FSDP the sharding is not
    visible in the parameters; ``sharding`` says what to assume."""
    if mesh_dim_names is None or not mesh_shape:
        world = mesh_shape[0] if ddp and mesh_shape else 1
        return parallel_dims("ddp" if ddp else "none", "full_shard", world)
    sizes = dict(zip(mesh_dim_names, mesh_shape))
    replicate, shard, tp_ = sizes.get("dp_replicate", 1), sizes.get("dp_shard", 1), sizes.get("tp", 1)
    if "dp_replicate" not in sizes:
        return ParallelDims("fsdp", sharding if sharding != "no_shard" else "full_shard", 1, shard, tp_)
    if shard == 1:
        return ParallelDims("fsdp", "no_shard", replicate, 1, tp_)
    return ParallelDims("hsdp", sharding, replicate, shard, tp_)

"""The planner's entry point used by ``resolve``.

``choose`` returns (strategy, sharding, shard_size, reasons). An explicit
strategy in the spec is respected; ``auto`` is decided here.
"""

from __future__ import annotations

from hpc.site import SiteProfile
from hpc.spec import JobSpec


def choose(spec: JobSpec, site: SiteProfile, nodes: int) -> tuple[str, str, int, list[str]]:
    p = spec.parallel
    tpn = spec.job.tasks_per_node or site.default_tasks_per_node()
    world = nodes * tpn
    if p.strategy != "auto":
        shard = (p.shard_size or tpn) if p.strategy == "hsdp" else 0
        return p.strategy, p.sharding, shard, [f"strategy {p.strategy!r} set in the spec"]
    if world == 1:
        return "none", p.sharding, 0, ["one rank: no data parallelism needed"]
    return "ddp", p.sharding, 0, [f"{world} ranks: ddp (placeholder until the memory planner decides)"]

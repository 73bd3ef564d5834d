"""A strategy set in the spec that the plan knows runs out of memory: said loudly, with the figure.

``render``, ``submit`` and ``dryrun`` keep an explicit ``parallel.strategy`` (``auto`` takes only a
layout that fits), so they ask ``memory_warning`` about the launch's own layout: the same per-rank
need (peak + headroom) and host need as ``hpcx plan``'s row of that layout (``hpc.plan.launch_row``),
from ``hpc.plan.memory`` alone, so a command that renders a set strategy still loads none of the
rest of the planner (tests/test_startup.py). With ``--strict`` the command refuses (exit 2).
"""

from __future__ import annotations

import typing as tp

from hpc.core.models import model_facts
from hpc.core.optim import state_bytes
from hpc.core.spec import compute_precision
from hpc.plan.memory import HOST_USABLE, Config, estimate, headroom_gb

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.core.resolve import Launch
    from hpc.core.site import SiteProfile
    from hpc.core.spec import JobSpec

STRICT_HELP = "Refuse (exit 2) when the plan estimates that the spec's layout does not fit in memory."


def layout_label(launch: Launch) -> str:
    """``fsdp full_shard``, ``hsdp 8 full_shard × tp 2 + offload``: the plan's name of the launch's layout."""
    d = launch.dims
    text = d.strategy if not d.fsdp_enabled else (f"fsdp {d.sharding}" if not d.hsdp_enabled
                                                  else f"hsdp {d.dp_shard} {d.sharding}")
    return text + (f" × tp {d.tp}" if d.tp > 1 else "") + (" + offload" if launch.cpu_offload else "")


def need_figures(spec: JobSpec, site: SiteProfile, launch: Launch) -> tuple[float, float | None, float, float | None] | None:
    """(need per rank, its capacity, host need per node, usable host per node) in GB, as the plan's row of
    the launch's layout counts them; None when the model's size is unknown."""
    gpu = site.node.gpus > 0
    facts = model_facts(spec.model)
    offload = bool(launch.cpu_offload) and launch.dims.fsdp_enabled
    cfg = Config(launch.dims, offload, compute_precision(spec.parallel.mixed_precision, gpu),
                 spec.parallel.activation_checkpointing, spec.train.micro_batch, spec.model.dropout,
                 spec.checkpoint.async_save, max(1, launch.grad_accum), spec.data.packing == "document", gpu,
                 spec.parallel.reshard_after_forward, state_bytes(spec))
    m = estimate(facts, cfg, launch.tasks_per_node)
    if m is None:
        return None
    peak = max(m.total, m.init) + (0.0 if gpu else m.staging)
    need = peak + headroom_gb(peak, gpu)
    if gpu:
        capacity = site.node.gpu_memory_gb or None
    else:
        capacity = site.node.memory_gb / launch.tasks_per_node if site.node.memory_gb else None
    host = (m.host_per_node + m.staging_per_node) if gpu else 0.0
    usable = site.node.memory_gb * HOST_USABLE if site.node.memory_gb else None
    return need, capacity, host, usable


def memory_warning(spec: JobSpec, site: SiteProfile, launch: Launch) -> str | None:
    """One line when the plan estimates that the launch's layout does not fit the GPU (or the host),
    else None. ``auto`` is never warned about: the planner chose a layout that fits."""
    if spec.parallel.strategy == "auto":
        return None
    figures = need_figures(spec, site, launch)
    if figures is None:
        return None
    need, capacity, host, usable = figures
    where = "GPU" if site.node.gpus else "rank"
    label = layout_label(launch)
    if capacity is not None and need > capacity:
        return (f"warning: {label} needs {need:.1f} GB per {where} of {capacity:.1f} GB (the plan's estimate; "
                "`hpcx plan` says what fits); --strict refuses")
    if usable is not None and host > usable:
        return (f"warning: {label} needs {host:.1f} GB of host memory per node of {usable:.1f} GB usable (the plan's "
                "estimate; `hpcx plan` says what fits); --strict refuses")
    return None

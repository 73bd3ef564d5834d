"""Why nothing fits: the per-rank floor, and which lever moves it.

Model states (parameters, gradients, Adam state) shrink as FSDP shards them over more ranks; what a
rank holds besides them does not: the gathered units (the root, the current and the prefetched
block, one block's unsharded gradients) and the activations of its micro-batch. Their sum with the
headroom is the **floor**: the least memory per GPU of FSDP full_shard at any number of ranks (and
the start-up peak's largest module, computed whole). When the floor is above the GPU's memory, more
nodes cannot help, and offload cannot either (it moves only model states); what moves it is tensor
parallelism (each layer and its activations split over the GPUs of a node), a shorter sequence or a
smaller micro batch (fewer activations), or activation checkpointing. ``floor_lines`` says so with
the numbers: the floor's terms against the GPU, then each lever's floor.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hpc.core.dims import parallel_dims
from hpc.core.models import ModelFacts
from hpc.core.site import SiteProfile
from hpc.plan.memory import GB, PARAM_BYTES, Config, estimate, headroom_gb
from hpc.plan.rows import Setup, tp_degrees


@dataclass(frozen=True)
class Floor:
    """What no data-parallel degree divides, per rank, in GB."""

    buffers: float
    activations: float
    module: float  # the start-up peak's largest module, computed whole (fp32)
    gpu: bool

    @property
    def peak(self) -> float:
        return max(self.buffers + self.activations, self.module)

    @property
    def need(self) -> float:
        return self.peak + headroom_gb(self.peak, self.gpu)


def floor_of(facts: ModelFacts, setup: Setup, site: SiteProfile) -> Floor | None:
    """The floor of ``setup`` (FSDP full_shard over its data-parallel ranks); None when the model's size or
    activations are unknown."""
    if facts.n_params is None:
        return None
    dims = parallel_dims("fsdp", "full_shard", setup.world, setup.tasks_per_node, tp=setup.tp)
    cfg = Config(dims, False, setup.mixed_precision, setup.checkpointing, setup.micro_batch, setup.dropout,
                 setup.async_save, setup.grad_accum, setup.document_mask, site.node.gpus > 0,
                 optimizer_bytes=setup.optimizer_bytes)
    m = estimate(facts, cfg, setup.tasks_per_node)
    if m is None or m.activations is None:
        return None
    return Floor(m.buffers, m.activations, (facts.largest_module_params or 0) * PARAM_BYTES / GB, site.node.gpus > 0)


def _text(f: Floor) -> str:
    return f"{f.need:.1f} GB"


def levers(facts: ModelFacts, setup: Setup, site: SiteProfile,
           shorter: ModelFacts | None = None) -> list[tuple[str, Floor]]:
    """Each lever that lowers the floor, with the floor it gives: tensor parallelism (each degree the site
    and model allow), half the sequence, micro batch 1, activation checkpointing."""
    out: list[tuple[str, Floor]] = []
    if setup.tp == 1:
        for t in tp_degrees(facts, site, setup.tasks_per_node)[1:]:
            if setup.world % t == 0:
                f = floor_of(facts, replace(setup, tp=t), site)
                out += [(f"parallel.tp = {t}", f)] if f is not None else []
    if shorter is not None:
        f = floor_of(shorter, setup, site)
        out += [(f"model.seq_len = {shorter.seq_len}", f)] if f is not None else []
    if setup.micro_batch > 1:
        f = floor_of(facts, replace(setup, micro_batch=1), site)
        out += [("train.micro_batch = 1", f)] if f is not None else []
    if not setup.checkpointing:
        f = floor_of(facts, replace(setup, checkpointing=True), site)
        out += [("parallel.activation_checkpointing = true", f)] if f is not None else []
    return out


def floor_lines(facts: ModelFacts, setup: Setup, site: SiteProfile, shorter: ModelFacts | None = None) -> list[str]:
    """Why nothing fits, when the floor is the reason: its terms against the GPU, and each lever's floor."""
    base = floor_of(facts, setup, site)
    capacity = site.node.gpu_memory_gb if site.node.gpus else 0.0
    if base is None or not capacity:
        return []
    where = f"{capacity:.1f} GB per GPU"
    head = (f"Why: the per-rank floor, what no number of ranks divides (FSDP's gathered units {base.buffers:.1f} GB "
            f"+ the activations of one micro-batch {base.activations:.1f} GB, with headroom), is {_text(base)} "
            f"against {where}")
    if base.need <= capacity:
        return [head + ": below it, so the model states are what does not fit (more ranks or offload shard them)."]
    moves = levers(facts, setup, site, shorter)
    texts = [f"{knob}: {_text(f)}{' (fits under the GPU)' if f.need <= capacity else ''}" for knob, f in moves]
    lines = [head + "; more nodes cannot lower it, and offload moves only the model states."]
    if texts:
        lines.append("Levers on the floor: " + "; ".join(texts) + ".")
    return lines

"""What the model predicts for one point of a study: the planner's strategy choice, its NCCL-model
communication and compute at the site's MFU or an assumed one (or anchored on the smallest measured point)."""

from __future__ import annotations

import typing as tp
from dataclasses import dataclass, replace

from hpc import plan
from hpc.core.models import model_facts
from hpc.plan import MFU_DEFAULT as ASSUMED_MFU  # noqa: F401  (hpc.scale re-exports it: the compute estimate when nothing was measured)
from hpc.core.resolve import tasks_per_node
from hpc.core.site import SiteProfile
from hpc.core.spec import JobSpec
from hpc.core.validate import check_batch
from hpc.plan.comm import step_comm
from hpc.plan.memory import Config

from hpc.scale.study import point_batch


# ---------------------------------------------------------------- prediction (the planner's model)

@dataclass
class Prediction:
    """One optimizer step of one point, as the model sees it."""

    compute_s: float | None
    comm_s: float | None
    tokens_per_s: float | None
    limiting_link: str
    basis: str  # "model" (planner alone) or "anchored" (compute from the smallest measured point)
    note: str = ""


def predicted_step(spec: JobSpec, site: SiteProfile, nodes: int) -> dict[str, tp.Any]:
    """``dict(compute_s, comm_s, tokens_per_s, limiting_link)`` of one step at ``nodes`` nodes, from the
    planner's pieces: its strategy choice, ``step_comm`` (timed by NCCL's cost model) and compute at the
    site's ``node.mfu`` (else ASSUMED_MFU) of its peak (None where unknown). Step time is compute + communication (no overlap: a lower bound on throughput)."""
    facts, setup, t = model_facts(spec.model), plan.setup_of(spec, site, nodes), spec.train
    if facts.n_params is None or check_batch(t.global_batch, t.micro_batch, setup.world):
        return {"compute_s": None, "comm_s": None, "tokens_per_s": None, "limiting_link": ""}
    choice = plan.choose(spec, site, nodes)
    cfg = Config(choice.dims, choice.cpu_offload, setup.mixed_precision,
                 spec.parallel.activation_checkpointing, t.micro_batch, spec.model.dropout,
                 optimizer_bytes=setup.optimizer_bytes)
    comm = step_comm(facts, cfg, site, nodes, setup.tasks_per_node, setup.grad_accum)
    compute = plan.compute_seconds(facts, setup, site, plan.mfu_of(site)[0])
    comm_s = comm.seconds if comm else None
    step = None if compute is None or comm_s is None else compute + comm_s
    return {"compute_s": compute, "comm_s": comm_s, "limiting_link": comm.slowest_link if comm else "",
            "tokens_per_s": t.global_batch * facts.seq_len / step if step else None}


def link_label(name: str, site: SiteProfile) -> str:
    """The limiting link in a user's words: PCIe, NVLink or inter-node (with the fabric)."""
    if name in ("nvlink", "nvswitch"):
        return f"NVLink ({name})"
    if name == "pcie":
        return "PCIe"
    if name == "pcie-host":
        return "PCIe host link (CPU offload copies)"
    if name and name == site.network.fabric:
        return f"inter-node ({name}, {site.network.bandwidth_gbs:g} GB/s per node)"
    return name or "unknown"


@dataclass
class Anchor:
    """Compute seconds per sample per rank, measured at the smallest point (its step minus its predicted comm)."""

    sec_per_sample: float
    tokens_per_sample: float


def predict(spec: JobSpec, site: SiteProfile, nodes: int, anchor: Anchor | None = None) -> Prediction:
    """The model's step at ``nodes``; with an anchor, compute comes from the measurement instead of peak × MFU."""
    raw = predicted_step(spec, site, nodes)
    comm_s, link = raw.get("comm_s"), link_label(raw.get("limiting_link", ""), site)
    if anchor is None or comm_s is None:
        return Prediction(raw.get("compute_s"), comm_s, raw.get("tokens_per_s"), link, "model")
    ranks = nodes * tasks_per_node(spec, site)
    compute = anchor.sec_per_sample * spec.train.global_batch / ranks
    tokens = spec.train.global_batch * anchor.tokens_per_sample / (compute + comm_s)
    return Prediction(compute, comm_s, tokens, link, "anchored")


# ---------------------------------------------------------------- predict only

def predict_table(spec: JobSpec, site: SiteProfile, nodes: tp.Sequence[int], mode: str) -> list[dict]:
    """The model alone at each size (no cluster needed): compute, communication, throughput, efficiency."""
    rows, ref = [], None
    for n in nodes:
        batch, why = point_batch(spec, site, n, mode)
        if batch is None:
            rows.append({"nodes": n, "error": why})
            continue
        point = replace(spec, job=replace(spec.job, nodes=n), train=replace(spec.train, global_batch=batch))
        raw = predicted_step(point, site, n)
        ranks = n * tasks_per_node(spec, site)
        row = {"nodes": n, "ranks": ranks, "global_batch": batch, **raw,
               "limiting_link": link_label(raw.get("limiting_link", ""), site), "error": None}
        ref = ref or (row if row["tokens_per_s"] else None)
        row["efficiency"] = ((row["tokens_per_s"] / ranks) / (ref["tokens_per_s"] / ref["ranks"])
                             if ref and row["tokens_per_s"] else None)
        rows.append(row)
    return rows

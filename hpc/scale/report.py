"""The report's figures: what each point measured, its efficiency against the smallest measured point,
the model's prediction beside it, and a verdict with advice where efficiency falls short.

Efficiency is per-rank throughput against the smallest measured point; that one formula is both
weak-scaling efficiency and strong-scaling speedup over the rank ratio. The first
``train.warmup_metrics_steps`` steps of each run are left out of every figure.
"""

from __future__ import annotations

import math
import statistics
import typing as tp
from dataclasses import dataclass, replace
from pathlib import Path

from hpc.core import nccl
from hpc.core import runs
from hpc.core.config import ConfigError
from hpc.core.models import model_facts
from hpc.core.resolve import tasks_per_node
from hpc.core.site import SiteProfile, load_site, parse_site
from hpc.core.spec import JobSpec, load_spec
from hpc.plan.comm import Group, group_link
from hpc.plan.memory import DDP_BUCKET_BYTES, REDUCE_BYTES

from hpc.scale.predict import Anchor, Prediction, predict, predicted_step
from hpc.scale import study as studies
from hpc.scale.study import STUDY_SPEC, read_study

EFFICIENCY_GOAL = 0.9  # below this a point gets a verdict
EXPLAINED_SHARE = 0.5  # a cause must account for at least half of the lost step time
SPLIT_KEYS = ("compute_s", "comm_wait_s", "data_s")  # optional per-step fields of metrics.jsonl
BIGGER_BUCKET_MB = 100


# ---------------------------------------------------------------- measuring

def measure(run_dir: Path, warmup_steps: int) -> dict[str, tp.Any] | None:
    """Medians over the steps after warm-up; None when no such step was logged."""
    steady = [r for r in runs.RunDir(run_dir).read_metrics()
              if r.get("step", 0) > warmup_steps and r.get("tokens_per_s")]
    if not steady:
        return None
    out = {"steps_measured": len(steady),
           "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
           "step_time_s": statistics.median(r["step_time_s"] for r in steady)}
    for key in SPLIT_KEYS:
        values = [r[key] for r in steady if isinstance(r.get(key), (int, float))]
        out[key] = statistics.median(values) if len(values) == len(steady) else None
    return out


@dataclass
class Study:
    """A study folder as the report reads it: its study.json, its site, and the compute anchor."""

    dir: Path
    doc: dict
    site: SiteProfile
    anchor: Anchor | None = None

    def point(self, nodes: int) -> dict:
        return next(p for p in self.doc["points"] if p["nodes"] == nodes)

    def spec(self, nodes: int) -> JobSpec:
        """The point's spec: the study's copy of the spec with the study's and the point's overrides."""
        return load_spec(self.dir / STUDY_SPEC, [*self.doc["overrides"], *self.point(nodes)["overrides"]],
                         paths=False)


def study_site(study: dict) -> SiteProfile:
    """The site as the runs saw it (resolved.json), else the profile by its recorded path or name."""
    for point in study["points"]:
        doc = runs.RunDir(point["run_dir"]).read_resolved().get("site") if point.get("run_dir") else None
        if doc:
            sections = {k: doc[k] for k in ("scheduler", "node", "network", "storage", "nccl")}
            return parse_site(sections, doc["name"], doc.get("source", ""))
    try:
        return load_site(study.get("site_source") or study["site"])
    except ConfigError:
        return load_site(study["site"])


# ---------------------------------------------------------------- the report

def build_report(study_dir: Path, state_of: tp.Callable[[dict], str] | None = None) -> dict[str, tp.Any]:
    """Every figure of the report as plain data (what ``--json`` prints); ``state_of`` asks the scheduler."""
    doc = read_study(Path(study_dir))
    study = Study(Path(study_dir), doc, study_site(doc))
    warmup = doc.get("warmup_metrics_steps", 2)
    state_of = state_of or studies.point_state
    points = sorted(doc["points"], key=lambda p: p["nodes"])
    rows = [measured_row(study, p, state_of(p), warmup) for p in points]
    base = next((r for r in rows if r["tokens_per_s"]), None)
    study.anchor = make_anchor(study, base)
    for row in rows:
        add_prediction(row, study)
    for row in rows:
        add_efficiency(row, base)
        add_verdict(row, base, study)
    return {"study": str(study.dir), "name": doc["name"], "mode": doc["mode"], "site": study.site.name,
            "group_readable": study.site.storage.group_readable,
            "baseline_nodes": base["nodes"] if base else None, "warmup_metrics_steps": warmup,
            "prediction_basis": "anchored" if study.anchor else "model", "points": rows}


def measured_row(study: Study, point: dict, state: str, warmup: int) -> dict[str, tp.Any]:
    row: dict[str, tp.Any] = {"nodes": point["nodes"], "ranks": point["ranks"], "state": state,
                              "global_batch": point["global_batch"], "strategy": point.get("strategy"),
                              "run_dir": point.get("run_dir"), "error": point.get("error"),
                              "tokens_per_s": None, "step_time_s": None, **{k: None for k in SPLIT_KEYS},
                              "steps_measured": 0, "nccl": None, "nccl_problems": []}
    if point.get("run_dir"):
        row.update(measure(Path(point["run_dir"]), warmup) or {})
        row["nccl"], row["nccl_problems"] = transport_check(Path(point["run_dir"]), study, point["nodes"])
    row["tokens_per_s_per_rank"] = row["tokens_per_s"] / row["ranks"] if row["tokens_per_s"] else None
    return row


def transport_check(run_dir: Path, study: Study, nodes: int) -> tuple[str | None, list[str]]:
    """The NCCL transports of a run's logs, and their mismatches with the site (None: no INFO lines)."""
    info = nccl.parse_files(nccl.run_log_files(run_dir))
    if not info.found:
        return None, []
    tpn = study.doc.get("tasks_per_node")
    return nccl.describe(info, tpn, nodes), nccl.check(info, study.site, nodes, tpn)


def make_anchor(study: Study, base: dict | None) -> Anchor | None:
    """Compute per sample from the smallest measured point, when its predicted communication is known."""
    if base is None:
        return None
    comm_s = predicted_step(study.spec(base["nodes"]), study.site, base["nodes"]).get("comm_s")
    if comm_s is None or base["step_time_s"] <= comm_s:
        return None
    per_sample = (base["step_time_s"] - comm_s) * base["ranks"] / base["global_batch"]
    tokens_per_sample = base["tokens_per_s"] * base["step_time_s"] / base["global_batch"]
    return Anchor(per_sample, tokens_per_sample)


def add_prediction(row: dict, study: Study) -> None:
    pred = predict(study.spec(row["nodes"]), study.site, row["nodes"], study.anchor)
    row.update(predicted_tokens_per_s=pred.tokens_per_s, predicted_compute_s=pred.compute_s,
               predicted_comm_s=pred.comm_s, limiting_link=pred.limiting_link)


def add_efficiency(row: dict, base: dict | None) -> None:
    """Measured and predicted tokens/s per rank, each against its own figure at the smallest measured point."""
    row["efficiency"] = (row["tokens_per_s_per_rank"] / base["tokens_per_s_per_rank"]
                         if base and row["tokens_per_s_per_rank"] else None)
    ok = base and base.get("predicted_tokens_per_s") and row.get("predicted_tokens_per_s")
    row["predicted_efficiency"] = ((row["predicted_tokens_per_s"] / row["ranks"])
                                   / (base["predicted_tokens_per_s"] / base["ranks"]) if base and ok else None)


# ---------------------------------------------------------------- verdicts

def add_verdict(row: dict, base: dict | None, study: Study) -> None:
    """``verdict`` (one line) and ``advice`` (lines with numbers) for a point short of EFFICIENCY_GOAL.

    The step time lost against linear scaling is blamed on data loading or communication when that
    one grew by at least EXPLAINED_SHARE of the loss: measured (``data_s``, ``comm_wait_s``) where
    the trainer logs them, else the planner's NCCL cost model's communication.
    """
    row["verdict"], row["advice"] = None, []
    if not base or row is base or row["efficiency"] is None or row["efficiency"] >= EFFICIENCY_GOAL:
        return
    per_rank = (row["global_batch"] / row["ranks"]) / (base["global_batch"] / base["ranks"])
    lost = row["step_time_s"] - base["step_time_s"] * per_rank
    eff = f"efficiency {row['efficiency']:.0%}: {lost * 1e3:.1f} ms per step lost"
    data_grew, comm_grew = (_growth(row, base, k) for k in ("data_s", "comm_wait_s"))
    model_grew = _growth(row, base, "predicted_comm_s")
    if data_grew is not None and data_grew >= EXPLAINED_SHARE * lost:
        row["verdict"] = f"data-bound ({eff}; data loading {row['data_s'] * 1e3:.1f} ms per step)"
        row["advice"] = data_advice(study.spec(row["nodes"]))
        return
    grew, source = (comm_grew, "measured communication wait") if comm_grew is not None else (model_grew, "NCCL cost model")
    if grew is not None and grew >= EXPLAINED_SHARE * lost:
        row["verdict"] = (f"communication-bound on {row['limiting_link']} ({eff}; {source}: "
                          f"+{grew * 1e3:.1f} ms of communication)")
        row["advice"] = comm_advice(study.spec(row["nodes"]), study, row)
        return
    known = f"the model accounts for {model_grew * 1e3:.1f} ms" if model_grew is not None else "no model figure"
    row["verdict"] = (f"unexplained ({eff}; {known}): look for a straggler node, CPU binding, "
                      "or contention in the ranks' logs")


def _growth(row: dict, base: dict, key: str) -> float | None:
    return row[key] - base[key] if row.get(key) is not None and base.get(key) is not None else None


def data_advice(spec: JobSpec) -> list[str]:
    workers = max(0, spec.data.num_workers)  # -1 (auto): 0 on the CPU sites
    return [f"raise `data.num_workers` from {workers} to {max(2, 2 * workers)} (loading overlaps compute)",
            "keep the token file on node-local or fast storage"]


def comm_advice(spec: JobSpec, study: Study, row: dict) -> list[str]:
    """What to try, each with the model's communication before and after."""
    site, anchor = study.site, study.anchor
    now = predict(spec, site, row["nodes"], anchor)
    tpn = tasks_per_node(spec, site)
    advice, tries = [], []
    if row["nodes"] > 1 and tpn > 1 and row.get("strategy") != "hsdp":
        tries.append((f"`parallel.strategy` = 'hsdp' with `parallel.shard_size` = {tpn} (one node)",
                      replace(spec, parallel=replace(spec.parallel, strategy="hsdp", shard_size=tpn))))
    t = spec.train
    tries.append((f"`train.micro_batch` {t.micro_batch} → {2 * t.micro_batch} with `train.global_batch` "
                  f"{t.global_batch} → {2 * t.global_batch} (if memory allows)",
                  replace(spec, train=replace(t, micro_batch=2 * t.micro_batch, global_batch=2 * t.global_batch))))
    for label, other in tries:
        after = predict(other, site, row["nodes"], anchor)
        if now.comm_s is not None and after.comm_s is not None:
            shares = (f", {_share(now):.0%} → {_share(after):.0%} of the step"
                      if _share(now) is not None and _share(after) is not None else "")
            advice.append(f"{label}: communication {now.comm_s * 1e3:.1f} → {after.comm_s * 1e3:.1f} ms "
                          f"per step{shares}")
    advice += bucket_advice(spec, site, row["nodes"])
    return advice


def _share(p: Prediction) -> float | None:
    """Communication's share of the predicted step."""
    if p.compute_s is None or p.comm_s is None or p.compute_s + p.comm_s <= 0:
        return None
    return p.comm_s / (p.compute_s + p.comm_s)


def bucket_advice(spec: JobSpec, site: SiteProfile, nodes: int) -> list[str]:
    """DDP: the latency term is one α per ring step per bucket; bigger buckets mean fewer calls."""
    facts, tpn = model_facts(spec.model), tasks_per_node(spec, site)
    world = nodes * tpn
    if facts.n_params is None or world < 2 or spec.parallel.strategy not in ("ddp", "auto"):
        return []
    link = group_link(Group(world, tpn), site, tpn)
    calls = math.ceil(facts.n_params * REDUCE_BYTES / DDP_BUCKET_BYTES)
    bigger = math.ceil(facts.n_params * REDUCE_BYTES / (BIGGER_BUCKET_MB * 2**20))
    alpha = 2 * (world - 1) * link.latency_us * 1e-6
    if calls == bigger:
        return [f"DDP bucket size: the gradients fit in {calls} bucket(s) of "
                f"{DDP_BUCKET_BYTES // 2**20} MB already; latency {calls * alpha * 1e3:.2f} ms per step"]
    return [f"DDP `bucket_cap_mb` {DDP_BUCKET_BYTES // 2**20} → {BIGGER_BUCKET_MB}: {calls} → {bigger} all-reduce "
            f"calls, latency term {calls * alpha * 1e3:.2f} → {bigger * alpha * 1e3:.2f} ms per step"]

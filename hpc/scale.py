"""Scaling studies: one job per node count, one report of what they measured and what the model predicts.

A study folder ``RUN_ROOT/scale-NAME-STAMP-TOKEN/`` holds ``study.json`` (the points, each with its
run folder), a copy of the spec, and the run folders themselves (each point runs with
``job.run_root`` set to the study folder). Slurm job arrays cannot vary the node count, so every
point is its own job.

- weak mode keeps the per-rank batch: ``global_batch`` grows with the ranks;
- strong mode keeps ``global_batch``: every point must divide it by ranks × micro_batch.

Efficiency is per-rank throughput against the smallest measured point; that one formula is both
weak-scaling efficiency and strong-scaling speedup over the rank ratio. The first
``train.warmup_metrics_steps`` steps of each run are left out of every figure.

Nothing here imports torch; matplotlib is imported only inside ``plot``.
"""

from __future__ import annotations

import csv
import importlib
import io
import json
import math
import os
import secrets
import shutil
import statistics
import time
import typing as tp
from dataclasses import dataclass, replace
from pathlib import Path

from hpc import nccl, runs
from hpc.config import ConfigError
from hpc.plan import MFU_DEFAULT as ASSUMED_MFU  # compute estimate when nothing was measured
from hpc.resolve import resolve, tasks_per_node
from hpc.site import SiteProfile, load_site, parse_site
from hpc.spec import JobSpec, load_spec
from hpc.validate import INT32_MAX

STUDY_FILE = "study.json"
STUDY_VERSION = 1
MODES = ("weak", "strong")
EFFICIENCY_GOAL = 0.9  # below this a point gets a verdict
EXPLAINED_SHARE = 0.5  # a cause must account for at least half of the lost step time
SPLIT_KEYS = ("compute_s", "comm_wait_s", "data_s")  # optional per-step fields of metrics.jsonl
BIGGER_BUCKET_MB = 100


# ---------------------------------------------------------------- starting a study

def parse_nodes(text: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4] (sorted, unique, each at least 1)."""
    try:
        nodes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ConfigError([f"--nodes {text!r}: expected node counts separated by commas, e.g. 1,2,4,8"]) from None
    if not nodes or nodes[0] < 1 or nodes[-1] > INT32_MAX:
        raise ConfigError([f"--nodes {text!r}: expected node counts from 1 to {INT32_MAX}, e.g. 1,2,4,8"])
    return nodes


def point_batch(spec: JobSpec, site: SiteProfile, nodes: int, mode: str) -> tuple[int | None, str | None]:
    """(global_batch, None) for a point, or (None, why not) with the numbers."""
    tpn, g, micro = tasks_per_node(spec, site), spec.train.global_batch, spec.train.micro_batch
    ranks = nodes * tpn
    if mode == "weak":
        base = spec.job.nodes * tpn
        if g % base:
            return None, (f"weak scaling keeps the per-rank batch, but `train.global_batch` = {g} over the spec's "
                          f"{spec.job.nodes} nodes × {tpn} tasks = {base} ranks is not a whole number")
        return g // base * ranks, None
    if g % (ranks * micro):
        return None, (f"strong scaling keeps `train.global_batch` = {g}, but at {nodes} nodes it must divide by "
                      f"ranks × micro_batch = {nodes} × {tpn} × {micro} = {ranks * micro}")
    return g, None


def point_overrides(nodes: int, global_batch: int, steps: int | None, study_dir: Path, name: str) -> list[str]:
    """The ``--set`` overrides that turn the spec into one point of the study."""
    out = [f"job.nodes={nodes}", f"train.global_batch={global_batch}",
           f"job.run_root={json.dumps(str(study_dir))}", f"job.name={json.dumps(f'{name}-n{nodes}')}"]
    return out + ([f"train.steps={steps}"] if steps else [])


def check_steps(spec: JobSpec, steps: int | None) -> list[str]:
    total = steps or spec.train.steps
    if total <= spec.train.warmup_metrics_steps:
        return [f"train.steps = {total} leaves nothing to measure after `train.warmup_metrics_steps` = "
                f"{spec.train.warmup_metrics_steps}: use --steps {spec.train.warmup_metrics_steps + 5} or more"]
    return []


def prepare_points(spec_path: Path, site: SiteProfile, overrides: tp.Sequence[str], nodes: tp.Sequence[int],
                   mode: str, steps: int | None, study_dir: Path) -> list[dict]:
    """Every point's overrides, checked by ``resolve`` before anything is submitted; ConfigError lists all problems."""
    spec = load_spec(spec_path, overrides)
    errors = check_steps(spec, steps)
    points = []
    for n in nodes:
        batch, why = point_batch(spec, site, n, mode)
        if why:
            errors.append(why)
            continue
        extra = point_overrides(n, batch, steps, study_dir, spec.job.name)
        try:
            launch = resolve(load_spec(spec_path, [*overrides, *extra]), site)
        except ConfigError as exc:
            errors += [f"at {n} nodes: {m}" for m in exc.messages]
            continue
        points.append({"nodes": n, "ranks": launch.world_size, "global_batch": batch, "overrides": extra,
                       "strategy": launch.strategy, "run_dir": None, "job_id": None, "error": None})
    if errors:
        raise ConfigError(errors)
    return points


def new_study_dir(root: Path, name: str, group_readable: bool) -> Path:
    path = root / runs.run_dir_name(f"scale-{name}", time.strftime("%Y%m%d-%H%M%S"), secrets.token_hex(3))
    try:
        root.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=runs.modes(group_readable)[1])
    except OSError as exc:
        raise ConfigError([f"run root {root}: cannot create a study folder: {exc.strerror}"]) from None
    return path


def start_study(spec_path: Path, site: SiteProfile, overrides: tp.Sequence[str], nodes: tp.Sequence[int],
                mode: str = "weak", steps: int | None = None) -> Path:
    """Check every point, create the study folder, submit one job per point; returns at once."""
    from hpc import submit as sub

    if mode not in MODES:
        raise ConfigError([f"--mode {mode!r}: expected weak or strong"])
    spec = load_spec(spec_path, overrides)
    group = site.storage.group_readable
    # check every point with a stand-in folder first, so a bad point leaves nothing behind
    prepare_points(spec_path, site, overrides, nodes, mode, steps, Path("/study"))
    with runs.private_umask(group):
        study_dir = new_study_dir(sub.run_root(spec, site), spec.job.name, group)
        shutil.copyfile(spec_path, study_dir / "spec.toml")
        points = prepare_points(spec_path, site, overrides, nodes, mode, steps, study_dir)
        study = {"version": STUDY_VERSION, "name": spec.job.name, "mode": mode, "site": site.name,
                 "site_source": site.source, "spec": str(Path(spec_path).resolve()), "overrides": list(overrides),
                 "steps": steps or spec.train.steps, "warmup_metrics_steps": spec.train.warmup_metrics_steps,
                 "tasks_per_node": tasks_per_node(spec, site), "created_at": time.time(), "points": points}
        runs.write_json(study_dir / STUDY_FILE, study)
        for point in points:
            submit_point(study_dir, study, point, site)
    return study_dir


def submit_point(study_dir: Path, study: dict, point: dict, site: SiteProfile) -> None:
    """Submit one point and record its run folder (or why it failed) in study.json at once."""
    from hpc import submit as sub

    all_overrides = [*study["overrides"], *point["overrides"]]
    try:
        spec = load_spec(study_dir / "spec.toml", all_overrides)
        done = sub.submit(spec, site, resolve(spec, site), study_dir / "spec.toml", all_overrides)
        point.update(run_dir=str(done.run_dir), job_id=done.job_id)
    except Exception as exc:  # noqa: BLE001 - one refused point must not lose the others
        lines = str(exc).strip().splitlines()
        point["error"] = "submission failed: " + (lines[-1] if lines else type(exc).__name__)
    runs.write_json(study_dir / STUDY_FILE, study)


def read_study(path: Path) -> dict:
    study = runs.read_json(Path(path) / STUDY_FILE)
    if not study:
        raise ConfigError([f"{path}: not a scaling study (no {STUDY_FILE})"])
    return study


def point_state(point: dict) -> str:
    """The scheduler's state of a point's job (SUBMIT FAILED when it never reached the scheduler)."""
    from hpc import submit as sub

    if not point.get("run_dir"):
        return "SUBMIT FAILED"
    return sub.job_state(Path(point["run_dir"])).state


def follow_study(study_dir: Path, on_change: tp.Callable[[dict, str], None], poll_s: float = 5.0,
                 state_of: tp.Callable[[dict], str] | None = None, timeout_s: float | None = None) -> dict[int, str]:
    """Poll until every point's job has ended (or ``timeout_s``); ``on_change(point, state)`` on each change."""
    from hpc.scheduler import TERMINAL

    state_of, start = state_of or point_state, time.time()
    seen: dict[int, str] = {}
    while True:
        for point in read_study(study_dir)["points"]:
            state = state_of(point)
            if seen.get(point["nodes"]) != state:
                seen[point["nodes"]] = state
                on_change(point, state)
        if all(s in TERMINAL or s == "SUBMIT FAILED" for s in seen.values()):
            return seen
        if timeout_s is not None and time.time() - start > timeout_s:
            return seen
        time.sleep(poll_s)


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
    """``dict(compute_s, comm_s, tokens_per_s, limiting_link)`` of one step at ``nodes`` nodes.

    The planner's own ``hpc.plan.predicted_step`` when it has one; else the α-β communication of
    ``hpc.comm.step_comm`` plus compute at ASSUMED_MFU of the site's peak (None where unknown).
    Step time is compute + communication (no overlap: a lower bound on throughput).
    """
    planner = getattr(importlib.import_module("hpc.plan"), "predicted_step", None)
    if planner is not None:
        return planner(spec, site, nodes)
    return alpha_beta_step(spec, site, nodes)


def alpha_beta_step(spec: JobSpec, site: SiteProfile, nodes: int) -> dict[str, tp.Any]:
    """The planner's pieces for one point: its strategy choice, ``step_comm`` and ``compute_seconds``."""
    from hpc import plan
    from hpc.comm import step_comm
    from hpc.memory import Config

    facts, setup, t = plan.model_facts(spec), plan.setup_of(spec, site, nodes), spec.train
    if facts.n_params is None or facts.gpt is None or t.global_batch % (setup.world * t.micro_batch):
        return {"compute_s": None, "comm_s": None, "tokens_per_s": None, "limiting_link": ""}
    strategy, sharding, shard, _ = plan.choose(spec, site, nodes)
    if strategy != "hsdp":
        shard = setup.world if strategy == "fsdp" and sharding != "no_shard" else 1
    cfg = Config(strategy, sharding, shard, spec.parallel.cpu_offload, spec.parallel.mixed_precision,
                 spec.parallel.activation_checkpointing, t.micro_batch, spec.model.dropout)
    comm = step_comm(facts, cfg, site, nodes, setup.tasks_per_node, setup.grad_accum)
    compute = plan.compute_seconds(facts, setup, site, ASSUMED_MFU)
    comm_s = comm.seconds if comm else None
    step = None if compute is None or comm_s is None else compute + comm_s
    return {"compute_s": compute, "comm_s": comm_s, "limiting_link": comm.slowest_link if comm else "",
            "tokens_per_s": t.global_batch * facts.gpt.seq_len / step if step else None}


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


# ---------------------------------------------------------------- measuring

def measure(run_dir: Path, warmup_steps: int) -> dict[str, tp.Any] | None:
    """Medians over the steps after warm-up; None when no such step was logged."""
    steady = [r for r in runs.read_jsonl(run_dir / "metrics.jsonl")
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
        return load_spec(self.dir / "spec.toml", [*self.doc["overrides"], *self.point(nodes)["overrides"]], paths=False)


def study_site(study: dict) -> SiteProfile:
    """The site as the runs saw it (resolved.json), else the profile by its recorded path or name."""
    for point in study["points"]:
        doc = runs.read_json(Path(point["run_dir"]) / "resolved.json").get("site") if point.get("run_dir") else None
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
    state_of = state_of or point_state
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
                                   / (base["predicted_tokens_per_s"] / base["ranks"]) if ok else None)


# ---------------------------------------------------------------- verdicts

def add_verdict(row: dict, base: dict | None, study: Study) -> None:
    """``verdict`` (one line) and ``advice`` (lines with numbers) for a point short of EFFICIENCY_GOAL.

    The step time lost against linear scaling is blamed on data loading or communication when that
    one grew by at least EXPLAINED_SHARE of the loss: measured (``data_s``, ``comm_wait_s``) where
    the trainer logs them, else the α-β model's communication.
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
    grew, source = (comm_grew, "measured communication wait") if comm_grew is not None else (model_grew, "α-β model")
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
    workers = spec.data.num_workers
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
    from hpc.comm import Group, group_link
    from hpc.memory import DDP_BUCKET_BYTES, REDUCE_BYTES

    from hpc.plan import model_facts

    facts, tpn = model_facts(spec), tasks_per_node(spec, site)
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


# ---------------------------------------------------------------- output

COLUMNS = ("nodes", "ranks", "state", "global_batch", "tokens_per_s", "tokens_per_s_per_rank", "efficiency",
           "step_time_s", *SPLIT_KEYS, "predicted_tokens_per_s", "predicted_efficiency", "predicted_comm_s",
           "limiting_link", "verdict", "run_dir")
TABLE = (("nodes", "nodes", "{}"), ("ranks", "ranks", "{}"), ("state", "state", "{}"),
         ("tokens_per_s", "tok/s", "{:,.0f}"), ("tokens_per_s_per_rank", "tok/s/rank", "{:,.0f}"),
         ("efficiency", "eff", "{:.0%}"), ("step_time_s", "step ms", "{:.1f}"),
         ("split", "compute/comm/data ms", "{}"), ("predicted_tokens_per_s", "pred tok/s", "{:,.0f}"),
         ("predicted_efficiency", "pred eff", "{:.0%}"))


def cell(row: dict, key: str, fmt: str) -> str:
    if key == "split":
        if all(row[k] is None for k in SPLIT_KEYS):
            return "not measured"
        return "/".join("-" if row[k] is None else f"{row[k] * 1e3:.1f}" for k in SPLIT_KEYS)
    value = row.get(key)
    if value is None:
        return "-"
    return fmt.format(value * 1e3 if key == "step_time_s" else value)


def table_lines(report: dict) -> list[str]:
    cells = [[title for _, title, _ in TABLE]] + [[cell(r, k, f) for k, _, f in TABLE] for r in report["points"]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(TABLE))]
    return ["  ".join(c.rjust(w) if i != 2 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
            for row in cells]


def notes(report: dict) -> list[str]:
    """Lines under the table: baseline, basis, verdicts, advice, transports, unmeasured points."""
    out = []
    base = report["baseline_nodes"]
    out.append(f"efficiency: tok/s per rank against the smallest measured point ({base} nodes)" if base
               else "efficiency: no point has measured steps yet")
    anchored = report["prediction_basis"] == "anchored"
    out.append("prediction: α-β communication + compute measured at the smallest point" if anchored
               else f"prediction: planner model (α-β communication + compute at {ASSUMED_MFU:.0%} of peak)")
    for r in report["points"]:
        head = f"{r['nodes']} nodes: "
        if r.get("error"):
            out.append(head + r["error"])
        elif not r["tokens_per_s"]:
            out.append(head + f"{r['state']}, nothing measured after warm-up")
        if r.get("verdict"):
            out.append(head + r["verdict"])
            out += [f"    try: {a}" for a in r["advice"]]
        if r.get("predicted_comm_s") is None and r.get("error") is None:
            out.append(head + "no predicted communication: the model needs the model's size and the site's "
                       "bandwidths (node.intra_bandwidth_gbs, network.bandwidth_gbs)")
        elif r.get("predicted_tokens_per_s") is None and r.get("error") is None:
            out.append(head + "no predicted throughput: no compute figure (node.gpu_peak_tflops unset, "
                       "and no measured smallest point with known communication to anchor on)")
        if r.get("nccl"):
            out.append(head + "NCCL " + r["nccl"])
        out += [f"    transport mismatch: {p}" for p in r.get("nccl_problems", [])]
    return out


def write_csv(report: dict, path: Path, mode: int = 0o600) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in report["points"]:
        writer.writerow({k: "" if row.get(k) is None else row[k] for k in COLUMNS})
    runs.write_atomic(path, buf.getvalue(), mode)


def markdown(report: dict) -> str:
    head = [title for _, title, _ in TABLE]
    lines = [f"# Scaling study {report['name']} ({report['mode']} scaling, site {report['site']})", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell(r, k, f) for k, _, f in TABLE) + " |" for r in report["points"]]
    lines += [""] + [f"- {n.strip()}" for n in notes(report)]
    return "\n".join(lines + ["", "![throughput and efficiency](report.png)", ""])


def plot(report: dict, path: Path | None = None, mode: int = 0o600) -> tp.Any:
    """Throughput and efficiency vs nodes, measured beside predicted (and linear); returns the Figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    rows = report["points"]
    nodes = [r["nodes"] for r in rows]
    base = next((r for r in rows if r["nodes"] == report["baseline_nodes"]), None)
    for i, (key, title) in enumerate((("tokens_per_s", "throughput (tokens/s)"), ("efficiency", "scaling efficiency"))):
        ax = fig.add_subplot(1, 2, i + 1)
        for prefix, style, label in (("", "o-", "measured"), ("predicted_", "s--", "predicted")):
            pts = [(r["nodes"], r[prefix + key]) for r in rows if r.get(prefix + key) is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label if pts else f"{label} (none)")
        if base:
            ideal = [base["tokens_per_s_per_rank"] * r["ranks"] if key == "tokens_per_s" else 1.0 for r in rows]
            ax.plot(nodes, ideal, ":", color="gray", label="linear")
        ax.set_xscale("log", base=2)
        ax.set_xticks(nodes, [str(n) for n in nodes])
        ax.set_xlabel("nodes")
        ax.set_title(title)
        ax.legend()
        ax.grid(True, alpha=0.3)
    fig.axes[1].set_ylim(bottom=0)
    fig.suptitle(f"{report['name']}: {report['mode']} scaling on {report['site']}")
    if path is not None:
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        write_bytes(Path(path), buf.getvalue(), mode)
    return fig


def write_bytes(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_report(report: dict, study_dir: Path, group_readable: bool = False) -> dict[str, str]:
    """report.csv, report.md and report.png in the study folder (0600, or 0640); returns their paths."""
    study_dir, mode = Path(study_dir), runs.modes(group_readable)[2]
    files = {"csv": study_dir / "report.csv", "md": study_dir / "report.md", "png": study_dir / "report.png"}
    write_csv(report, files["csv"], mode)
    runs.write_atomic(files["md"], markdown(report), mode)
    plot(report, files["png"], mode)
    return {k: str(v) for k, v in files.items()}


# ---------------------------------------------------------------- predict only

def predict_table(spec: JobSpec, site: SiteProfile, nodes: tp.Sequence[int], mode: str) -> list[dict]:
    """The model alone at each size (no cluster needed): compute, communication, throughput, efficiency."""
    rows, ref = [], None
    for n in nodes:
        batch, why = point_batch(spec, site, n, mode)
        if why:
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

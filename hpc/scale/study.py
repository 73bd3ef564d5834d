"""Starting and following a scaling study: one job per node count, each an ordinary run folder.

A study folder ``RUN_ROOT/scale-NAME-STAMP-TOKEN/`` holds ``study.json`` (the points, each with its
run folder), a copy of the spec, and the run folders themselves (each point runs with
``job.run_root`` set to the study folder). Slurm job arrays cannot vary the node count, so every
point is its own job.

- weak mode keeps the per-rank batch: ``global_batch`` grows with the ranks;
- strong mode keeps ``global_batch``: every point must divide it by ranks × micro_batch.
"""

from __future__ import annotations

import json
import secrets
import shutil
import time
import typing as tp
from pathlib import Path

from hpc.core import runs
from hpc.core.config import ConfigError
from hpc.core.resolve import tasks_per_node
from hpc.plan.resolve import resolve
from hpc.core.site import SiteProfile
from hpc.core.spec import JobSpec, load_spec
from hpc.core.validate import INT32_MAX, check_batch
from hpc.login import submit as sub
from hpc.schedulers import TERMINAL

STUDY_FILE = "study.json"  # the points, each with its run folder
STUDY_SPEC = "spec.toml"  # the study's copy of the spec
STUDY_VERSION = 1
MODES = ("weak", "strong")


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
    if check_batch(g, micro, ranks):
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
        if batch is None:
            errors.append(why or "")
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
    if mode not in MODES:
        raise ConfigError([f"--mode {mode!r}: expected weak or strong"])
    spec = load_spec(spec_path, overrides)
    group = site.storage.group_readable
    # check every point with a stand-in folder first, so a bad point leaves nothing behind
    prepare_points(spec_path, site, overrides, nodes, mode, steps, Path("/study"))
    with runs.private_umask(group):
        study_dir = new_study_dir(sub.run_root(spec, site), spec.job.name, group)
        shutil.copyfile(spec_path, study_dir / STUDY_SPEC)
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
    all_overrides = [*study["overrides"], *point["overrides"]]
    try:
        spec = load_spec(study_dir / STUDY_SPEC, all_overrides)
        done = sub.submit(spec, site, resolve(spec, site), study_dir / STUDY_SPEC, all_overrides)
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
    if not point.get("run_dir"):
        return "SUBMIT FAILED"
    return sub.job_state(Path(point["run_dir"])).state


def follow_study(study_dir: Path, on_change: tp.Callable[[dict, str], None], poll_s: float = 5.0,
                 state_of: tp.Callable[[dict], str] | None = None, timeout_s: float | None = None) -> dict[int, str]:
    """Poll until every point's job has ended (or ``timeout_s``); ``on_change(point, state)`` on each change."""
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

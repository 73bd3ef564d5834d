"""Submission and following: the I/O edge around the pure render.

``submit`` creates the run folder, writes the spec, the resolved plan and the
rendered script, and hands ``TrainTask(run_dir)`` to submitit: ``AutoExecutor``
for Slurm sites, the local executor for ``local``.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import sys
import time
import typing as tp
from dataclasses import dataclass
from pathlib import Path

from hpc import render as rnd
from hpc.config import ConfigError
from hpc import roots, runs, scheduler
from hpc.resolve import Launch, resolved_document
from hpc.site import SiteProfile
from hpc.spec import JobSpec
from hpc.validate import expand_run_root


@dataclass
class Submitted:
    run_dir: Path
    job_id: str
    scheduler: str
    warning: str | None = None  # the run root could not be recorded in the index (hpc/roots.py)


def run_root(spec: JobSpec, site: SiteProfile) -> Path:
    """The spec's `job.run_root` when set, else the site's."""
    if spec.job.run_root:
        return expand_run_root(spec.job.run_root, f"{spec.source}: `job.run_root` = {spec.job.run_root!r}")
    return site.run_root()


def make_executor(spec: JobSpec, site: SiteProfile, launch: Launch, folder: Path) -> tp.Any:
    import submitit

    if site.is_slurm:
        executor = submitit.AutoExecutor(folder=folder, cluster="slurm",
                                         slurm_max_num_timeout=spec.job.max_requeues)
        params = rnd.slurm_parameters(spec, site, launch)
        executor.update_parameters(**{f"slurm_{k}": v for k, v in params.items()})
        return executor
    # LocalExecutor directly: AutoExecutor does not pass signal_delay_s through to it
    executor = submitit.LocalExecutor(folder=folder, max_num_timeout=spec.job.max_requeues)
    executor.update_parameters(**rnd.local_parameters(spec, launch))
    return executor


def submit(spec: JobSpec, site: SiteProfile, launch: Launch, spec_path: Path,
           overrides: tp.Sequence[str] = ()) -> Submitted:
    """Create the run folder and submit; returns as soon as the scheduler has the job.

    A file that cannot be written (a full disk, a quota) leaves nothing behind: the run folder is
    removed, a job already handed to the scheduler is cancelled, and the ConfigError says which.
    """
    from trainer.task import TrainTask  # no torch at import time

    group = site.storage.group_readable
    with runs.private_umask(group):
        run_dir = runs.new_run_dir(run_root(spec, site), spec.job.name, group)
        try:
            write_run_files(spec, site, launch, run_dir, spec_path, overrides)
        except OSError as exc:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise ConfigError([f"{run_dir}: cannot write the run folder ({exc.strerror}): nothing was "
                               "submitted and the folder was removed"]) from None
        job = submit_or_clean_up(make_executor(spec, site, launch, run_dir / rnd.SUBMITIT_DIR),
                                 TrainTask(str(run_dir)), run_dir)
        try:
            record_job(run_dir, job, site)
        except OSError as exc:
            job.cancel(check=False)
            shutil.rmtree(run_dir, ignore_errors=True)
            raise ConfigError([f"{run_dir}: cannot write job.json ({exc.strerror}): job {job.job_id} was "
                               "cancelled and the run folder removed"]) from None
    return Submitted(run_dir, str(job.job_id), site.scheduler.kind, roots.remember_or_warn(run_dir.parent))


def write_run_files(spec: JobSpec, site: SiteProfile, launch: Launch, run_dir: Path, spec_path: Path,
                    overrides: tp.Sequence[str]) -> None:
    """spec.toml, resolved.json and render.txt: everything the job reads, before it exists."""
    try:
        shutil.copyfile(spec_path, run_dir / "spec.toml")
    except FileNotFoundError:
        pass  # the spec was deleted since it was read: resolved.json has it all
    doc = resolved_document(spec, site, launch, str(run_dir))
    doc["overrides"] = list(overrides)
    runs.write_json(run_dir / "resolved.json", doc)
    runs.write_atomic(run_dir / "render.txt", rnd.render(spec, site, launch, str(run_dir), sys.executable))


def record_job(run_dir: Path, job: tp.Any, site: SiteProfile) -> None:
    """job.json and the first state line: what status, logs and cancel find the job by."""
    info = {"job_id": str(job.job_id), "scheduler": site.scheduler.kind, "site": site.name,
            "submitted_at": time.time(), "python": sys.executable}
    runs.write_json(run_dir / "job.json", info)
    runs.append_jsonl(run_dir / "states.jsonl", {"state": "SUBMITTED", "time": time.time()})


# States nothing comes back from (a requeue passes through REQUEUED/PREEMPTED/FAILED, never these):
# once recorded, the scheduler is not asked again, so `hpcx status` over many old runs stays fast.
FINAL = ("COMPLETED", "CANCELLED")


def submit_or_clean_up(executor: tp.Any, task: tp.Any, run_dir: Path) -> tp.Any:
    """Submit; if the scheduler refuses (bad partition, account, QOS …), remove the run folder
    and say why in one line: no half-made run is left behind."""
    from submitit.core.utils import FailedJobError, FailedSubmissionError

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit echoes sbatch's stderr; we say it once
            return executor.submit(task)
    except OSError as exc:  # submitit writes its pickles and script into the run folder, then runs sbatch
        shutil.rmtree(run_dir, ignore_errors=True)
        ours = str(exc.filename or run_dir).startswith(str(run_dir))
        what = "write the job's files" if ours else f"run {exc.filename}"
        raise ConfigError([f"{run_dir}: cannot {what} ({exc.strerror or exc}): nothing was submitted and the "
                           "folder was removed"]) from None
    except (FailedJobError, FailedSubmissionError) as exc:
        shutil.rmtree(run_dir, ignore_errors=True)
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raise ConfigError([f"the scheduler refused the job: {'; '.join(lines) or type(exc).__name__}"]) from None


def job_state(run_dir: Path) -> scheduler.JobState:
    """The scheduler's current state; records it in states.jsonl when it changed."""
    info = runs.read_json(run_dir / "job.json")
    if not info:
        return scheduler.JobState("NOT SUBMITTED")
    seen = runs.read_jsonl(run_dir / "states.jsonl")
    if seen and seen[-1].get("state", "").startswith(FINAL):
        return scheduler.JobState(seen[-1]["state"], seen[-1].get("nodes", ""), "states.jsonl")
    if info["scheduler"] == "slurm":
        state = scheduler.slurm_state(info["job_id"])
    else:
        state = scheduler.local_state(info["job_id"], run_dir / rnd.SUBMITIT_DIR)
    if state.state != "UNKNOWN" and (not seen or seen[-1].get("state") != state.state):
        runs.append_jsonl(run_dir / "states.jsonl", {"state": state.state, "nodes": state.nodes, "time": time.time()})
    return state


def summary(run_dir: Path) -> dict[str, tp.Any]:
    """Everything `hpcx status RUN` shows, as plain data."""
    info = runs.read_json(run_dir / "job.json")
    state = job_state(run_dir)
    metrics = runs.read_jsonl(run_dir / "metrics.jsonl")
    ledger = runs.read_jsonl(run_dir / "ledger.jsonl")
    launch = runs.read_json(run_dir / "resolved.json").get("launch", {})
    starts = [e for e in ledger if e.get("event") == "start"]
    last = metrics[-1] if metrics else {}
    return {
        "run_dir": str(run_dir),
        "job_id": info.get("job_id"),
        "scheduler": info.get("scheduler"),
        "state": state.state,
        "nodes": state.nodes,
        "states": [s["state"] for s in runs.read_jsonl(run_dir / "states.jsonl")],
        "step": last.get("step"),
        "loss": last.get("loss"),
        "restarts": max(0, len(starts) - 1),
        "strategy": launch.get("strategy"),
        "world_size": launch.get("world_size"),
        "ledger": ledger_summary(ledger),
    }


def ledger_summary(ledger: list[dict]) -> dict[str, tp.Any]:
    """Goodput figures from the ledger's start/stop lines."""
    stops = [e for e in ledger if e.get("event") == "stop"]
    return {
        "starts": sum(1 for e in ledger if e.get("event") == "start"),
        "steps_recomputed": sum(e.get("steps_recomputed", 0) for e in ledger if e.get("event") == "start"),
        "save_s": round(sum(e.get("save_s", 0.0) for e in stops), 3),
        "restore_s": round(sum(e.get("restore_s", 0.0) for e in ledger if e.get("event") == "start"), 3),
        "queue_wait_s": round(sum(e.get("queue_wait_s", 0.0) for e in ledger if e.get("event") == "start"), 3),
    }


def result(run_dir: Path) -> tuple[str, object] | None:
    """Rank 0's return value (or its error) once the job has ended."""
    info = runs.read_json(run_dir / "job.json")
    path = run_dir / rnd.SUBMITIT_DIR / f"{info.get('job_id')}_0_result.pkl"
    return scheduler.read_result(path) if path.exists() else None


def wait(run_dir: Path, on_poll: tp.Callable[[dict], None], poll_s: float = 2.0,
         timeout_s: float | None = None) -> dict[str, tp.Any]:
    """Poll until the job reaches a terminal state; ``on_poll`` gets each summary."""
    start = time.time()
    while True:
        info = summary(run_dir)
        on_poll(info)
        if info["state"] in scheduler.TERMINAL:
            return info
        if timeout_s is not None and time.time() - start > timeout_s:
            return info
        time.sleep(poll_s)


def cancel(run_dir: Path) -> bool:
    info = runs.read_json(run_dir / "job.json")
    if not info:
        return False
    if info["scheduler"] == "slurm":
        return scheduler.cancel_slurm(info["job_id"])
    return scheduler.cancel_local(info["job_id"])

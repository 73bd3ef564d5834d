"""Submission and following: the I/O edge around the pure render.

``submit`` creates the run folder, writes the spec, the resolved plan and the
rendered script, and hands ``TrainTask(run_dir)`` (or, in script mode, ``ScriptTask``) to the site's scheduler
(``hpc.schedulers``: submitit's Slurm or local executor). ``status``/``cancel``
need none of the spec machinery, so it is imported only to submit.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
import threading
import time
import typing as tp
from dataclasses import dataclass
from pathlib import Path

from hpc.login import roots
from hpc.login.evals import eval_metrics
from hpc.core import health, runs, straggler
from hpc import schedulers
from hpc.core.config import ConfigError
from hpc.core.errors import UserError
from hpc.schedulers.base import QUERY_TIMEOUT_S, read_result, result_path
from hpc.core.runroot import expand_run_root

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.core.resolve import Launch
    from hpc.core.site import SiteProfile
    from hpc.core.spec import JobSpec


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


def submit(spec: JobSpec, site: SiteProfile, launch: Launch, spec_path: Path,
           overrides: tp.Sequence[str] = ()) -> Submitted:
    """Create the run folder and submit; returns as soon as the scheduler has the job.

    A file that cannot be written (a full disk, a quota) leaves nothing behind: the run folder is
    removed, a job already handed to the scheduler is cancelled, and the ConfigError says which.
    """
    group = site.storage.group_readable
    sched = schedulers.get(site.scheduler.kind)
    with runs.private_umask(group):
        run_dir = runs.new_run_dir(run_root(spec, site), spec.job.name, group)
        rd = runs.RunDir(run_dir)
        try:
            step = sched.step(spec, site, launch, str(run_dir), sys.executable)  # the one step of this submit
            write_run_files(spec, site, launch, rd, spec_path, overrides, step)
            executor = sched.executor(spec, site, launch, rd.submitit, step)  # a container's overlay and bundle
        except OSError as exc:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise ConfigError([f"{run_dir}: cannot write the run folder ({exc.strerror}): nothing was "
                               "submitted and the folder was removed"]) from None
        except UserError:  # refused before anything was submitted (the job's image, a mount): nothing left
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
        task = rank_task(spec, run_dir, os.getcwd())
        job = submit_or_clean_up(executor, task, run_dir)
        try:
            record_job(rd, job, site, sched)
        except OSError as exc:
            job.cancel(check=False)
            shutil.rmtree(run_dir, ignore_errors=True)
            raise ConfigError([f"{run_dir}: cannot write job.json ({exc.strerror}): job {job.job_id} was "
                               "cancelled and the run folder removed"]) from None
    return Submitted(run_dir, str(job.job_id), site.scheduler.kind, roots.remember_or_warn(run_dir.parent))


def resume(run_dir: Path) -> Submitted:
    """Submit the run in ``run_dir`` again, into the same folder: the trainer resumes from its newest
    committed checkpoint and writes a new start in the ledger (``hpcx resume``: a cancelled, failed or
    timed-out run). UserError while its job may still run, or when it completed its steps."""
    rd = runs.RunDir(run_dir)
    check_resumable(rd)
    spec, site, launch = recorded_job(rd)
    problems = base_problems(spec)
    if problems:
        raise ConfigError([f"{rd.path}: {p}" for p in problems])
    sched = schedulers.get(site.scheduler.kind)
    with runs.private_umask(site.storage.group_readable):
        executor = sched.executor(spec, site, launch, rd.submitit)
        previous = job_info(rd)
        task = rank_task(spec, rd.path, str(rd.read_resolved().get("workdir") or os.getcwd()))
        job = submit_or_clean_up(executor, task, rd.path, remove=False)
        try:
            record_job(rd, job, site, sched, previous)
        except OSError as exc:
            job.cancel(check=False)
            raise ConfigError([f"{rd.path}: cannot write job.json ({exc.strerror}): job {job.job_id} was "
                               "cancelled"]) from None
    return Submitted(rd.path, str(job.job_id), site.scheduler.kind)


def base_problems(spec: JobSpec) -> list[str]:
    """A LoRA run reads its frozen base from ``checkpoint.init_from`` again at every start (its
    checkpoints hold the adapters only): before a resume is queued, that base (and a PEFT folder's
    config) checked as at submit, from headers. A full run's resume reads its own checkpoint only."""
    if not (spec.lora.enabled and spec.checkpoint.init_from):
        return []
    from hpc.core.peft_config import config_problems  # lazy: startup

    problems = config_problems(spec)
    if problems:
        return problems
    from hpc.ckpt.init_source import init_from_problems  # lazy: torch

    return init_from_problems(spec)


def rank_task(spec: JobSpec, run_dir: Path, workdir: str) -> tp.Any:
    """What submitit runs on every rank: hpcx's trainer (``TrainTask``), or the spec's own command
    (``ScriptTask``: script mode) in ``workdir``, the folder ``hpcx submit`` ran in. Both torch-free."""
    from hpc.core.workload import ScriptWorkload  # lazy: startup

    if isinstance(spec.workload, ScriptWorkload):
        from trainer.script import ScriptTask  # lazy: startup

        return ScriptTask(str(run_dir), workdir)
    from trainer.task import TrainTask  # lazy: startup

    return TrainTask(str(run_dir))


def check_resumable(rd: runs.RunDir) -> None:
    """UserError unless the run was submitted, its job has ended and its steps are not all done."""
    info = job_info(rd)
    if not rd.exists() or not info:
        raise UserError([f"{rd.path}: no job.json: this run was never submitted (hpcx submit makes a run)"])
    state = job_state(rd.path)
    if not state.done:
        raise UserError([f"{rd.name}: job {info['job_id']} is {state.words}: wait for it to end, or "
                         f"`hpcx cancel {rd.name}` first"])
    stops = [e for e in rd.read_ledger() if e.get("event") == "stop"]
    if stops and stops[-1].get("reason") == "completed":
        if "command_status" in stops[-1]:  # script mode: the command ended with 0 and asked for nothing
            raise UserError([f"{rd.name}: its command completed: nothing to resume"])
        raise UserError([f"{rd.name}: completed its {stops[-1].get('step')} steps: nothing to resume "
                         "(submit a spec with more `train.steps` to train further)"])


def recorded_job(rd: runs.RunDir) -> tuple[JobSpec, SiteProfile, Launch]:
    """(spec, site, launch) as ``resolved.json`` recorded them at submit (what every rank reads)."""
    from hpc.core.resolve import Launch, decided  # lazy: startup
    from hpc.core.site import parse_site  # lazy: startup
    from hpc.core.spec import spec_from_dict  # lazy: startup

    doc = rd.read_resolved()
    try:
        spec = spec_from_dict(doc["spec"], str(rd.resolved), read_hf_config=False)
        site_doc = dict(doc["site"])
        name, source = site_doc.pop("name"), site_doc.pop("source", "")
        site = parse_site(site_doc, name, source or str(rd.resolved))
        launch = decided(spec, Launch.from_dict(doc["launch"]))
    except (KeyError, TypeError) as exc:
        raise ConfigError([f"{rd.resolved}: not a resolved run (missing {exc}): cannot resume it"]) from None
    return spec, site, launch


def write_run_files(spec: JobSpec, site: SiteProfile, launch: Launch, rd: runs.RunDir, spec_path: Path,
                    overrides: tp.Sequence[str], step: schedulers.Step) -> None:
    """spec.toml, resolved.json and render.txt (rendered from the submission's ``step``): everything the
    job reads, before it exists."""
    try:
        shutil.copyfile(spec_path, rd.spec)
    except FileNotFoundError:
        pass  # the spec was deleted since it was read: resolved.json has it all
    from hpc.core.resolve import resolved_document  # lazy: startup

    doc = resolved_document(spec, site, launch, str(rd.path))
    doc["overrides"] = list(overrides)
    doc["workdir"] = os.getcwd()  # where a script-mode command runs (and resumes)
    runs.write_json(rd.resolved, doc)
    text = schedulers.get(site.scheduler.kind).render(spec, site, launch, str(rd.path), sys.executable, step)
    runs.write_atomic(rd.render, text)


def record_job(rd: runs.RunDir, job: tp.Any, site: SiteProfile, sched: schedulers.Scheduler,
               previous: dict | None = None) -> None:
    """job.json and the first state line: what status, logs and cancel find the job by (with what the
    scheduler records to recognise its job later, e.g. the local controller's identity). After a
    resume, ``previous`` (the job before) is kept in ``job.json``'s ``earlier`` list."""
    info = {"job_id": str(job.job_id), "scheduler": site.scheduler.kind, "site": site.name,
            "submitted_at": time.time(), "python": sys.executable, **sched.job_record(str(job.job_id))}
    if previous:
        earlier = previous.pop("earlier", [])
        info["earlier"] = [*earlier, previous]
    runs.write_json(rd.job, info)
    runs.append_jsonl(rd.states, {"state": "SUBMITTED", "time": time.time()})


# States nothing comes back from (a requeue passes through REQUEUED/PREEMPTED/FAILED, never these):
# once recorded, the scheduler is not asked again, so `hpcx status` over many old runs stays fast.
FINAL = ("COMPLETED", "CANCELLED")


def submit_or_clean_up(executor: tp.Any, task: tp.Any, run_dir: Path, remove: bool = True) -> tp.Any:
    """Submit; if the scheduler refuses (bad partition, account, QOS …), remove the run folder
    (unless not ``remove``: a resumed run's folder is kept as it was) and say why in one line: no
    half-made run is left behind."""
    from submitit.core.utils import FailedJobError, FailedSubmissionError  # lazy: submitit

    removed = "folder was removed" if remove else "folder is as it was"
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit echoes sbatch's stderr; we say it once
            return executor.submit(task)
    except OSError as exc:  # submitit writes its pickles and script into the run folder, then runs sbatch
        if remove:
            shutil.rmtree(run_dir, ignore_errors=True)
        ours = str(exc.filename or run_dir).startswith(str(run_dir))
        what = "write the job's files" if ours else f"run {exc.filename}"
        raise ConfigError([f"{run_dir}: cannot {what} ({exc.strerror or exc}): nothing was submitted and the "
                           f"{removed}"]) from None
    except (FailedJobError, FailedSubmissionError) as exc:
        if remove:
            shutil.rmtree(run_dir, ignore_errors=True)
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raise ConfigError([f"the scheduler refused the job: {'; '.join(lines) or type(exc).__name__}"]) from None


def job_state(run_dir: Path, timeout: float = QUERY_TIMEOUT_S) -> schedulers.JobState:
    """The scheduler's current state; records it in states.jsonl when it changed."""
    return job_states([run_dir], timeout)[run_dir]


def job_states(run_dirs: tp.Sequence[Path], timeout: float = QUERY_TIMEOUT_S,
               tolerant: bool = False) -> dict[Path, schedulers.JobState]:
    """The current state of each run, asking each scheduler once for all of its runs (within
    ``timeout`` seconds; UNKNOWN with the reason when it does not answer); a state that changed is
    recorded in the run's states.jsonl. Runs recorded COMPLETED/CANCELLED are not asked about."""
    return ask_states(run_dirs, timeout, tolerant)()


def ask_states(run_dirs: tp.Sequence[Path], timeout: float = QUERY_TIMEOUT_S,
               tolerant: bool = False) -> tp.Callable[[], dict[Path, schedulers.JobState]]:
    """``job_states`` in two halves: the schedulers are asked now, in the background; the function
    returned waits for their answers, records what changed and returns every run's state. What the
    caller reads meanwhile (``hpcx status`` reads each run's files) overlaps the scheduler's answer."""
    out, asked, same_id = _to_ask(run_dirs, tolerant)
    # each scheduler is loaded here, so that its thread starts its commands at once
    pending = {kind: _in_background(_asker(kind), jobs, timeout) for kind, jobs in asked.items()}

    def answered() -> dict[Path, schedulers.JobState]:
        answers = {kind: wait() for kind, wait in pending.items()}
        for kind, job_id, run_dir in [(k, j, r) for k, jobs in asked.items() for j, r in jobs.items()] + same_id:
            state = answers[kind][job_id]
            out[run_dir] = recorded_if_unreachable(run_dir, state)
            _record(run_dir, state)
        return out

    return answered


def _in_background(ask: tp.Callable, *args: tp.Any) -> tp.Callable[[], tp.Any]:
    """``ask(*args)`` in a thread; the function returned waits for its answer (or raises what it raised).
    The scheduler bounds its own wait (``timeout``), so the join needs none."""
    box: dict[str, tp.Any] = {}

    def run() -> None:
        try:
            box["answer"] = ask(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller, raised there
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def wait() -> tp.Any:
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["answer"]

    return wait


def _to_ask(run_dirs: tp.Sequence[Path], tolerant: bool) -> tuple[dict, dict[str, dict[str, Path]], list]:
    """(states already known from the run folders, scheduler kind -> job id -> run to ask about, runs
    sharing an asked job id)."""
    out: dict[Path, schedulers.JobState] = {}
    asked: dict[str, dict[str, Path]] = {}
    same_id: list[tuple[str, str, Path]] = []  # a job id two run folders share (another cluster, a reused pid)
    for run_dir in run_dirs:
        try:
            info, seen = job_info(runs.RunDir(run_dir)), runs.RunDir(run_dir).read_states()
        except (OSError, ConfigError) as exc:
            if not tolerant and isinstance(exc, ConfigError):
                raise
            out[run_dir] = unreadable(exc)
            continue
        if not info:
            out[run_dir] = not_submitted(runs.RunDir(run_dir))
        elif seen and (seen[-1].get("state", "").startswith(FINAL) or settled(runs.RunDir(run_dir), seen[-1])):
            why = {"reason": seen[-1]["reason"]} if seen[-1].get("reason") else {}
            out[run_dir] = schedulers.JobState(seen[-1]["state"], seen[-1].get("nodes", ""), "states.jsonl", why)
        elif str(info["job_id"]) in asked.get(info["scheduler"], {}):
            same_id.append((info["scheduler"], str(info["job_id"]), run_dir))
        else:
            asked.setdefault(info["scheduler"], {})[str(info["job_id"])] = run_dir
    return out, asked, same_id


def unreadable(exc: Exception) -> schedulers.JobState:
    """UNREADABLE, with why (the one-line ConfigError, or the OS's words)."""
    why = exc.messages[0] if isinstance(exc, ConfigError) else (getattr(exc, "strerror", None) or str(exc))
    return schedulers.JobState("UNREADABLE", detail={"reason": why})


def summaries(run_dirs: tp.Sequence[Path], timeout: float = QUERY_TIMEOUT_S) -> list[dict[str, tp.Any]]:
    """``summary`` of each run, states asked in one batch; a run folder that cannot be read is a row
    that says so, never an error. Each run's files are read while the schedulers answer."""
    answered = ask_states(run_dirs, timeout, tolerant=True)
    read: dict[Path, dict[str, tp.Any] | Exception] = {}
    for run_dir in run_dirs:
        try:
            read[run_dir] = recorded_summary(run_dir)
        except (OSError, ConfigError) as exc:
            read[run_dir] = exc
    states = answered()
    out = []
    for run_dir in run_dirs:
        try:
            recorded = read[run_dir]
            if isinstance(recorded, Exception):
                raise recorded
            out.append(with_state(run_dir, recorded, states[run_dir]))
        except (OSError, ConfigError) as exc:
            out.append(unreadable_summary(run_dir, unreadable(exc)))
    return out


def unreadable_summary(run_dir: Path, state: schedulers.JobState) -> dict[str, tp.Any]:
    """The row of a run whose files cannot be read: every key ``summary`` has, nothing known."""
    return {"run_dir": str(run_dir), "job_id": None, "scheduler": None, "state": state.state,
            "state_words": state.words, "nodes": "", "states": [], "step": None, "loss": None, "restarts": 0,
            "strategy": None, "world_size": None, "ledger": ledger_summary([]), "last_stop": None}


def _asker(kind: str) -> tp.Callable[[dict[str, Path], float], dict[str, schedulers.JobState]]:
    """What asks scheduler ``kind`` for the states of its jobs (within a timeout)."""
    if kind not in schedulers.KINDS:  # a job.json of another hpcx, or hand-edited
        return lambda jobs, timeout: schedulers.base.unknown(jobs, f"scheduler {kind!r} is not one hpcx knows")
    return schedulers.get(kind).states


SUBMIT_GRACE_S = 300.0  # a run folder without job.json younger than this is still being submitted


def job_info(rd: runs.RunDir) -> dict[str, tp.Any]:
    """``job.json`` with a job id and a scheduler; while it is not written yet (or torn), the job id
    submitit's files already carry (``submitit/<id>_submitted.pkl``); {} when neither says."""
    try:
        info = rd.read_job()
    except ConfigError:
        if not runs.torn_json(rd.job):  # hostile, not half-written: say so
            raise
        info = {}
    if info.get("job_id") and info.get("scheduler"):
        return info
    try:
        ids = sorted({p.name.split("_", 1)[0] for p in rd.submitit.glob("*_submitted.pkl")
                      if p.name.split("_", 1)[0].isdigit()})
        kind = rd.read_resolved().get("site", {}).get("scheduler", {}).get("kind") if ids else None
    except (ConfigError, OSError):
        return {}
    return {"job_id": ids[-1], "scheduler": kind, "from": "submitit"} if ids and kind else {}


def not_submitted(rd: runs.RunDir) -> schedulers.JobState:
    """SUBMITTING while a young run folder waits for its job.json (``hpcx submit`` writes it once the
    scheduler took the job), else NOT SUBMITTED."""
    try:
        age = time.time() - rd.resolved.stat().st_mtime
    except OSError:
        age = SUBMIT_GRACE_S
    if age < SUBMIT_GRACE_S:
        return schedulers.JobState("SUBMITTING", detail={"reason": "no job.json yet"})
    return schedulers.JobState("NOT SUBMITTED")


# How a stop line that was not requeued ends the job, as the scheduler would say it.
STOP_STATES = {"completed": "COMPLETED", "terminated": "CANCELLED", "failed": "FAILED", "time_limit": "TIMEOUT",
               "preempted": "FAILED"}


def settled(rd: runs.RunDir, last: dict) -> bool:
    """An ended state (FAILED, TIMEOUT …) a poll recorded that nothing comes back from: the ledger's
    last line is a stop that was not requeued. Such runs are not asked about again either."""
    state = str(last.get("state", "")).split(" ")[0]
    try:
        return state in schedulers.TERMINAL and recorded_end(rd) is not None
    except OSError:
        return False


def recorded_if_unreachable(run_dir: Path, state: schedulers.JobState) -> schedulers.JobState:
    """``state``, or, when the scheduler did not answer, how the run's own records say it ended."""
    if state.state != "UNKNOWN" or state.detail.get("reason") != schedulers.base.UNREACHABLE:
        return state
    ended = recorded_end(runs.RunDir(run_dir))
    if ended is None:
        return state
    return schedulers.JobState(ended, state.nodes, "run folder", {**state.detail, "recorded": True})


def recorded_end(rd: runs.RunDir) -> str | None:
    """How the run ended by its ledger (a last stop line that was not requeued) or, without a ledger,
    by the last ended state a poll recorded; None when the records say it may still run."""
    ledger = rd.read_ledger()
    last = ledger[-1] if ledger else {}
    if last.get("event") == "stop":
        return None if last.get("requeued") else STOP_STATES.get(str(last.get("reason")))
    if ledger:
        return None  # started and not stopped: running, or killed without a word
    seen = [s.get("state", "") for s in rd.read_states()]
    ended = [s for s in seen if s.split()[0] in schedulers.TERMINAL] if seen else []
    return ended[-1].split()[0] if ended and ended[-1] == seen[-1] else None


# The job writes these itself (rank 0 at each start, whoever requeues: hpc.core.requeue.record_state), in
# order; a poll can lag behind them (sacct still says RUNNING of the incarnation just requeued), so
# polls never add them and the history shows each start and requeue exactly once.
JOB_RECORDED = ("RUNNING", "REQUEUED")


def _record(run_dir: Path, state: schedulers.JobState) -> None:
    rd = runs.RunDir(run_dir)
    seen = rd.read_states()
    if state.state in ("UNKNOWN", *JOB_RECORDED):
        return
    if not seen or seen[-1].get("state") != state.state:
        why = {"reason": state.detail["reason"]} if state.done and state.detail.get("reason") else {}
        runs.append_jsonl(rd.states, {"state": state.state, "nodes": state.nodes, "time": time.time(), **why})


def summary(run_dir: Path, state: schedulers.JobState | None = None) -> dict[str, tp.Any]:
    """Everything `hpcx status RUN` shows, as plain data (``state``: already asked, else asked now)."""
    recorded = recorded_summary(run_dir)
    return with_state(run_dir, recorded, state or job_state(run_dir))


def with_state(run_dir: Path, recorded: dict[str, tp.Any], state: schedulers.JobState) -> dict[str, tp.Any]:
    """A ``recorded_summary`` with the scheduler's state and the states recorded so far (read now: asking
    may just have added one)."""
    first = ("run_dir", "job_id", "scheduler")  # the keys in the order summary has always had
    return {**{k: recorded[k] for k in first}, "state": state.state, "state_words": state.words,
            "nodes": state.nodes, "states": [s.get("state", "?") for s in runs.RunDir(run_dir).read_states()],
            **{k: v for k, v in recorded.items() if k not in first}}


def recorded_summary(run_dir: Path) -> dict[str, tp.Any]:
    """What ``summary`` shows that the run's own files say (all but the state and the states)."""
    rd = runs.RunDir(run_dir)
    info = job_info(rd)
    ledger = rd.read_ledger()
    launch = rd.read_resolved().get("launch", {})
    starts = [e for e in ledger if e.get("event") == "start"]
    stops = [e for e in ledger if e.get("event") == "stop"]
    last = rd.last_train_metrics() or {}
    evaluated = rd.last_eval() or {}

    return {
        "run_dir": str(run_dir),
        "job_id": info.get("job_id"),
        "scheduler": info.get("scheduler"),
        "step": last.get("step"),
        "loss": last.get("loss"),
        **throughput(last),
        "eval_loss": evaluated.get("eval_loss"),
        "eval_perplexity": evaluated.get("eval_perplexity"),
        **({"eval_metrics": metrics} if (metrics := eval_metrics(evaluated)) else {}),  # a task's (accuracy)
        "restarts": max(len(starts) - 1, sum(1 for e in stops if e.get("requeued")), 0),  # a start may die unlogged
        "strategy": launch.get("strategy"),
        "world_size": launch.get("world_size"),
        "ledger": ledger_summary(ledger),
        "last_stop": stop_summary(stops[-1]) if stops else None,
        "excluded_nodes": health.active(ledger, time.time()),  # node → until when (hpc.core.health)
        **({"stragglers": slow} if (slow := straggler.read(run_dir).get("stragglers")) else {}),  # named now
    }


def throughput(last: dict) -> dict[str, tp.Any]:
    """The last metrics line's tokens/s, and a language model's real (non-padding) tokens/s and padding
    fraction (``trainer.loop.step_record``: packed and unpacked runs alike); {} before the first line."""
    keys = ("tokens_per_s", "real_tokens_per_s", "padding_fraction")
    return {k: last[k] for k in keys if k in last}


STOP_WORDS = {"completed": "completed", "preempted": "preempted", "time_limit": "time limit",
              "terminated": "cancelled", "failed": "failed"}


def stop_summary(stop: dict) -> dict[str, tp.Any]:
    """The ledger's last stop line as status shows it: why, where, requeued or why not, what failed."""
    keys = ("reason", "step", "requeued", "not_requeued", "error", "failed_ranks", "signal", "by", "failed_nodes",
            "node_fault", "excluded_nodes", "hang", "stragglers", "preflight")
    found = {k: stop[k] for k in keys if k in stop}
    reason = str(stop.get("reason", "?"))
    words = f"{STOP_WORDS.get(reason, reason)} at step {stop.get('step', '?')}"
    if reason == "failed" and stop.get("error"):
        words += f": {str(stop['error']).splitlines()[0][:200]}"
    if reason not in ("completed", "terminated"):
        words += " (requeued)" if stop.get("requeued") else f" (not requeued: {stop.get('not_requeued', '?')})"
    return {**found, "words": words}


def goodput(run_dir: Path) -> dict[str, tp.Any]:
    """Where the run's time went, by cause (``hpc.core.goodput``)."""
    from hpc.core.goodput import by_cause  # lazy: startup

    rd = runs.RunDir(run_dir)
    return by_cause(rd.read_ledger(), rd.read_metrics())


def ledger_summary(ledger: list[dict]) -> dict[str, tp.Any]:
    """Goodput figures from the ledger's start/stop lines."""
    stops = [e for e in ledger if e.get("event") == "stop"]
    return {
        "starts": sum(1 for e in ledger if e.get("event") == "start"),
        "steps_recomputed": sum(e.get("steps_recomputed", 0) for e in ledger if e.get("event") == "start"),
        "save_s": round(sum(e.get("save_s", 0.0) for e in stops), 3),
        "restore_s": round(sum(e.get("restore_s", 0.0) for e in ledger if e.get("event") == "start"), 3),
        "queue_wait_s": round(sum(e.get("queue_wait_s") or 0.0 for e in ledger if e.get("event") == "start"), 3),
    }


def result(run_dir: Path) -> tuple[str, object] | None:
    """Rank 0's return value (or its error) once the job has ended."""
    rd = runs.RunDir(run_dir)
    path = result_path(rd.submitit, str(rd.read_job().get("job_id")))
    return read_result(path) if path.exists() else None


def wait(run_dir: Path, on_poll: tp.Callable[[dict], None], poll_s: float = 2.0,
         timeout_s: float | None = None) -> dict[str, tp.Any]:
    """Poll until the job reaches a terminal state; ``on_poll`` gets each summary."""
    start = time.time()
    while True:
        info = summary(run_dir)
        on_poll(info)
        if info["state"] in schedulers.TERMINAL:
            return info
        if timeout_s is not None and time.time() - start > timeout_s:
            return info
        time.sleep(poll_s)


def cancel(run_dir: Path) -> str:
    """Cancel the run's job: its ranks get SIGTERM and stop at the next step boundary, writing the
    ledger's stop line and no new checkpoint. What was done, for people; UserError when there is
    nothing to cancel (never submitted, already ended) or the scheduler refused."""
    rd = runs.RunDir(run_dir)
    info = job_info(rd)
    if not info:
        raise UserError([f"{run_dir}: no job.json: this run was never submitted"])
    state = job_state(run_dir)
    job = f"job {info['job_id']}"
    if state.done:
        step = (rd.last_metrics() or {}).get("step")
        at = f" at step {step}" if step is not None else ""
        raise UserError([f"{rd.name}: {job} already ended ({state.state}{at}): nothing to cancel"])
    if not schedulers.get(info["scheduler"]).cancel(str(info["job_id"]), run_dir):
        after = job_state(run_dir).state
        raise UserError([f"{rd.name}: {job} could not be cancelled (the scheduler refused; it is {after} now)"])
    return (f"cancelled {rd.name} ({job}, was {state.state}): its ranks stop at their next step boundary "
            "without saving")

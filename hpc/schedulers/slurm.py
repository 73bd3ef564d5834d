"""Slurm: sbatch parameters and script, sacct/squeue/scontrol, scancel, and the job side's requeue.

``render`` returns byte for byte the script submitit writes for the same parameters (it calls
submitit's own ``_make_sbatch_string``), so ``hpcx render`` shows exactly what
``hpcx submit`` sends. Commands run as argument lists (never through a shell) with a timeout.
"""

from __future__ import annotations

import datetime
import logging
import os
import shlex
import time
import typing as tp
from pathlib import Path

from hpc.errors import UserError
from hpc.schedulers.base import JobSide, JobState, Scheduler, run_command, submitit_command, try_command
from hpc.validate import directive_value

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.resolve import Launch
    from hpc.site import SiteProfile
    from hpc.spec import JobSpec

log = logging.getLogger("hpcx.trainer")
REQUEUE_ATTEMPTS = 3
REQUEUED_STATES = ("REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "PENDING", "CONFIGURING")


# ---------------------------------------------------------------- parameters and script (pure)


def setup_lines(spec: JobSpec, site: SiteProfile) -> list[str]:
    """Shell lines run by the batch script before srun; every value is shell-quoted.

    The site's NCCL values are defaults (a value the user exported, e.g. NCCL_DEBUG, wins);
    the spec's ``env.set`` values are explicit for this job and always set.
    """
    lines = [f"[ -n \"${{{name}+x}}\" ] || export {name}={shlex.quote(value)}"
             for name, value in sorted(site.nccl.items()) if name not in spec.env.set]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in sorted(spec.env.set.items())]
    if spec.env.passthrough:
        names = " ".join(spec.env.passthrough)
        lines.insert(0, f"# passed by name from the submitting shell (values never written): {names}")
    return lines


def gpu_parameters(site: SiteProfile, launch: Launch) -> dict[str, tp.Any]:
    if not launch.gpus_per_node:
        return {}
    if site.scheduler.gpu_directive == "gres":
        return {"gres": f"gpu:{launch.gpus_per_node}"}
    return {"gpus_per_node": launch.gpus_per_node}


def sbatch_extras(table: dict[str, tp.Any]) -> dict[str, tp.Any]:
    """A site's [scheduler.sbatch] as submitit's additional_parameters: `true` is a bare flag, `false`
    leaves the option out, strings are prepared for sbatch's directive parser."""
    return {key: directive_value(value) if isinstance(value, str) else value
            for key, value in table.items() if value is not False}


def slurm_parameters(spec: JobSpec, site: SiteProfile, launch: Launch) -> dict[str, tp.Any]:
    """Keyword arguments of submitit's SlurmExecutor for this launch; every string that lands on an
    ``#SBATCH`` line goes through ``directive_value`` so that sbatch reads back exactly the value."""
    params: dict[str, tp.Any] = {
        "job_name": directive_value(spec.job.name),
        "nodes": launch.nodes,
        "ntasks_per_node": launch.tasks_per_node,
        "cpus_per_task": launch.cpus_per_task,
        "time": spec.job.time_limit_min,
        "signal_delay_s": launch.signal_lead_s,
        "stderr_to_stdout": False,
        "additional_parameters": {"requeue": True, **sbatch_extras(site.scheduler.sbatch)},
    }
    for key in ("partition", "account", "qos"):
        if getattr(launch, key):
            params[key] = directive_value(getattr(launch, key))
    params.update(gpu_parameters(site, launch))
    setup = setup_lines(spec, site)
    if setup:
        params["setup"] = setup
    return params


def render_sbatch(params: dict[str, tp.Any], python: str, folder: str) -> str:
    """The sbatch script submitit will write for these parameters."""
    from submitit.slurm.slurm import _make_sbatch_string

    return _make_sbatch_string(command=submitit_command(python, folder), folder=folder, **params)


# ---------------------------------------------------------------- scontrol output


def parse_scontrol(text: str) -> dict[str, str]:
    """One record of ``scontrol -o show job|node`` as a dict (values without spaces are enough here)."""
    return dict(tok.split("=", 1) for tok in text.split() if "=" in tok)


def scontrol_seconds(stamp: str) -> float | None:
    """``2026-11-29T18:37:30`` (the controller's local time) as epoch seconds; None for Unknown/None."""
    try:
        return datetime.datetime.fromisoformat(stamp).timestamp()
    except (TypeError, ValueError):
        return None


def show_job(job_id: str) -> dict[str, str]:
    """``scontrol -o show job JOB`` as a dict; empty when it fails."""
    out = run_command(["scontrol", "-o", "show", "job", job_id])
    return parse_scontrol(out) if out else {}


# ---------------------------------------------------------------- state queries


def _sacct(ids: list[str]) -> dict[str, JobState]:
    out = run_command(["sacct", "-j", ",".join(ids), "-X", "-n", "-P", "--format=JobID,State,NodeList,ExitCode"])
    found: dict[str, JobState] = {}
    for line in (out or "").strip().splitlines():  # with requeues an id repeats; its last line is current
        fields = line.split("|")
        job = fields[0].split("_")[0].split(".")[0]
        state = fields[1].split()[0] if len(fields) > 1 and fields[1] else "UNKNOWN"
        found[job] = JobState(state, fields[2] if len(fields) > 2 else "", "sacct",
                              {"exit_code": fields[3] if len(fields) > 3 else ""})
    return found


def _squeue(ids: list[str]) -> dict[str, JobState]:
    out = run_command(["squeue", "-h", "-j", ",".join(ids), "-o", "%i|%T|%N"])
    found = {}
    for line in (out or "").strip().splitlines():
        job, state, nodes = (line.split("|") + ["", ""])[:3]
        found[job] = JobState(state, nodes, "squeue")
    return found


def _scontrol(ids: list[str]) -> dict[str, JobState]:
    found = {}
    for job in ids:
        fields = show_job(job)
        if fields:
            found[job] = JobState(fields.get("JobState", "UNKNOWN"), fields.get("NodeList", ""), "scontrol",
                                  {"restarts": fields.get("Restarts", "0")})
    return found


class SlurmScheduler(Scheduler):
    """sbatch through submitit; sacct where accounting works, else squeue (queued/running), else
    scontrol (recently ended)."""

    kind = "slurm"
    multi_node = True

    def executor(self, spec: JobSpec, site: SiteProfile, launch: Launch, folder: Path) -> tp.Any:
        import submitit

        executor = submitit.AutoExecutor(folder=folder, cluster="slurm", slurm_max_num_timeout=spec.job.max_requeues)
        params = slurm_parameters(spec, site, launch)
        executor.update_parameters(**{f"slurm_{k}": v for k, v in params.items()})
        return executor

    def render(self, spec: JobSpec, site: SiteProfile, launch: Launch, run_dir: str, python: str) -> str:
        from hpc.schedulers.base import SUBMITIT_DIR

        return render_sbatch(slurm_parameters(spec, site, launch), python, f"{run_dir}/{SUBMITIT_DIR}")

    def states(self, jobs: tp.Mapping[str, Path]) -> dict[str, JobState]:
        found: dict[str, JobState] = {}
        for query in (_sacct, _squeue, _scontrol):
            missing = [j for j in jobs if j not in found]
            if not missing:
                break
            found.update(query(missing))
        return {j: found.get(j, JobState("UNKNOWN", source="none")) for j in jobs}

    def cancel(self, job_id: str, run_dir: Path) -> bool:
        return run_command(["scancel", job_id]) is not None

    def signal(self, job_id: str, signal_name: str, run_dir: Path) -> list[str]:
        """``scancel --signal=SIG JOB``: without ``--batch``/``--full`` it signals every job step but not
        the batch step, which is right: the srun tasks (the trainer ranks) must get it, and the batch
        shell must not (bash dies of USR2, which would end the job)."""
        cmd = ["scancel", f"--signal={signal_name}", job_id]
        ok, why = try_command(cmd)
        if not ok:
            raise UserError([f"{' '.join(cmd)} failed: {why}"])
        return [f"the steps of job {job_id} (scancel --signal={signal_name})"]

    def restarts(self, job_id: str) -> int:
        return int(show_job(job_id).get("Restarts", "0") or 0)


class SlurmJobSide(JobSide):
    """Inside a Slurm job: ``SLURM_JOB_ID``, ``SLURM_RESTART_COUNT``, ``scontrol requeue``."""

    kind = "slurm"

    def job_id(self) -> str | None:
        return os.environ.get("SLURM_JOB_ID")

    def restart_count(self) -> int:
        return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)

    def requeue(self) -> str | None:
        """``scontrol requeue JOB`` if this incarnation of the job is still the running one.

        A job that is not RUNNING is being cancelled, timed out or already requeued (by Slurm on a node
        failure, say); a restart count different from ours means another incarnation: never requeue then.
        """
        job = self.job_id() or ""
        fields = show_job(job)
        state = fields.get("JobState", "UNKNOWN")
        if state != "RUNNING":
            return f"job {job} is {state}, not RUNNING (cancelled, ending or already requeued)"
        ours = str(self.restart_count())
        if fields.get("Restarts", "0") != ours:
            return f"job {job} was already restarted (Restarts={fields.get('Restarts')}, this run is {ours})"
        why = ""
        for attempt in range(REQUEUE_ATTEMPTS):
            ok, why = try_command(["scontrol", "requeue", job], timeout=60)
            now = show_job(job)
            # a busy controller may answer with an error although the requeue went through
            if ok or now.get("JobState") in REQUEUED_STATES or now.get("Restarts", ours) != ours:
                log.warning("requeued job %s (scontrol requeue)", job)
                return None
            if now.get("JobState") != "RUNNING":
                break
            time.sleep(2.0 * (attempt + 1))
        return f"scontrol requeue {job} failed: {why}"

    def queue_wait(self, run_dir: Path, ledger: list[dict]) -> tuple[float | None, str]:
        """``StartTime - SubmitTime`` of ``scontrol show job`` (Slurm resets SubmitTime on a requeue)."""
        fields = show_job(self.job_id() or "")
        start, submit = scontrol_seconds(fields.get("StartTime", "")), scontrol_seconds(fields.get("SubmitTime", ""))
        if start is not None and submit is not None:
            return max(0.0, start - submit), "scontrol"
        from hpc.schedulers.local import wait_since_last_stop

        return wait_since_last_stop(run_dir, ledger)

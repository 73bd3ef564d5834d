"""``hpcx data prepare --site S``: the plan's unfinished groups as one Slurm job array, then a merge
job; the same plan, groups and code as a local run, so the same bytes (``hpc.data.prepare``)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from hpc.data.prepare import MANIFEST, merge, pending_groups
from hpc.errors import UserError

ARRAY_MINUTES = 240  # per array task; a group of 256 MiB takes minutes on one core
WAIT_POLL_S = 2.0


def submit_array(folder: Path, plan: dict, site_name: str) -> tuple[str, str] | None:
    """Submit the array and the merge (None when every group is finished and the manifest written)."""
    from hpc.schedulers.slurm_array import submit_prepare
    from hpc.site import choose_site, load_site
    from hpc.validate import slurm_path_problem

    site = load_site(choose_site(site_name, None))
    if site.scheduler.kind != "slurm":
        raise UserError([f"--site {site_name}: a {site.scheduler.kind} site: expected a Slurm site for a job "
                         "array (without --site, prepare runs here)"])
    problem = slurm_path_problem(str(folder))
    if problem:
        raise UserError([f"--out {folder}: {problem}"])
    groups = pending_groups(folder, plan)
    if not groups:  # a run that had finished every group: only the merge was left
        merge(folder)
        return None
    return submit_prepare(folder, site.scheduler, sys.executable, groups, min(4, site.node.cpus), ARRAY_MINUTES)


def wait_for_manifest(folder: Path, merge_id: str, timeout_s: float) -> None:
    """Until the merge job has left the queue; then its manifest must be there."""
    from hpc.schedulers.slurm_array import in_queue

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and in_queue(merge_id) is not False:
        time.sleep(WAIT_POLL_S)
    if not (folder / MANIFEST).is_file():
        raise UserError([f"{folder}: merge job {merge_id} ended without {MANIFEST}: see {folder}/.prepare/logs/ "
                         "(run the same command again to finish the groups left)"])

"""``hpcx data prepare --site S``: the plan's unfinished groups as jobs of the site's scheduler (a Slurm
job array), then a merge job; the same plan, groups and code as a local run, so the same bytes
(``hpc.data.prepare``)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from hpc import schedulers
from hpc.data.prepare import MANIFEST, merge, pending_groups
from hpc.core.errors import UserError
from hpc.core.site import choose_site, load_site

WAIT_POLL_S = 2.0


def submit_array(folder: Path, plan: dict, site_name: str | None) -> tuple[str, str] | None:
    """Submit the groups and the merge (None when every group was finished: then only the merge runs, here)."""
    site = load_site(choose_site(site_name, None))
    problem = schedulers.path_problem(str(folder))
    if problem:
        raise UserError([f"--out {folder}: {problem}"])
    groups = pending_groups(folder, plan)
    if not groups:
        merge(folder)
        return None
    return schedulers.get(site.scheduler.kind).submit_prepare(folder, site, sys.executable, groups)


def wait_for_manifest(folder: Path, site_name: str | None, merge_id: str, timeout_s: float) -> None:
    """Until the merge job has ended; then its manifest must be there."""
    scheduler = schedulers.get(load_site(choose_site(site_name, None)).scheduler.kind)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not scheduler.states({merge_id: folder})[merge_id].done:
        time.sleep(WAIT_POLL_S)
    if not (folder / MANIFEST).is_file():
        raise UserError([f"{folder}: merge job {merge_id} ended without {MANIFEST}: see {folder}/.prepare/logs/ "
                         "(run the same command again to finish the groups left)"])

"""`srun hpcx-rank RUN` (`python -m trainer RUN`) without hpcx submit: each task finds its rank from Slurm's
step variables; submitted from a folder whose `trainer` and `hpc` raise on import (issue 29)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from hpc.core.resolve import resolved_document
from hpc.plan.resolve import resolve
from hpc.core.runs import new_run_dir
from hpc.core.site import load_site
from hpc.core.spec import load_spec
from tests.conftest import REPO
from tests.test_imports import shadowing_folder


def test_plain_srun_tasks_know_their_ranks(sandbox, tmp_path):
    spec = load_spec(REPO / "jobs" / "tiny-ddp.toml", ["job.nodes=2", "job.tasks_per_node=2", "train.steps=4",
                                                       "train.log_every=1", "job.name=plain-srun"])
    site = load_site("sandbox")
    run = new_run_dir(sandbox, "plain-srun", False)
    (run / "resolved.json").write_text(json.dumps(resolved_document(spec, site, resolve(spec, site), str(run))))
    script = run / "job.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=2 --time=10 --job-name=plain-srun\n"
                      f"#SBATCH --output={run}/slurm-%j.out\n"
                      f"srun {Path(sys.executable).parent / 'hpcx-rank'} {run}\n")
    shadowing_folder(tmp_path)  # the job's working folder
    job = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True,
                         cwd=tmp_path).stdout.strip()
    deadline = time.time() + 400
    while time.time() < deadline:
        state = subprocess.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", "State"], capture_output=True,
                               text=True).stdout.strip()
        if state and state.split()[0] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            break
        time.sleep(2)
    output = next(run.glob("slurm-*.out")).read_text()
    assert state.startswith("COMPLETED"), output[-3000:]
    world = json.loads((run / "world.json").read_text())
    assert world["world_size"] == 4 and world["all_reduce"] == 4 and sorted(world["hosts"]) == ["n1", "n1", "n2", "n2"]
    for rank in range(4):
        assert f"rank {rank}/4 on n{1 + rank // 2} via srun" in (run / "logs" / f"rank-{rank}.log").read_text()
    assert [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    start = json.loads((run / "ledger.jsonl").read_text().splitlines()[0])
    assert start["job_id"] == job  # Slurm's job: a preemption could requeue it
    assert output.count('"world_size": 4') == 1  # one summary line: rank 0's only

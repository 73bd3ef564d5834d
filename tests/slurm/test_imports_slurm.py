"""Issue 29 on the sandbox: a job submitted from a folder holding `trainer.py`, `trainer/` and `hpc/` (each
raising on import) and a user model package trains on two nodes, and its tasks build the user's model."""

from __future__ import annotations

import json
import subprocess

from tests.test_imports import HPCX, shadowing_folder


def test_a_job_from_a_folder_that_shadows_hpcx_trains_on_the_sandbox(sandbox, tmp_path):
    spec = shadowing_folder(tmp_path)
    out = subprocess.run([str(HPCX), "submit", spec.name, "--site", "sandbox", "--set", "job.nodes=2",
                          "--set", "job.tasks_per_node=1", "--set", "train.steps=3", "--set", "job.name=shadowed",
                          "--wait", "--json"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert json.loads(out.stdout)["state"] == "COMPLETED"
    assert len((tmp_path / "built.txt").read_text().split()) == 2  # one per task, on n1 and n2

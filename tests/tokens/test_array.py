"""``hpcx data prepare --site S``: the job array's scripts and job side (issue 21, item 2). The real
cluster run is tests/slurm/test_data_slurm.py."""

from __future__ import annotations

import shlex

from hpc.core.imports import BOOT
from hpc.data import task
from hpc.data.prepare import Options, make_plan, start
from hpc.schedulers.slurm.array import job_script, sbatch_options
from hpc.core.site import load_site
from tests.tokens.test_prepare import folder_bytes, run_prepare


def test_scripts_run_the_job_side_module_with_this_interpreter():
    assert job_script("/opt/py env/bin/python", ["group", "/data/out dir", '"$SLURM_ARRAY_TASK_ID"']) == (
        f"#!/bin/bash\nexec '/opt/py env/bin/python' -c {shlex.quote(BOOT)} hpc.data.task group '/data/out dir' "
        "\"$SLURM_ARRAY_TASK_ID\"\n")  # python -m hpc.data.task, never the submit folder's hpc (hpc.core.imports)
    options = sbatch_options(load_site("sandbox").scheduler, "hpcx-prepare", "/o/%a.out", 2, 240)
    assert options == ["--parsable", "--job-name=hpcx-prepare", "--ntasks=1", "--cpus-per-task=2", "--time=240",
                       "--output=/o/%a.out", "--no-requeue", "--partition=debug"]


def test_array_tasks_then_merge_give_the_local_bytes(tmp_path, corpus, tokenizer):
    """The job side, each group as its own task in any order, then the merge: the same files as a local run."""
    common = ["--group-bytes", "60000", "--val-fraction", "0.1"]
    assert run_prepare(str(corpus), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "local"), *common)[0] == 0
    plan = make_plan([str(corpus)], str(tokenizer), Options(val_fraction=0.1, group_bytes=60000))
    out = tmp_path / "array"
    start(out, plan)
    for index in reversed(range(len(plan["groups"]))):
        assert task.main(["group", str(out), str(index)]) == 0
    assert task.main(["group", str(out), "0"]) == 0  # a task run twice (requeued) does nothing more
    assert task.main(["merge", str(out)]) == 0
    local, array = folder_bytes(tmp_path / "local"), folder_bytes(out)
    assert local == array


def test_merge_before_the_groups_is_refused(tmp_path, corpus, tokenizer, capsys):
    plan = make_plan([str(corpus)], str(tokenizer), Options(group_bytes=60000))
    start(tmp_path / "o", plan)
    assert task.main(["merge", str(tmp_path / "o")]) == 2
    assert "are not finished: expected every group before the merge" in capsys.readouterr().err
    assert not (tmp_path / "o/manifest.json").exists()


def test_a_local_site_is_refused(tmp_path, corpus, tokenizer):
    code, out = run_prepare(str(corpus), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "o"), "--site", "local")
    assert code == 2 and "--site local: a local site: expected a Slurm site" in out

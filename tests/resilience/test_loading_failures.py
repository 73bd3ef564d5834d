"""A start whose code did not load (submitit unpickling the task, an import, ``python -m trainer.entry``
itself) fails the same way on every restart: never requeued, and the stop line names the module.

The texts judged here are not written by hand: each case runs submitit's own loader (``python -m
trainer.entry FOLDER``, the command every task runs) in a subprocess on a pickle made the way ``hpcx
submit`` makes one, then breaks what the job imports. What the task wrote to stderr and the result
pickle submitit left are what the check after srun and the local state read.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.core import failures, requeue, runs
from hpc.schedulers.base import read_result
from hpc.schedulers.local.scheduler import local_state
from hpc.schedulers.slurm.requeue import after_srun
from tests.resilience.test_failure_records import batch_log, srun_says, write_batch_log
from tests.resilience.test_requeue import JOB, start, write_ledger

TASK = "class Task:\n    def __init__(self, run_dir='.'):\n        self.run_dir = run_dir\n\n    def __call__(self):\n{body}"
LOCAL_TASK_ENV = {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_JOB_ID": "7", "SUBMITIT_LOCAL_GLOBALID": "0",
                  "SUBMITIT_LOCAL_LOCALID": "0", "SUBMITIT_LOCAL_NTASKS": "1", "SUBMITIT_LOCAL_NODEID": "0",
                  "SUBMITIT_LOCAL_JOB_NUM_NODES": "1"}

# case -> (what the module holds when the task loads, None: removed; how python is run)
CASES = {
    "missing_module": (None, "venv"),
    "missing_attribute": ("X = 1\n", "venv"),
    "syntax_error": ("class Task(:\n    pass\n", "venv"),
    "import_error": ("from os import no_such_name\n", "venv"),
    "missing_dependency": ("import hpcx_no_such_dependency\n", "venv"),
    "hpcx_not_importable": ("", "no-site"),  # python -S: neither hpcx nor submitit on the path
    "submitit_not_importable": ("", "empty-submitit"),  # a stray `submitit` package shadows the real one
    # ... and failures that are not the code failing to load
    "task_raises": (TASK.format(body="        raise ConnectionRefusedError(111, 'Connection refused')\n"), "venv"),
    "task_attribute_error": (TASK.format(body="        return self.missing\n"), "venv"),
    "torn_pickle": ("", "torn"),
}


def run_loader(folder: Path, case: str) -> dict:
    """Pickle ``hpcx_user_task.Task()`` as ``hpcx submit`` pickles its task, break what the case breaks,
    run the task command's python on it; what it wrote to stderr and the result pickle it left."""
    module, how = CASES[case]
    mods, sub = folder / "mods", folder / "submitit"
    mods.mkdir(parents=True)
    sub.mkdir()
    (mods / "hpcx_user_task.py").write_text(TASK.format(body="        return 1\n"))
    dump = ("import sys; sys.path.insert(0, sys.argv[1]); import hpcx_user_task; "
            "from submitit.core.utils import DelayedSubmission; DelayedSubmission(hpcx_user_task.Task()).dump(sys.argv[2])")
    subprocess.run([sys.executable, "-c", dump, str(mods), str(sub / "7_submitted.pkl")], check=True, cwd=folder)
    if module is None:
        (mods / "hpcx_user_task.py").unlink()
    elif module:
        (mods / "hpcx_user_task.py").write_text(module)
    env = {**os.environ, **LOCAL_TASK_ENV, "PYTHONPATH": str(mods)}
    python = [sys.executable, "-u"]
    if how == "no-site":
        python.append("-S")
    elif how == "empty-submitit":
        (mods / "submitit").mkdir()
        (mods / "submitit" / "__init__.py").write_text("")
    elif how == "torn":
        data = (sub / "7_submitted.pkl").read_bytes()
        (sub / "7_submitted.pkl").write_bytes(data[: len(data) // 2])
    out = subprocess.run([*python, "-m", "trainer.entry", str(sub)], env=env, capture_output=True, text=True,
                         timeout=120, cwd=folder)  # not the repository: -m puts the working folder on the path
    assert out.returncode != 0, out.stderr
    return {"stderr": out.stderr, "result": sub / "7_0_result.pkl"}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("loading")
    return {case: run_loader(root / case, case) for case in CASES}


LOADING = {  # case -> (the error line starts with, the module it names, where)
    "missing_module": ("ModuleNotFoundError: No module named 'hpcx_user_task'", "hpcx_user_task", "unpickling"),
    "missing_attribute": ("AttributeError: Can't get attribute 'Task' on <module 'hpcx_user_task'", "hpcx_user_task",
                          "unpickling"),
    "syntax_error": ("SyntaxError: invalid syntax (", "hpcx_user_task.py", "unpickling"),
    "import_error": ("ImportError: cannot import name 'no_such_name' from 'os'", "os", "unpickling"),
    "missing_dependency": ("ModuleNotFoundError: No module named 'hpcx_no_such_dependency'",
                           "hpcx_no_such_dependency", "unpickling"),
    "hpcx_not_importable": ("ModuleNotFoundError: No module named 'trainer'", "trainer",
                            "starting python -m trainer.entry"),
    "submitit_not_importable": ("ModuleNotFoundError: No module named 'submitit.core'", "submitit.core",
                                "importing the job's code"),
}


@pytest.mark.parametrize("case", sorted(LOADING))
def test_code_that_does_not_load_is_told_from_what_the_task_wrote(recorded, case):
    error, module, where = LOADING[case]
    found = failures.loading_failure(recorded[case]["stderr"])
    assert found is not None, recorded[case]["stderr"][-2000:]
    assert found["error"].startswith(error) and found["module"].endswith(module) and where in found["where"]
    assert "\n" not in found["error"] and len(found["error"]) <= 300


@pytest.mark.parametrize("case", ["task_raises", "task_attribute_error", "torn_pickle"])
def test_other_failures_before_the_trainer_are_not_loading_failures(recorded, case):
    assert "Traceback" in recorded[case]["stderr"]
    assert failures.loading_failure(recorded[case]["stderr"]) is None


def test_a_syntax_error_names_the_file_and_line(recorded):
    found = failures.loading_failure(recorded["syntax_error"]["stderr"])
    assert found["module"].endswith("mods/hpcx_user_task.py") and found["error"].endswith("hpcx_user_task.py, line 1)")


def test_torchs_rank_prefix_is_read_through(recorded):
    text = "".join(f"[rank0]: {line}\n" for line in recorded["missing_module"]["stderr"].splitlines())
    assert failures.loading_failure(text)["module"] == "hpcx_user_task"


def test_the_last_failure_counts(recorded):
    """A loading failure followed by a task that got further (or the reverse) is judged by the last one."""
    loaded_then_failed = recorded["missing_module"]["stderr"] + recorded["task_raises"]["stderr"]
    assert failures.loading_failure(loaded_then_failed) is None
    assert failures.loading_failure(recorded["task_raises"]["stderr"] + recorded["hpcx_not_importable"]["stderr"])
    assert failures.loading_failure(recorded["hpcx_not_importable"]["stderr"] + recorded["task_raises"]["stderr"]) is None


# ---------------------------------------------------------------- the check after srun


def failed_start(recorded: dict, case: str) -> str:
    """This start's part of the batch log: task 0's stderr, then srun's lines for the tasks' exit."""
    return recorded[case]["stderr"] + (f"srun: error: n1: tasks 0-1: Exited with exit code 1\n"
                                       f"srun: launch/slurm: _step_signal: Terminating StepId={JOB}.0\n"
                                       "srun: error: n2: tasks 2-3: Exited with exit code 1\n")


@pytest.mark.parametrize("case", sorted(LOADING))
def test_the_check_does_not_requeue_a_start_whose_code_did_not_load(recorded, run_dir, slurm_side, case):
    write_ledger(run_dir, [start(0, 0), {"event": "stop", "reason": "preempted", "step": 6, "requeued": True,
                                         "job_id": JOB}])  # start 1 never wrote its start line
    write_batch_log(run_dir, batch_log((0, "[rank0]: fine\n"), (1, failed_start(recorded, case))))
    line = after_srun(run_dir, 1, slurm_side)
    error, module, where = LOADING[case]
    assert not line["requeued"] and line["started"] is False and line["step"] == 6
    assert line["error"].startswith(error) and line["module"].endswith(module)
    assert line["not_requeued"].startswith(error.split(":", 1)[0] + " while ")
    assert line["not_requeued"].endswith("before the trainer started: it would fail the same way on a restart")
    assert not list((run_dir / "requeue").glob("*.requeued"))  # refused before claiming
    assert runs.RunDir(run_dir).read_ledger()[-1] == line


@pytest.mark.parametrize("case", ["task_raises", "task_attribute_error", "torn_pickle"])
def test_the_check_still_requeues_other_failures_before_the_trainer(recorded, run_dir, slurm_side, case):
    write_ledger(run_dir, [])
    write_batch_log(run_dir, batch_log((1, failed_start(recorded, case))))
    line = after_srun(run_dir, 1, slurm_side)
    assert (run_dir / "requeue" / f"{JOB}.1.requeued").exists()  # the policy allowed it: the claim was taken
    assert "module" not in line and "before the trainer started" not in line.get("not_requeued", "")


def test_only_this_starts_part_of_the_batch_log_is_read(recorded, run_dir, slurm_side):
    """Start 0 failed to load (not requeued then; say someone requeued it by hand): start 1 was killed."""
    write_ledger(run_dir, [])
    write_batch_log(run_dir, batch_log((0, failed_start(recorded, "missing_module")),
                                       (1, srun_says("n1: task 0: Killed"))))
    line = after_srun(run_dir, 137, slurm_side)
    assert (run_dir / "requeue" / f"{JOB}.1.requeued").exists() and "module" not in line
    assert "killed by SIGKILL" in line["error"]


def test_a_start_whose_trainer_ran_is_judged_by_its_reports_not_the_log(recorded, run_dir, slurm_side):
    write_ledger(run_dir, [start(0)])  # this start's line: the trainer ran
    write_batch_log(run_dir, batch_log((1, failed_start(recorded, "missing_module"))))
    line = after_srun(run_dir, 1, slurm_side)
    assert "module" not in line and (run_dir / "requeue" / f"{JOB}.1.requeued").exists()
    requeue_dir = run_dir / "requeue"
    shutil.rmtree(requeue_dir)
    write_ledger(run_dir, [])  # no start line, but a rank reported: the report decides
    requeue.report_failure(run_dir, f"{JOB}.1", 2, step=0, error="DistNetworkError: timed out", phase="join",
                           repeats=False)
    line = after_srun(run_dir, 1, slurm_side)
    assert "module" not in line and line["error"] == "DistNetworkError: timed out"


# ---------------------------------------------------------------- the local kind and the result pickle


def test_the_result_pickle_submitit_left_is_read_as_plain_values(recorded):
    kind, text = read_result(recorded["missing_module"]["result"])
    assert kind == "error" and "No module named 'hpcx_user_task'" in text


def test_a_result_that_names_a_class_is_refused(tmp_path):
    path = tmp_path / "7_0_result.pkl"
    path.write_bytes(pickle.dumps(("success", Path("/etc"))))
    kind, why = read_result(path)
    assert kind == "error" and "hpcx reads plain values only" in why and "pathlib" in why
    path.write_bytes(pickle.dumps(("success", {"steps": 3, "losses": [1.5, 1.25], "preempted": False})))
    assert read_result(path) == ("success", {"steps": 3, "losses": [1.5, 1.25], "preempted": False})


@pytest.mark.parametrize("case", ["missing_module", "missing_attribute", "syntax_error"])
def test_a_local_job_whose_code_did_not_load_is_failed_saying_why(recorded, tmp_path, case):
    run = tmp_path / "run"
    (run / "submitit").mkdir(parents=True)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # an ended controller
    shutil.copy(recorded[case]["result"], run / "submitit" / f"{child.pid}_0_result.pkl")
    state = local_state(str(child.pid), run)
    assert state.state == "FAILED" and state.words.startswith(f"FAILED ({LOADING[case][0]}")
    assert state.words.endswith("while unpickling the job's task: not retried)")



# ---------------------------------------------------------------- real jobs whose task cannot be unpickled

GONE_TASK = "from trainer.task import TrainTask as Real\n\n\nclass TrainTask(Real):\n    pass\n"
SUBMIT_WITH_GONE_TASK = ("import sys; sys.path.insert(0, sys.argv[1]); import hpcx_gone_task, trainer.task; "
                         "trainer.task.TrainTask = hpcx_gone_task.TrainTask; sys.argv = ['hpcx', *sys.argv[2:]]; "
                         "from hpc.cli import main; main()")


def submit_unloadable(folder: Path, job: str, *sets: str, site: str | None = None) -> Path:
    """``hpcx submit`` whose task is of a class from a module only the submitting process can import
    (as a user module on the login node only): every task fails while submitit unpickles it."""
    import tempfile

    from tests.conftest import REPO

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hpcx_gone_task.py").write_text(GONE_TASK)
    args = [a for s in sets for a in ("--set", s)] + (["--site", site] if site else [])
    with tempfile.TemporaryFile("w+") as out:  # not a pipe: a local controller would hold it open
        code = subprocess.run([sys.executable, "-c", SUBMIT_WITH_GONE_TASK, str(folder), "submit", job, *args,
                               "--json"], stdout=out, stderr=subprocess.STDOUT, timeout=300, cwd=REPO).returncode
        out.seek(0)
        text = out.read()
    assert code == 0, text
    return Path(json.loads(text[text.index("{"):])["run_dir"])


def test_a_local_job_whose_task_cannot_be_unpickled_fails_once_saying_why(tmp_path, run_root):
    from tests.conftest import REPO, hpcx
    from tests.resilience.resilience_lib import wait_state

    run = submit_unloadable(tmp_path / "login-only", str(REPO / "jobs" / "tiny-ddp.toml"),
                            f"job.run_root={json.dumps(str(run_root))}", "job.max_requeues=3")
    info = wait_state(run, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout=120)
    assert info["state"] == "FAILED" and info["restarts"] == 0
    assert "ModuleNotFoundError: No module named 'hpcx_gone_task', while unpickling the job's task: not retried" \
        in info["state_words"]
    job = json.loads((run / "job.json").read_text())["job_id"]
    for task in (0, 1):  # each task started once: the controller retries only the trainer's requeue status
        log = (run / "submitit" / f"{job}_{task}_log.err").read_text()
        assert log.count("Traceback (most recent call last):") == 1 and "hpcx_gone_task" in log
    assert runs.RunDir(run).read_ledger() == [] and "REQUEUED" not in info["states"]
    again = hpcx("status", str(run))  # the recorded state keeps its reason
    assert "FAILED (ModuleNotFoundError: No module named 'hpcx_gone_task'" in again.stdout, again.stdout

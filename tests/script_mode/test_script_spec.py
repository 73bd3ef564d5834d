"""Script mode's spec, environment and helper, without running a job: ``job.command`` strictness (one
line each, exit 2), the rank environment a command gets, and ``hpc.job`` inside and outside hpcx."""

from __future__ import annotations

import json
import os
import signal

import pytest

from hpc import job
from hpc.core import health
from hpc.login.drill import fault_commands
from tests.conftest import hpcx
from trainer.script import child_env, command_argv, exit_words, rank_variables


def spec(tmp_path, body: str):
    path = tmp_path / "job.toml"
    path.write_text(body)
    return path


def refused(tmp_path, body: str, *args: str) -> list[str]:
    out = hpcx("render", str(spec(tmp_path, body)), "--site", "local", *args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    return out.stderr.strip().splitlines()


@pytest.mark.parametrize("section", ["model", "data", "train", "parallel", "checkpoint"])
def test_a_section_of_hpcxs_trainer_beside_a_command_is_refused(tmp_path, section):
    lines = refused(tmp_path, f'[job]\ncommand = ["python", "t.py"]\n[{section}]\n')
    assert any(f"`[{section}]` configures hpcx's trainer, but `job.command`" in line and "job.toml" in line
               for line in lines), lines


def test_a_trainer_key_set_on_the_command_line_is_refused_as_coming_from_there(tmp_path):
    lines = refused(tmp_path, '[job]\ncommand = ["python", "t.py"]\n', "--set", "train.steps=5")
    assert any("`[train]` configures hpcx's trainer" in line for line in lines), lines


def test_all_the_problems_of_a_script_spec_are_said_at_once(tmp_path):
    lines = refused(tmp_path, '[job]\ncommand = ["python train.py --lr 3"]\n[model]\n[train]\n')
    assert len(lines) == 2 and "`[model]` (and `[train]`) configures hpcx's trainer" in lines[1] and any('["python", "train.py", "--lr", "3"]' in line for line in lines), lines


@pytest.mark.parametrize("command, words", [
    ('"python train.py"', "`job.command`"),  # a string, not a list
    ('["python train.py"]', "one string holding a command line"),
    ('[" python", "t.py"]', "without surrounding spaces"),
    ('["", "t.py"]', "`job.command[0]`"),
    ('["python", 3]', "`job.command"),
    ('["python", "a\\u0000b"]', "job.command"),
])
def test_a_malformed_command_is_one_line_naming_it(tmp_path, command, words):
    lines = refused(tmp_path, f"[job]\ncommand = {command}\n")
    assert len(lines) == 1 and words in lines[0] and "job.toml" in lines[0], lines


def test_a_program_path_with_spaces_is_one_program(tmp_path):
    out = hpcx("render", str(spec(tmp_path, '[job]\ncommand = ["/opt/my tools/run"]\n')), "--site", "local")
    assert out.returncode == 0, out.stderr
    assert '# command: ["/opt/my tools/run"] on every rank' in out.stderr


@pytest.mark.parametrize("command", ["plan", "dryrun"])
def test_plan_and_dryrun_of_a_script_say_there_is_no_model(tmp_path, command):
    out = hpcx(command, str(spec(tmp_path, '[job]\ncommand = ["python", "t.py"]\n')), "--site", "local")
    assert out.returncode == 2 and f"`hpcx {command}` has no model to count or build" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


def test_render_of_a_script_says_what_runs_where_and_how_preemption_reaches_it(tmp_path):
    body = '[job]\nnodes = 1\ntasks_per_node = 2\ncommand = ["python", "train.py", "--epochs", "3"]\n'
    out = hpcx("render", str(spec(tmp_path, body)), "--site", "local")
    assert out.returncode == 0, out.stderr
    assert '# command: ["python", "train.py", "--epochs", "3"] on every rank' in out.stderr
    assert "hpc.job.requeue()" in out.stderr and "# strategy" not in out.stderr and "# batch" not in out.stderr
    assert json.loads(out.stdout)["tasks_per_node"] == 2


def test_the_batch_arithmetic_of_the_trainer_does_not_apply_to_a_script(tmp_path):
    # 3 ranks would not divide the trainer's default global batch of 8: a script has its own batches
    out = hpcx("render", str(spec(tmp_path, '[job]\ntasks_per_node = 3\ncommand = ["python", "t.py"]\n')),
               "--site", "local")
    assert out.returncode == 0, out.stderr
    assert "# ranks: 1 nodes × 3 tasks = 3" in out.stderr


def test_rank_variables_are_torchruns_node_major():
    got = rank_variables(rank=5, local_rank=1, world=8, local_world=4, master_addr="n1", master_port=20001)
    assert got == {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
                   "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "5", "ROLE_WORLD_SIZE": "8", "ROLE_NAME": "default",
                   "MASTER_ADDR": "n1", "MASTER_PORT": "20001"}
    assert rank_variables(0, 0, 1, 1, "h", 1)["GROUP_WORLD_SIZE"] == "1"


def test_the_command_environment_layers_site_spec_ranks_and_hpcx_in_that_order():
    base = {"NCCL_DEBUG": "INFO", "RANK": "stale", "PYTHONPATH": "/mine", "PATH": "/bin"}
    env = child_env(base, {"RANK": "1"}, {"NCCL_DEBUG": "WARN", "NCCL_IB_HCA": "mlx5"}, {"NCCL_IB_HCA": "mine"},
                    {"HPCX_RUN_DIR": "/r"}, cpus_per_task=6, gpus=False)
    assert env["NCCL_DEBUG"] == "INFO"  # the task's value wins over the site's, as for the trainer
    assert env["NCCL_IB_HCA"] == "mine"  # env.set wins over the site
    assert env["RANK"] == "1" and env["HPCX_RUN_DIR"] == "/r" and env["PATH"] == "/bin"
    assert env["OMP_NUM_THREADS"] == "6"
    parts = env["PYTHONPATH"].split(os.pathsep)
    assert parts[0] == "/mine" and os.path.isdir(os.path.join(parts[-1], "hpc"))
    assert "OMP_NUM_THREADS" not in child_env({}, {}, {}, {}, {}, cpus_per_task=6, gpus=True)
    assert child_env({"OMP_NUM_THREADS": "2"}, {}, {}, {}, {}, 6, False)["OMP_NUM_THREADS"] == "2"


def test_python_first_is_the_tasks_interpreter_anything_else_is_looked_up():
    assert command_argv(["python", "t.py"], "/venv/bin/python") == ["/venv/bin/python", "t.py"]
    assert command_argv(["python3", "-m", "pkg"], "/x/python") == ["/x/python", "-m", "pkg"]
    assert command_argv(["bash", "run.sh", "python"], "/x/python") == ["bash", "run.sh", "python"]
    assert command_argv(["python3.11", "t.py"], "/x/python") == ["python3.11", "t.py"]


def test_exit_words():
    assert exit_words(3) == "exited with status 3"
    assert exit_words(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_words(-200) == "killed by signal 200"


def test_the_helper_outside_hpcx_is_inert(monkeypatch, tmp_path):
    for name in (job.RUN_DIR, job.PREEMPT_FLAG, job.REQUEUE_FILE, job.RESTART, "RANK"):
        monkeypatch.delenv(name, raising=False)
    assert not job.under_hpcx() and job.run_dir() is None and job.restart() == 0
    assert not job.preempted() and job.requeue() is False
    job.log(3, loss=1.0)  # nothing to write to, nothing written
    assert list(tmp_path.iterdir()) == []


def test_the_helper_inside_hpcx(monkeypatch, tmp_path):
    flag, asked = tmp_path / "x.preempted", tmp_path / "x.asked"
    monkeypatch.setenv(job.RUN_DIR, str(tmp_path))
    monkeypatch.setenv(job.PREEMPT_FLAG, str(flag))
    monkeypatch.setenv(job.REQUEUE_FILE, str(asked))
    monkeypatch.setenv(job.RESTART, "2")
    monkeypatch.setenv("RANK", "0")
    assert job.under_hpcx() and job.run_dir() == tmp_path and job.restart() == 2
    assert not job.preempted()
    flag.touch()
    assert job.preempted()
    assert job.requeue() and job.requeue() and json.loads(asked.read_text())["rank"] == 0  # twice is once
    monkeypatch.setenv(job.INCARNATION, "77.2")
    monkeypatch.setattr(job, "_beat_written", float("-inf"))
    job.log(7, loss=0.5, accuracy=0.9)
    line = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert line["step"] == 7 and line["start"] == 2 and line["loss"] == 0.5 and line["accuracy"] == 0.9
    beat = health.read_beat(tmp_path, 0)  # a step boundary: the trainer's heartbeat, on every rank
    assert beat["step"] == 7 and beat["pid"] == os.getpid() and beat["incarnation"] == "77.2"
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(job, "_beat_written", float("-inf"))  # another process, in the job
    job.log(8, loss=0.1)  # other ranks write no metrics line
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1
    assert health.read_beat(tmp_path, 1)["step"] == 8
    job.log(9, loss=0.1)
    assert health.read_beat(tmp_path, 1)["step"] == 8  # at most every few seconds
    assert fault_commands("hang", 1, health.read_beats(tmp_path), 60) == [
        (os.uname().nodename, ["kill", "-STOP", str(os.getpid())], True)]  # what `hpcx drill --hang 1` runs
    with pytest.raises(ValueError, match="step = -1"):
        monkeypatch.setenv("RANK", "0") or job.log(-1)


def test_the_helper_is_torch_free_and_stdlib_only():
    import subprocess
    import sys

    code = "import sys; from hpc import job; job.preempted(); print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'hpc', 'trainer', 'submitit')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['hpc', 'hpc.job']"


def test_the_script_task_is_torch_free_as_submitit_unpickles_it_before_any_rank_imports_torch():
    import subprocess
    import sys

    code = "import sys, trainer.script, trainer.ranks; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_first_rank_to_end_with_a_failure_comes_first():
    from trainer.script import first_failures

    ended = [{"rank": 0, "status": 1, "time": 12.5, "error": "r0"}, {"rank": 1, "status": 0, "time": 10.0, "error": None},
             {"rank": 2, "status": 3, "time": 11.0, "error": "r2"}, {"rank": 3, "status": None, "error": "never said"},
             {"rank": 4, "status": -9, "time": 11.5, "error": "r4"}]
    assert [r["rank"] for r in first_failures(ended)] == [2, 4, 0, 3]
    assert first_failures([{"rank": 1, "status": 0, "time": 1.0, "error": None}]) == []


def test_the_error_torchs_record_wrote_is_read_with_its_innermost_line(tmp_path):
    from trainer.script import recorded_error

    path = tmp_path / "error.json"
    stack = ('Traceback (most recent call last):\n  File "/x/torch/errors/__init__.py", line 357, in wrapper\n'
             '  File "/u/train.py", line 40, in main\n  File "/u/model.py", line 7, in forward\n'
             "NameError: name 'y' is not defined\n")
    path.write_text(json.dumps({"message": {"message": "NameError: name 'y' is not defined",
                                            "extraInfo": {"py_callstack": stack, "timestamp": "1"}}}))
    assert recorded_error(path) == " (NameError: name 'y' is not defined at /u/model.py:7)"
    assert recorded_error(tmp_path / "none.json") == ""
    path.write_text("{not json")
    assert recorded_error(path) == ""

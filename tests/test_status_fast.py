"""`hpcx status`'s list through the console script's fast path (``hpc.entry``, no Click) prints what the
Click command prints, byte for byte, and imports nothing heavy; the states asked in the background
come back (or raise) as before. Behaviour only: the timings are bench/cli_latency's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.core import runs
from hpc.login import status, submit
from tests.conftest import REPO
from tests.test_slurm_vars import bogus_conf, fake_runs, site_path_with

CONSOLE_SCRIPT = "import sys; from hpc.entry import main; main()"  # what the installed `hpcx` runs
HEAVY = ("torch", "numpy", "submitit", "cloudpickle", "click", "hpc.cli", "hpc.plan", "trainer", "tomli_w")


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """A run root of odd runs (an ANSI escape and non-ASCII in a job id, a ledger with a stop, an eval
    line, a torn resolved.json), a site profile that does not load, and a cluster that is down."""
    root = tmp_path / "runs"
    plain, styled, stopped, torn = fake_runs(root, 4)
    (styled / "job.json").write_text(json.dumps({"job_id": "\x1b[31m990001\x1b[0m-é", "scheduler": "slurm"}))
    (stopped / "ledger.jsonl").write_text(json.dumps({"event": "start", "step": 0}) + "\n" + json.dumps(
        {"event": "stop", "reason": "failed", "step": 40, "requeued": False, "error": "boom"}) + "\n")
    (stopped / "metrics.jsonl").write_text(json.dumps({"step": 40, "loss": 2.5}) + "\n" + json.dumps(
        {"step": 40, "eval_loss": 2.25, "eval_perplexity": 9.49}) + "\n")
    (torn / "resolved.json").write_text('{"launch": {"world_size": ')
    for n, run in enumerate((plain, styled, stopped, torn)):
        os.utime(run, (1e9 + n, 1e9 + n))
    found = {**site_path_with(tmp_path, root), "SLURM_CONF": str(bogus_conf(tmp_path))}
    (Path(found["HPCX_SITE_PATH"]) / "broken.toml").write_text(f'nodes = 3\n[storage]\nrun_root = "{root}"\n')
    return {**os.environ, **found}


def hpcx(env: dict[str, str], *args: str, fast: bool, **kwargs) -> subprocess.CompletedProcess:
    how = ["-c", CONSOLE_SCRIPT] if fast else ["-m", "hpc.cli"]
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **kwargs}
    return subprocess.run([sys.executable, *how, *args], env=env, timeout=60, cwd=REPO, **streams)


@pytest.mark.parametrize("args", [["status"], ["status", "--json"]])
def test_the_console_script_prints_what_the_click_command_prints(env, args):
    fast, click = hpcx(env, *args, fast=True), hpcx(env, *args, fast=False)
    assert (fast.returncode, fast.stdout, fast.stderr) == (click.returncode, click.stdout, click.stderr)
    assert click.returncode == 0 and b"warning: site profile" in click.stderr and b"broken.toml" in click.stderr
    text = click.stdout.decode()
    if args == ["status"]:
        assert "\x1b" not in text and "job 990001-é  " in text  # styles stripped, as click.echo does off a tty
        assert len(text.splitlines()) == 4 and "eval loss 2.2500 (perplexity 9.49)" in text
        assert "last stop: failed at step 40: boom (not requeued: ?)" in text and "UNREADABLE" in text
    else:
        assert "\x1b[31m990001\x1b[0m-é" in [row["job_id"] for row in json.loads(text)]


def test_on_a_closed_pipe_both_exit_1_saying_nothing(env):
    outcomes = []
    for fast in (True, False):
        read, write = os.pipe()
        os.close(read)
        try:
            done = hpcx(env, "status", fast=fast, stdout=write, stderr=subprocess.PIPE)
        finally:
            os.close(write)
        outcomes.append((done.returncode, done.stderr.decode().replace("\n", "|")))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] == 1 and "Traceback" not in outcomes[0][1]


PROBE = ("import json, sys\n"
         "from {module} import main\n"
         "try:\n    main()\n"
         "except SystemExit:\n    pass\n"
         "print('MODULES=' + json.dumps(sorted(sys.modules)), file=sys.stderr)\n")


@pytest.mark.parametrize("module,heavy", [("hpc.entry", HEAVY), ("hpc.cli", ("torch", "numpy", "submitit",
                                                                             "cloudpickle", "hpc.plan", "trainer"))])
def test_status_imports_nothing_it_does_not_need(env, module, heavy):
    done = subprocess.run([sys.executable, "-c", PROBE.format(module=module), "status"], capture_output=True,
                          text=True, env=env, timeout=60, cwd=REPO)
    line = next(x for x in done.stderr.splitlines() if x.startswith("MODULES="))
    loaded = json.loads(line.removeprefix("MODULES="))
    assert "hpc.login.submit" in loaded  # it did list the runs
    assert [m for m in loaded if m.split(".")[0] in heavy or m in heavy or m.startswith(heavy)] == []


@pytest.mark.parametrize("args", [["status", "some-run"], ["status", "--help"], ["status", "--json", "x"],
                                  ["--help"], [], ["render", "x.toml"]])
def test_anything_but_the_bare_list_goes_to_click(args):
    assert status.without_click(args) is None


def test_shell_completion_goes_to_click(monkeypatch):
    monkeypatch.setenv("_HPCX_COMPLETE", "bash_source")
    assert status.without_click(["status"]) is None


def test_a_scheduler_that_raises_raises_where_the_states_are_awaited(tmp_path, monkeypatch):
    (run,) = fake_runs(tmp_path / "runs", 1)

    class Broken:
        def states(self, jobs, timeout):
            raise RuntimeError("the scheduler's own bug")

    monkeypatch.setattr(submit.schedulers, "get", lambda kind: Broken())
    answered = submit.ask_states([run], 5)
    with pytest.raises(RuntimeError, match="the scheduler's own bug"):
        answered()


def test_the_list_reads_the_run_files_while_the_scheduler_answers(tmp_path, monkeypatch):
    """Each run's files are read before the scheduler's answer is awaited; its states after it (a state
    the answer recorded is in the row)."""
    (run,) = fake_runs(tmp_path / "runs", 1)
    order = []

    class Slow:
        def states(self, jobs, timeout):
            order.append("asked")
            return {j: submit.schedulers.JobState("COMPLETED", "n1", "fake") for j in jobs}

    real = submit.recorded_summary
    monkeypatch.setattr(submit.schedulers, "get", lambda kind: Slow())
    monkeypatch.setattr(submit, "recorded_summary", lambda r: order.append("read") or real(r))
    (row,) = submit.summaries([run], 5)
    assert sorted(order) == ["asked", "read"]
    assert row["state"] == "COMPLETED" and row["states"] == ["RUNNING", "COMPLETED"]
    assert list(row)[:7] == ["run_dir", "job_id", "scheduler", "state", "state_words", "nodes", "states"]


@pytest.mark.parametrize("eval_at", [None, 10, 1500])
def test_the_last_eval_line_is_found_within_its_window_only(tmp_path, eval_at):
    """Eval lines are looked for in the last 64 KiB (some hundreds of lines): found there, and not beyond."""
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 2.0, "tokens_per_s": 1e5}) for s in range(2000)]
    if eval_at is not None:
        lines.insert(len(lines) - eval_at, json.dumps({"step": 1, "eval_loss": 1.5}))
    path.write_text("\n".join(lines) + "\n")
    found = runs.read_last_jsonl_with(path, "eval_loss")
    assert found == ({"step": 1, "eval_loss": 1.5} if eval_at == 10 else None)

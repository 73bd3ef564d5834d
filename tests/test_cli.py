"""The CLI as a user meets it: exit codes, one-line errors, --json, and no torch on login nodes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpc.cli import cli

REPO = Path(__file__).resolve().parents[1]
JOB = str(REPO / "jobs/tiny-ddp.toml")


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0 and "hpcx, version" in result.output


@pytest.mark.parametrize("command", [[], ["render"], ["submit"], ["status"], ["logs"], ["cancel"],
                                     ["site"], ["site", "list"], ["site", "show"], ["site", "detect"], ["plan"],
                                     ["ckpt"], ["ckpt", "inspect"], ["ckpt", "convert"], ["ckpt", "verify"],
                                     ["scale"], ["scale", "report"], ["scale", "predict"]])
def test_help_everywhere(command):
    result = invoke(*command, "--help")
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


def test_render_writes_script_to_stdout():
    result = CliRunner().invoke(cli, ["render", str(REPO / "jobs/tiny-hsdp-2node.toml"), "--site", "sandbox"])
    assert result.exit_code == 0
    assert result.stdout.startswith("#!/bin/bash\n")
    assert "# strategy: hsdp" in result.stderr


def test_bad_spec_exits_2_one_line_per_error(tmp_path: Path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nstpes = 3\nlr = 'fast'\n[parallel]\nstrategy = 'zero3'\n")
    result = CliRunner().invoke(cli, ["render", str(bad)])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f"error: {bad}: unknown key `train.stpes`: did you mean `train.steps`?",
        f"error: {bad}: `train.lr` = 'fast' (str): expected a number",
        f"error: {bad}: `parallel.strategy` = 'zero3': expected one of 'auto', 'none', 'dp', 'ddp', 'fsdp', 'hsdp'",
    ]
    assert "Traceback" not in result.output


def test_bad_override_exits_2():
    result = CliRunner().invoke(cli, ["render", JOB, "--set", "train.micro_bach=2"])
    assert result.exit_code == 2
    assert "did you mean `train.micro_batch`?" in result.stderr


def test_bad_site_exits_2():
    result = CliRunner().invoke(cli, ["render", JOB, "--site", "nowhere"])
    assert result.exit_code == 2 and "no such site profile" in result.stderr


def test_submit_bad_spec_writes_nothing(tmp_path: Path, monkeypatch):
    bad = tmp_path / "bad.toml"
    bad.write_text(f"[job]\nrun_root = '{tmp_path / 'runs'}'\nnodes = 0\n")
    result = CliRunner().invoke(cli, ["submit", str(bad)])
    assert result.exit_code == 2
    assert not (tmp_path / "runs").exists()


def test_site_list_and_show_json():
    sites = json.loads(invoke("site", "list", "--json").output)
    assert {s["name"] for s in sites} >= {"local", "sandbox", "dgx-h100", "pcie-4gpu"}
    dgx = json.loads(invoke("site", "show", "dgx-h100", "--json").output)
    assert dgx["node"]["gpus"] == 8 and dgx["nccl"]["NCCL_IB_HCA"] == "mlx5"
    assert "[node]" in invoke("site", "show", "sandbox").output


def test_status_unknown_run_exits_2(tmp_path: Path):
    result = CliRunner().invoke(cli, ["status", str(tmp_path / "nothing-here")])
    assert result.exit_code == 2 and "not a run folder" in result.stderr


LOGIN_COMMANDS = [
    ["--help"],
    ["--version"],
    ["render", JOB],
    ["render", str(REPO / "jobs/tiny-hsdp-2node.toml"), "--site", "sandbox"],
    ["status", "--json"],
    ["site", "list"],
    ["site", "show", "dgx-h100"],
    ["logs", "/nonexistent"],
    ["cancel", "/nonexistent"],
    ["resume", "/nonexistent"],
    ["plan", str(REPO / "jobs/gpt-13b-auto.toml"), "--site", "dgx-h100"],
    ["scale", "predict", str(REPO / "jobs/gpt-13b-auto.toml"), "--site", "dgx-h100", "--nodes", "1,2,4,8"],
    ["ckpt", "--help"],
]

PROBE = """
import sys
from hpc.cli import cli
try:
    cli.main(args=sys.argv[1:], prog_name="hpcx")
except SystemExit:
    pass
heavy = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.") or m == "numpy")
print("HEAVY=" + ",".join(heavy), file=sys.stderr)
"""


@pytest.mark.parametrize("args", LOGIN_COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_login_commands_never_import_torch(args):
    out = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=60)
    line = [ln for ln in out.stderr.splitlines() if ln.startswith("HEAVY=")]
    assert line == ["HEAVY="], out.stderr[-2000:]


def test_run_folder_modes(tmp_path: Path):
    from hpc.core.runs import new_run_dir, private_umask

    for group, dir_mode, file_mode in ((False, 0o700, 0o600), (True, 0o750, 0o640)):
        with private_umask(group):
            run = new_run_dir(tmp_path / str(group), "a b/c", group)
            (run / "f").write_text("x")
        assert run.stat().st_mode & 0o777 == dir_mode
        assert (run / "f").stat().st_mode & 0o777 == file_mode
        assert run.name.startswith("a_b_c-")

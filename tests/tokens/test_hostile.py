"""Every case of the data path's hostile-input corpus (``tests/tokens/hostile.py``, issue 35) through
the real CLI in a fresh process: the exit code, one ``error:`` line naming the file and the key or
line, no traceback, nothing left behind, no input changed, peak memory under 600 MB."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.tokens.hostile import CASES

MAX_RSS_MB = 600
TIMEOUT_S = 600  # a hang guard only: a case takes seconds (tests check behaviour, never timings)
# The CLI is started by this small interpreter, which writes the peak RSS of what it waited for (the CLI
# and its workers) to argv[1]. Measured from pytest itself, a forked child's peak counts the pages it
# shared with pytest before its exec: in a whole-suite run that is pytest's own ~750 MB (torch imported).
MEASURE = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[2:]); "
           "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); "
           "sys.exit(code if code >= 0 else 128 - code)")


def snapshot(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, tuple]:
    """Every path under ``folder`` (symlinks not followed) with its kind, size and modification time."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            p = Path(root) / name
            rel = str(p.relative_to(folder))
            if any(rel == s or rel.startswith(s + os.sep) for s in skip):
                continue
            info = p.lstat()
            out[rel] = (stat.S_IFMT(info.st_mode), info.st_size if stat.S_ISREG(info.st_mode) else 0,
                        info.st_mtime_ns if stat.S_ISREG(info.st_mode) else 0)
    return out


def run_cli(argv: list[str], cwd: Path, extra_env: dict[str, str]) -> tuple[int, str, str, float]:
    """(exit code, stdout, stderr, peak RSS in MB) of ``hpcx ARGV`` in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": str(REPO), **extra_env}
    with open(cwd / ".stdout", "w+") as out, open(cwd / ".stderr", "w+") as err:
        peak = cwd.parent / ".peak-rss-kb"
        proc = subprocess.Popen([sys.executable, "-c", MEASURE, str(peak), sys.executable, "-m", "hpc.cli", *argv],
                                stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=cwd, env=env,
                                start_new_session=True)
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            pid, status, _ = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                os.killpg(proc.pid, 9)
                os.wait4(proc.pid, 0)
                pytest.fail(f"hpcx {' '.join(argv)}: still running after {TIMEOUT_S} s")
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read(), err.read(), int(peak.read_text()) / 1024


ALL = [(cls, name) for cls, cases in CASES.items() for name in cases]


@pytest.mark.parametrize("cls,name", ALL, ids=[f"{c}/{n}" for c, n in ALL])
def test_case(cls, name, tmp_path, tokenizer):
    folder = tmp_path / "case"
    folder.mkdir()
    expect = CASES[cls][name](folder, tokenizer)
    run = tmp_path / "run"
    run.mkdir()
    before = snapshot(folder)
    kept = snapshot(folder, expect.creates)
    code, stdout, stderr, rss = run_cli(expect.argv, run, expect.env)
    assert "Traceback" not in stderr + stdout, stderr
    assert code == expect.code, (stdout, stderr)
    assert rss < MAX_RSS_MB, f"peak RSS {rss:.0f} MB"
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    if expect.code:
        assert len(errors) == 1 and all(line.startswith(("error:", "prepare ")) for line in stderr.splitlines()), stderr
        for word in expect.words:
            assert word in errors[0], (word, errors[0])
        assert snapshot(folder) == before, "left something behind, or changed an input"
    else:
        assert not errors, stderr
        for word in expect.words:
            assert word in stdout, (word, stdout)
        assert snapshot(folder, expect.creates) == kept, "changed an input"


def test_a_refused_prepare_runs_again_once_fixed(tmp_path, tokenizer):
    """Issue 35: a refusal (bad line 2) used to leave a plan behind, and the fixed input was then
    refused as 'prepared before with other inputs'."""
    bad = tmp_path / "a.jsonl"
    bad.write_text('{"text": "one"}\n{broken\n')
    argv = ["data", "prepare", str(bad), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "out")]
    code, _, stderr, _ = run_cli(argv, tmp_path, {})
    assert code == 2 and f"{bad}:2" in stderr and not (tmp_path / "out").exists()
    bad.write_text('{"text": "one"}\n{"text": "two, fixed"}\n')
    code, stdout, stderr, _ = run_cli(argv, tmp_path, {})
    assert code == 0 and "2 documents" in stdout, stderr


def test_a_plan_no_group_finished_is_replaced(tmp_path, tokenizer):
    """A plan whose groups never finished (a crash before the first) holds nothing to resume."""
    from hpc.data.prepare import Options, make_plan, start

    src = tmp_path / "a.jsonl"
    src.write_text('{"text": "one"}\n')
    start(tmp_path / "out", make_plan([str(src)], str(tokenizer), Options()))
    src.write_text('{"text": "one, then longer"}\n')
    argv = ["data", "prepare", str(src), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "out")]
    code, stdout, stderr, _ = run_cli(argv, tmp_path, {})
    assert code == 0 and "1 documents" in stdout, stderr


def test_a_rank_names_the_shard_of_an_id_past_the_vocabulary(tmp_path, tokenizer):
    """What the login checks cannot see (a manifest without max_id, edited after the check) fails at
    the first sample in one line naming the shard, not with torch's IndexError naming nothing."""
    from tests.tokens.hostile import prepared
    from trainer.tokens import ManifestTokens

    folder = prepared(tmp_path, tokenizer)
    assert int(ManifestTokens(folder, "train", 8, vocab=600)[0].max()) < 600
    with pytest.raises(ValueError, match=r"train-00000-0000\.bin: token id \d+ at token \d+ is not below the "
                                         r"model's vocabulary of 2 \(run `hpcx data verify"):
        ManifestTokens(folder, "train", 8, vocab=2)[0]


def test_an_old_manifest_gets_its_max_ids_from_verify(tmp_path, tokenizer):
    """Issue 47: a manifest from before shards recorded max_id passed submit whatever ids its shards
    held; `hpcx data verify` records them (once every file matched), and submit compares them with the
    model's vocabulary from then on."""
    import json

    from tests.tokens.hostile import edit_manifest, prepared, spec

    folder = prepared(tmp_path, tokenizer)
    shards = lambda doc: [s for split in doc["splits"].values() for s in split["shards"]]  # noqa: E731
    written = [s["max_id"] for s in shards(json.loads((folder / "manifest.json").read_text()))]
    edit_manifest(folder, lambda m: [s.pop("max_id") for s in shards(m)])
    code, stdout, stderr, _ = run_cli(["data", "verify", str(folder)], tmp_path, {})
    assert code == 0 and f"recorded max_id (the largest token id) of {len(written)} shards" in stdout, stderr
    assert [s["max_id"] for s in shards(json.loads((folder / "manifest.json").read_text()))] == written
    code, stdout, _, _ = run_cli(["data", "verify", str(folder)], tmp_path, {})
    assert code == 0 and "recorded" not in stdout  # nothing more to record: the manifest is left alone
    edit_manifest(folder, lambda m: m.update(vocab_size=max(written), eos_id=1))
    code, _, stderr, _ = run_cli(["render", str(spec(tmp_path, folder, vocab=max(written)))], tmp_path, {})
    assert code == 2 and f"max_id = {max(written)}: expected an id below vocab_size" in stderr, stderr


def test_a_lora_resume_checks_its_base_before_it_is_queued(tmp_path):
    """Issue 47: a LoRA run reads its frozen base again at every start, so `hpcx resume` checks it as
    `submit` did (a base gone or replaced by another model, a PEFT folder's config broken since) before
    queueing; a full run's resume reads its own checkpoint only and is left alone."""
    from hpc.core.spec import load_spec
    from hpc.login.submit import base_problems
    from tests.tokens.hostile_surfaces import LORA, adapter, adapter_config, hf_base, llama_job

    base = hf_base(tmp_path)
    lora = load_spec(llama_job(tmp_path, base))
    full = load_spec(llama_job(tmp_path, base, lora=""))
    assert base_problems(lora) == [] and base_problems(full) == []
    (base / "model.safetensors").unlink()
    problems = base_problems(lora)
    assert len(problems) == 1 and "`checkpoint.init_from`" in problems[0], problems
    assert base_problems(full) == []  # its resume does not read init_from
    peft = tmp_path / "p"
    peft.mkdir()
    folder = adapter(peft, hf_base(peft))
    spec = load_spec(llama_job(peft, folder, LORA))
    assert base_problems(spec) == []
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config(peft / "base", r=True)))
    problems = base_problems(spec)
    assert len(problems) == 1 and "r = true: expected an integer rank" in problems[0], problems

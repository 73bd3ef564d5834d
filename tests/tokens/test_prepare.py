"""``hpcx data prepare`` / ``verify`` on corpora made in the test (issue 21, item 1)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from hpc.data import prepare as prep
from tests.conftest import hpcx
from tests.tokens.corpus import write_jsonl


def run_prepare(*args: str) -> tuple[int, str]:
    """The real command in this process (Click's runner): (exit code, stdout + stderr)."""
    from click.testing import CliRunner

    from hpc.cli import cli

    result = CliRunner().invoke(cli, ["data", "prepare", *args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_text_corpus_round_trips_with_eos_per_document(tmp_path, corpus, tokenizer):
    from tokenizers import Tokenizer

    code, out = run_prepare(str(corpus), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "o"))
    assert code == 0, out
    manifest = json.loads((tmp_path / "o/manifest.json").read_text())
    assert manifest["dtype"] == "uint16" and manifest["vocab_size"] == 600 and manifest["eos_id"] == 1
    assert manifest["tokenizer"]["sha256"] and manifest["tokenizer"]["path"] == str(tokenizer)
    assert [i["bytes"] for i in manifest["inputs"]] == [Path(i["path"]).stat().st_size for i in manifest["inputs"]]
    shard = manifest["splits"]["train"]["shards"][0]
    tokens = np.fromfile(tmp_path / "o" / shard["file"], dtype=np.uint16)
    offsets = np.fromfile(tmp_path / "o" / shard["index"], dtype=np.uint64)
    assert len(offsets) == shard["documents"] + 1 and offsets[-1] == len(tokens) == shard["tokens"]
    ends = tokens[offsets[1:] - 1]
    assert (ends == 1).all() and (tokens == 1).sum() == shard["documents"]  # one EOS per document, at its end
    first = Path(manifest["inputs"][0]["path"]).read_text().split("\n\n")[0].rstrip("\n")
    decoded = Tokenizer.from_file(str(tokenizer)).decode(tokens[:offsets[1] - 1].tolist())
    assert decoded == first


def test_output_does_not_depend_on_workers(tmp_path, corpus, tokenizer):
    common = [str(corpus), "--tokenizer", str(tokenizer), "--val-fraction", "0.2", "--group-bytes", "60000",
              "--shard-tokens", "8000"]
    assert run_prepare(*common, "--out", str(tmp_path / "one"), "--workers", "1")[0] == 0
    out = hpcx("data", "prepare", *common, "--out", str(tmp_path / "two"), "--workers", "2")
    assert out.returncode == 0, out.stderr
    assert "tokens/s" in out.stderr and "ETA" in out.stderr
    one, two = folder_bytes(tmp_path / "one"), folder_bytes(tmp_path / "two")
    assert one == two and len(json.loads(one["manifest.json"])["groups"]) > 2


def test_validation_split_is_by_document_and_deterministic(tmp_path, corpus, tokenizer):
    assert run_prepare(str(corpus), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "o"),
                       "--val-fraction", "0.25")[0] == 0
    splits = json.loads((tmp_path / "o/manifest.json").read_text())["splits"]
    docs = splits["train"]["documents"] + splits["val"]["documents"]
    assert 0.15 < splits["val"]["documents"] / docs < 0.35
    para = "def f():\n    return 1"
    assert prep.in_val([(para, True)], 0.25) == prep.in_val([(para, True)], 0.25)
    assert not prep.in_val([(para, True)], 0.0)


def test_jsonl_gz_zst_and_parquet_inputs(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    records = [{"text": f"document number {i} " * 5, "id": i} for i in range(30)]
    raw = "".join(json.dumps(r) + "\n" for r in records).encode()
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "a.jsonl.gz").write_bytes(gzip.compress(raw))
    (inputs / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    pq.write_table(pa.table({"text": [r["text"] for r in records]}), inputs / "c.parquet")
    code, out = run_prepare(str(inputs), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "o"), "--json")
    assert code == 0, out
    manifest = json.loads((tmp_path / "o/manifest.json").read_text())
    assert manifest["splits"]["train"]["documents"] == 90
    bins = [np.fromfile(tmp_path / "o" / s["file"], dtype=np.uint16) for s in manifest["splits"]["train"]["shards"]]
    assert len(bins) == 1 and (bins[0][: len(bins[0]) // 3] == bins[0][len(bins[0]) // 3: 2 * len(bins[0]) // 3]).all()


@pytest.mark.parametrize("name,content,expected", [
    ("bad.txt", b"ok line\n\nfine\n\xff\xfe broken\n", "bad.txt:4: byte 0xff at column 1 is not UTF-8: expected UTF-8 text"),
    ("bad.jsonl", b'{"text": "a"}\n{"txt": "b"}\n', "bad.jsonl:2: no key 'text': expected a string 'text'"),
    ("bad.jsonl", b'{"text": "a"}\n{"text": 5}\n', "bad.jsonl:2: 'text' is a int: expected a string 'text'"),
    ("bad.jsonl", b'{"text": "a"}\n{"text": "b"\n', "bad.jsonl:2: not JSON (Expecting ',' delimiter): expected one JSON object per line"),
    ("empty.txt", b"", "empty.txt: no documents (an empty input): expected at least one"),
])
def test_bad_input_names_file_line_and_expectation(tmp_path, tokenizer, name, content, expected):
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / name).write_bytes(content)
    code, out = run_prepare(str(inputs), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "o"))
    assert code == 2
    assert out.strip() == f"error: {inputs / expected}", out
    assert not (tmp_path / "o/manifest.json").exists()


def test_errors_skip_counts_and_reports(tmp_path, tokenizer):
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_jsonl(inputs / "a.jsonl", [{"text": "good one"}, {"nope": 1}, {"text": "good two"}])
    (inputs / "b.txt").write_bytes(b"fine\n\n\xc3\x28 bad\n")
    code, out = run_prepare(str(inputs), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "o"),
                            "--errors", "skip")
    assert code == 0, out
    assert "skipped 2 bad documents" in out and "a.jsonl:2: no key 'text'" in out and "b.txt:3: byte 0xc3" in out
    manifest = json.loads((tmp_path / "o/manifest.json").read_text())
    assert manifest["skipped"]["count"] == 2 and manifest["splits"]["train"]["documents"] == 3


def test_killed_preparation_resumes_to_the_same_bytes(tmp_path, corpus, tokenizer, monkeypatch):
    common = [str(corpus), "--tokenizer", str(tokenizer), "--group-bytes", "60000", "--val-fraction", "0.1"]
    assert run_prepare(*common, "--out", str(tmp_path / "whole"))[0] == 0
    real, calls = prep.run_group, []

    def dies_at_third(out, plan, group, report=None):
        calls.append(group)
        if len(calls) == 3:
            (out / "train-00002-0000.bin.tmp").write_bytes(b"half")  # what a kill mid-write leaves at most
            raise KeyboardInterrupt
        return real(out, plan, group, report)

    monkeypatch.setattr("hpc.data.local.run_group", dies_at_third)
    assert run_prepare(*common, "--out", str(tmp_path / "resumed"))[0] != 0  # Click: KeyboardInterrupt → Abort
    assert not (tmp_path / "resumed/manifest.json").exists()
    monkeypatch.setattr("hpc.data.local.run_group", lambda *a: calls.append(a[2]) or real(*a))
    assert run_prepare(*common, "--out", str(tmp_path / "resumed"))[0] == 0
    assert calls[3] == 2  # groups 0 and 1 were not redone
    (tmp_path / "resumed/train-00002-0000.bin.tmp").unlink()
    assert folder_bytes(tmp_path / "whole") == folder_bytes(tmp_path / "resumed")


def test_resume_with_other_options_is_refused(tmp_path, corpus, tokenizer):
    assert run_prepare(str(corpus), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "o"))[0] == 0
    code, out = run_prepare(str(corpus), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "o"),
                            "--val-fraction", "0.5")
    assert code == 2 and "prepared before with other val_fraction" in out


def test_verify_finds_a_changed_shard(tmp_path, corpus, tokenizer):
    assert run_prepare(str(corpus), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "o"))[0] == 0
    ok = hpcx("data", "verify", str(tmp_path / "o"))
    assert ok.returncode == 0 and "every file matches" in ok.stdout
    shard = tmp_path / "o/train-00000-0000.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    bad = hpcx("data", "verify", str(tmp_path / "o"))
    assert bad.returncode == 1 and "train-00000-0000.bin: sha256" in bad.stderr and "Traceback" not in bad.stderr


def test_dtype_follows_the_vocabulary():
    from hpc.data.tokenizer import TokenizerInfo

    assert TokenizerInfo("t", "h", 65536, 0, "e").dtype == "uint16"
    assert TokenizerInfo("t", "h", 65537, 0, "e").dtype == "uint32"


def test_out_that_is_a_file_is_a_user_error(tmp_path, corpus, tokenizer):
    (tmp_path / "o").write_text("")
    code, out = run_prepare(str(corpus), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "o/inside"))
    assert code == 2 and "cannot create it" in out and "Traceback" not in out


def test_missing_tokenizer_and_missing_input(tmp_path, corpus):
    code, out = run_prepare(str(corpus), "--tokenizer", str(tmp_path / "none"), "--out", str(tmp_path / "o"))
    assert code == 2 and "no such file: expected a Hugging Face tokenizer.json" in out
    code, out = run_prepare(str(tmp_path / "nothing"), "--tokenizer", "x", "--out", str(tmp_path / "o"))
    assert code == 2 and "no such file or folder" in out


def test_data_commands_import_no_torch(tmp_path, corpus, tokenizer):
    import subprocess
    import sys

    code = ("import sys; from click.testing import CliRunner; from hpc.cli import cli; "
            f"r = CliRunner().invoke(cli, ['data', 'prepare', {str(corpus)!r}, '--tokenizer', {str(tokenizer)!r}, "
            f"'--out', {str(tmp_path / 'o')!r}]); assert r.exit_code == 0, r.output; "
            f"r = CliRunner().invoke(cli, ['data', 'verify', {str(tmp_path / 'o')!r}]); assert r.exit_code == 0; "
            "from hpc.core.spec import load_spec; "
            f"load_spec('jobs/tiny-ddp.toml', [\"data.source='{tmp_path / 'o'}'\", 'model.vocab_size=640']); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("False")


def test_sigkill_mid_preparation_then_resume(tmp_path, corpus, tokenizer):
    """A real kill (SIGKILL of the process group) once some groups are finished: the folder lists no
    manifest, and the same command started again gives the bytes of an uninterrupted run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    common = [str(corpus), "--tokenizer", str(tokenizer), "--group-bytes", "20000", "--val-fraction", "0.1"]
    assert run_prepare(*common, "--out", str(tmp_path / "whole"))[0] == 0
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "hpc.cli", "data", "prepare", *common, "--out", str(out),
                             "--workers", "2"], start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=Path(__file__).parents[2])
    deadline = time.monotonic() + 300  # a hang guard: however slow the start, the kill waits for a group
    while time.monotonic() < deadline and not list((out / ".prepare").glob("group-*.json")):
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    finished = len(list((out / ".prepare").glob("group-*.json")))
    groups = len(json.loads((tmp_path / "whole/.prepare/plan.json").read_text())["groups"])
    assert 1 <= finished and not (out / "manifest.json").exists() or finished == groups
    assert run_prepare(*common, "--out", str(out))[0] == 0
    assert folder_bytes(tmp_path / "whole") == folder_bytes(out)

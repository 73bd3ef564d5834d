"""``hpcx data prepare --site sandbox`` on the real two-node cluster: one array task per group on the
nodes, the merge job after them, and the same bytes as the local run (issue 21, item 2)."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.conftest import hpcx
from tests.tokens.corpus import text_corpus, train_tokenizer


def folder_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.slurm
def test_job_array_output_is_byte_identical_to_the_local_run(sandbox, tmp_path):
    corpus = text_corpus(tmp_path / "txt", 12)
    tokenizer = train_tokenizer(tmp_path / "tokenizer.json")
    common = [str(corpus), "--tokenizer", str(tokenizer), "--group-bytes", "30000", "--val-fraction", "0.1"]
    local = hpcx("data", "prepare", *common, "--out", str(tmp_path / "local"))
    assert local.returncode == 0, local.stderr
    array = hpcx("data", "prepare", *common, "--out", str(tmp_path / "array"), "--site", "sandbox", "--wait",
                 timeout=600)
    assert array.returncode == 0, array.stdout + array.stderr
    groups = len(json.loads((tmp_path / "local/manifest.json").read_text())["groups"])
    assert groups >= 2 and f"({groups} groups)" in array.stdout
    assert folder_bytes(tmp_path / "local") == folder_bytes(tmp_path / "array")
    array_id = array.stdout.split("job array ")[1].split()[0]
    rows, deadline = [], time.monotonic() + 60
    while time.monotonic() < deadline:  # accounting records the array's tasks a moment after they end
        out = subprocess.run(["sacct", "-j", array_id, "-X", "-n", "-P", "-o", "JobID,State,NodeList"],
                             capture_output=True, text=True, timeout=30)
        rows = [line.split("|") for line in out.stdout.split()]
        if len(rows) == groups and all(state == "COMPLETED" for _, state, _ in rows):
            break
        time.sleep(1)
    assert len(rows) == groups and all(state == "COMPLETED" for _, state, _ in rows), rows
    assert {node for _, _, node in rows} <= {"n1", "n2"}  # the tasks ran on the compute nodes
    again = hpcx("data", "prepare", *common, "--out", str(tmp_path / "array"), "--site", "sandbox")
    assert again.returncode == 0 and "already prepared" in again.stdout

"""``hpcx data prepare`` throughput against a plain ``tokenizers`` loop, and its peak memory.

    python bench/data_prepare/run.py [--mb 24] [--repeat 2]

The corpus is the standard library's own ``.py`` files (recursively), copied as ``.txt`` up to
``--mb`` MB; the tokenizer a byte-level BPE of 8192 tokens trained on part of it. The baseline is
what one would write by hand in one process: read each file, cut it into the same documents
(paragraphs), ``encode_batch`` 512 at a time, append the EOS, write one flat uint16 file. hpcx
runs in a fresh process each time (``python -m hpc.cli data prepare``, a new output folder) at
``--workers 1`` and ``2`` with groups of corpus/8, rounds interleaved, best of ``--repeat``; wall
time, and CPU seconds (steadier on a loaded machine; hpcx's include its process start-up).
Peak RSS (the child's ``ru_maxrss``) is measured at 1 worker on the corpus and on the corpus twice
over, with ``--shard-tokens 1M``: it should follow the shard size and the largest batch of
documents, not the corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def make_corpus(folder: Path, megabytes: float) -> list[Path]:
    """Standard-library sources (not empty) as .txt files, sorted, up to ``megabytes`` MB."""
    folder.mkdir(parents=True)
    budget, out = int(megabytes * 1e6), []
    for n, src in enumerate(sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))):
        try:
            text = src.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():  # an empty __init__.py: an empty input is an error to prepare
            continue
        dest = folder / f"{n:05d}-{src.stem}.txt"
        dest.write_text(text, encoding="utf-8")
        out.append(dest)
        budget -= dest.stat().st_size
        if budget <= 0:
            break
    return out


def paragraphs(text: str) -> list[str]:
    """The documents hpcx reads from a .txt file: runs of lines up to a blank (whitespace-only) line."""
    docs, lines = [], []
    for line in text.split("\n"):
        if line.strip():
            lines.append(line)
        elif lines:
            docs.append("\n".join(lines))
            lines = []
    return docs + (["\n".join(lines)] if lines else [])


def baseline(files: list[Path], tokenizer: Path, out: Path) -> int:
    """The hand loop: paragraphs → encode_batch → ids + EOS → one uint16 file; returns tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    eos = tok.token_to_id("<|endoftext|>")
    chunks = []
    for f in files:
        docs = paragraphs(f.read_text(encoding="utf-8-sig"))  # a byte-order mark is no text (hpcx drops it too)
        for i in range(0, len(docs), 512):
            for enc in tok.encode_batch(docs[i:i + 512], add_special_tokens=False):
                chunks.append(np.array(enc.ids + [eos], dtype=np.uint16))
    tokens = np.concatenate(chunks)
    tokens.tofile(out)
    return len(tokens)


def cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def hpcx_prepare(inputs: Path, tokenizer: Path, out: Path, workers: int, group_bytes: int) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, tokens) of one `hpcx data prepare` in a fresh process (start-up included)."""
    cpu, start = cpu_seconds(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run([sys.executable, "-m", "hpc.cli", "data", "prepare", str(inputs), "--tokenizer", str(tokenizer),
                    "--out", str(out), "--workers", str(workers), "--group-bytes", str(group_bytes)],
                   check=True, cwd=REPO, capture_output=True)
    wall, cpu = time.perf_counter() - start, cpu_seconds(resource.RUSAGE_CHILDREN) - cpu
    return wall, cpu, json.loads((out / "manifest.json").read_text())["splits"]["train"]["tokens"]


def peak_rss_mb(inputs: Path, tokenizer: Path, out: Path) -> float:
    """Peak RSS of a 1-worker prepare, measured by a fresh child of its own (ru_maxrss is a maximum)."""
    code = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    cmd = [sys.executable, "-m", "hpc.cli", "data", "prepare", str(inputs), "--tokenizer", str(tokenizer),
           "--out", str(out), "--shard-tokens", str(1 << 20)]
    res = subprocess.run([sys.executable, "-c", code, *cmd], check=True, cwd=REPO, capture_output=True, text=True)
    return int(res.stdout.strip()) / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=24.0)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    from tests.tokens.corpus import train_tokenizer

    root = Path(tempfile.mkdtemp(prefix="hpcx-bench-prepare-"))
    try:
        files = make_corpus(root / "txt", args.mb)
        size = sum(f.stat().st_size for f in files)
        tokenizer = train_tokenizer(root / "tokenizer.json", files[:200], vocab=8192)
        times: dict[str, list[tuple[float, float]]] = {"baseline": [], "hpcx-1": [], "hpcx-2": []}
        tokens = 0
        for r in range(args.repeat):
            cpu, start = cpu_seconds(resource.RUSAGE_SELF), time.perf_counter()
            tokens = baseline(files, tokenizer, root / f"base-{r}.bin")
            times["baseline"].append((time.perf_counter() - start, cpu_seconds(resource.RUSAGE_SELF) - cpu))
            for w in (1, 2):
                wall, cpu, got = hpcx_prepare(root / "txt", tokenizer, root / f"out-{w}-{r}", w, size // 8 + 1)
                assert got == tokens, (got, tokens)
                times[f"hpcx-{w}"].append((wall, cpu))
        best = {k: (min(w for w, _ in v), min(c for _, c in v)) for k, v in times.items()}
        double = root / "double"  # the corpus twice: the same largest document, twice the text
        double.mkdir()
        for f in files:
            shutil.copy(f, double / f.name)
            shutil.copy(f, double / f"copy-{f.name}")
        rss_full = peak_rss_mb(root / "txt", tokenizer, root / "rss-full")
        rss_double = peak_rss_mb(double, tokenizer, root / "rss-double")
        report(size, tokens, best, rss_full, rss_double)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report(size: int, tokens: int, best: dict[str, tuple[float, float]], rss_full: float, rss_double: float) -> None:
    print(f"corpus: {size / 1e6:.1f} MB of standard-library source, {tokens:,} tokens, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    base_wall, base_cpu = best["baseline"]
    for name, (wall, cpu) in best.items():
        print(f"{name:>9}: {wall:6.2f} s wall ({tokens / wall / 1e6:5.2f} M tokens/s, {base_wall / wall:4.2f}× the "
              f"baseline's throughput), {cpu:6.2f} s CPU ({base_cpu / cpu:4.2f}×)")
    print(f"speed-up of 2 workers over 1 (wall): {best['hpcx-1'][0] / best['hpcx-2'][0]:.2f}×")
    print(f"peak RSS (1 worker, 1M-token shards = 2 MB): {rss_full:.0f} MB on the corpus, {rss_double:.0f} MB on "
          "twice the corpus")


if __name__ == "__main__":
    main()

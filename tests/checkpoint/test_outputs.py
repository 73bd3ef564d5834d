"""Outputs of ``hpcx ckpt convert``: nothing left behind on any error path, stale partials of dead
processes swept, a destination refused before the source is read, inputs that are no checkpoint
at all named as such, and no progress output before an error line."""

from __future__ import annotations

import os
import pickle
import pty
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import malformed as mf  # noqa: E402
from ckpt_helpers import assert_refused, cli  # noqa: E402

from hpc.ckpt.convert import convert_checkpoint  # noqa: E402
from hpc.ckpt.outputs import stale_partials  # noqa: E402
from hpc.core.errors import CheckpointError  # noqa: E402

HERE = Path(__file__).resolve().parent
TARGETS = [("dcp", "out.dcp"), ("safetensors", "out.safetensors"), ("safetensors", "out-folder"), ("torch", "out.pt")]


def five_tensors(tmp_path: Path, name: str = "src") -> Path:
    g = torch.Generator().manual_seed(0)
    return mf.dcp_save(tmp_path / name, {"model": {f"l{i}": torch.randn(64, 64, generator=g) for i in range(5)}})


def leftovers(folder: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


@pytest.mark.parametrize("to,dst", TARGETS)
@pytest.mark.parametrize("damage", ["end-record", "central-entry", "local-header", "pickle"])
def test_a_source_torn_after_writing_began_leaves_nothing(tmp_path: Path, to: str, dst: str, damage: str) -> None:
    src = five_tensors(tmp_path)
    file, offset, length = mf.item_bytes(src, "model.l4")  # the last tensor: the others are written first
    mf.damage_item(file, offset, length, damage)
    args = ["convert", src, tmp_path / dst, "--to", to] + (["--shard-size", "20KB"] if dst == "out-folder" else [])
    assert_refused(tuple(args), "item 'model.l4' at byte")
    assert leftovers(tmp_path, {"src"}) == []


@pytest.mark.parametrize("to,dst", TARGETS)
def test_interrupted_conversion_leaves_nothing(tmp_path: Path, to: str, dst: str) -> None:
    src = five_tensors(tmp_path)

    def start(total: int):
        calls = []

        def progress(n: int) -> None:
            calls.append(n)
            if len(calls) == 2:
                raise KeyboardInterrupt

        return progress

    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(src, tmp_path / dst, to, shard_bytes=20_000 if dst == "out-folder" else 2**30, start=start)
    assert leftovers(tmp_path, {"src"}) == []


WRITE_LIMITED = r"""
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))
from hpc.cli.ckpt import ckpt_group
ckpt_group(sys.argv[2:], prog_name="hpcx ckpt")
"""


@pytest.mark.parametrize("to,dst", TARGETS)
def test_a_write_that_fails_midway_is_one_line_and_leaves_nothing(tmp_path: Path, to: str, dst: str) -> None:
    src = five_tensors(tmp_path)  # 5 x 16 KiB tensors; each file may grow to 40 KB only
    extra = ["--shard-size", "20KB"] if dst == "out-folder" else []
    limit = "10000" if dst == "out-folder" else "40000"  # a folder's shards are 20 KB each
    p = subprocess.run([sys.executable, "-c", WRITE_LIMITED, limit, "convert", str(src), str(tmp_path / dst),
                        "--to", to, *extra], capture_output=True, text=True, timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert "cannot write (File too large)" in lines[0] and dst in lines[0]
    assert leftovers(tmp_path, {"src"}) == []


SLOW = r"""
import sys, time
from hpc.ckpt import dcp
read_into = dcp.DcpReader.read_into
calls = []
def slow(self, key, out):  # the first tensor is read; the second waits for the test's SIGTERM, however late
    calls.append(key)
    if len(calls) > 1:
        time.sleep(3600)
    read_into(self, key, out)
dcp.DcpReader.read_into = slow
from hpc.cli.ckpt import ckpt_group
ckpt_group(sys.argv[1:], prog_name="hpcx ckpt")
"""


@pytest.mark.parametrize("to,dst", [("dcp", "out.dcp"), ("torch", "out.pt")])
def test_sigterm_during_a_conversion_leaves_nothing(tmp_path: Path, to: str, dst: str) -> None:
    src = five_tensors(tmp_path)
    p = subprocess.Popen([sys.executable, "-c", SLOW, "convert", str(src), str(tmp_path / dst), "--to", to],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300  # a hang guard: the start may be slow, the conversion waits
    while not [q for q in tmp_path.iterdir() if ".partial-" in q.name]:
        assert p.poll() is None and time.monotonic() < deadline, "no partial output appeared"
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 128 + signal.SIGTERM
    assert leftovers(tmp_path, {"src"}) == []


# A signal that lands while torch's C++ zip writer (or reader) is inside one of its calls back
# into Python: the handler must not raise across torch's C frames (that aborts the process, and
# the partial stays); it is held until torch returns, then stops the conversion as ever.
IN_CALLBACK = r"""
import io, os, signal, sys
from hpc.ckpt import torch_write
calls, when, sig = [], int(sys.argv[1]), getattr(signal, sys.argv[2])
def spin():  # bytecodes for a pending handler to run on
    x = 0
    for i in range(2000):
        x += i
def landing():
    calls.append(1)
    if len(calls) == when:
        os.kill(os.getpid(), sig)
        spin()
write = torch_write.Sink.write
def write_then_signal(self, data):
    landing()
    return write(self, data)
torch_write.Sink.write = write_then_signal
if sys.argv[3] == "read":  # torch.load of a stored object reads through BytesIO.readinto/read
    class Landing(io.BytesIO):
        def read(self, *a):
            landing()
            return super().read(*a)
        def readinto(self, b):
            landing()
            return super().readinto(b)
    from hpc.ckpt import dcp
    load_object = dcp.load_object
    dcp.load_object = lambda f, where: load_object(Landing(f.read()), where)
from hpc.cli.ckpt import ckpt_group
ckpt_group(sys.argv[4:], prog_name="hpcx ckpt")
"""


def with_objects(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    state = {"model": {f"l{i}": torch.randn(32, 32, generator=g) for i in range(3)},
             "step": 7, "extra": {"names": ["a", "b"], "lr": 0.5}, "rng": torch.arange(4)}
    return mf.dcp_save(tmp_path / "src", state)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("to,dst,hook,when", [
    ("torch", "out.pt", "write", 1), ("torch", "out.pt", "write", 2), ("torch", "out.pt", "write", 3),
    ("torch", "out.pt", "write", 5), ("torch", "out.pt", "write", 9), ("torch", "out.pt", "write", 14),
    ("dcp", "out.dcp", "write", 2), ("dcp", "out.dcp", "write", 4), ("dcp", "out.dcp", "write", 7),
    ("dcp", "out.dcp", "write", 12), ("dcp", "out.dcp", "write", 20), ("dcp", "out.dcp", "write", 30),
    ("torch", "out.pt", "read", 1), ("torch", "out.pt", "read", 3), ("dcp", "out.dcp", "read", 2),
    ("dcp", "out.dcp", "read", 6), ("dcp", "out.dcp", "read", 9),
])
def test_a_signal_inside_torchs_zip_callbacks_stops_cleanly(tmp_path: Path, sig: str, to: str, dst: str,
                                                            hook: str, when: int) -> None:
    src = with_objects(tmp_path)
    args = [sys.executable, "-c", IN_CALLBACK, str(when), sig, hook, "convert", str(src), str(tmp_path / dst),
            "--to", to]
    p = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert p.returncode >= 0, f"killed by signal {-p.returncode}: {p.stderr[-2000:]}"
    if p.returncode == 0:  # the signal landed after the last callback: the output is whole
        assert leftovers(tmp_path, {"src"}) == [dst]
        pytest.fail(f"call {when} is past the conversion's last callback; the case tests nothing")
    assert p.returncode == (128 + signal.SIGTERM if sig == "SIGTERM" else 1), p.stderr  # click: Aborted!, 1
    assert "Traceback" not in p.stderr
    assert leftovers(tmp_path, {"src"}) == []


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_partials_of_dead_processes_here_are_swept(tmp_path: Path) -> None:
    src = five_tensors(tmp_path)
    out, host, dead = tmp_path / "out", socket.gethostname(), dead_pid()
    stale = [f".old.pt.partial-{host}-{dead}", f".old.dcp.partial-{host}-{dead}", f".legacy.pt.partial-{dead}"]
    kept = [f".other.pt.partial-elsewhere-{dead}", f".live.pt.partial-{host}-{os.getpid()}", ".hidden",
            f"x.partial-{host}-{dead}"]
    out.mkdir()
    for name in stale + kept:
        (out / name).write_bytes(b"x")
    (out / stale[1]).unlink()
    (out / stale[1]).mkdir()
    (out / stale[1] / "__0_0.distcp").write_bytes(b"half")
    assert sorted(p.name for p in stale_partials(out)) == sorted(stale)
    assert cli("convert", src, out / "new.pt", "--to", "torch")[0] == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(kept + ["new.pt"])


def test_a_partial_left_by_a_killed_conversion_is_swept_by_the_next(tmp_path: Path) -> None:
    src = five_tensors(tmp_path)
    p = subprocess.Popen([sys.executable, "-c", SLOW, "convert", str(src), str(tmp_path / "a.dcp"), "--to", "dcp"])
    deadline = time.monotonic() + 300  # a hang guard: the start may be slow, the conversion waits
    while not [q for q in tmp_path.iterdir() if ".partial-" in q.name]:
        assert p.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    p.kill()
    p.wait()
    assert [q.name for q in tmp_path.iterdir() if ".partial-" in q.name]  # SIGKILL leaves it behind
    assert cli("convert", src, tmp_path / "b.dcp", "--to", "dcp")[0] == 0
    assert leftovers(tmp_path, {"src"}) == ["b.dcp"]


@pytest.mark.parametrize("to", ["torch", "dcp", "safetensors"])
@pytest.mark.parametrize("existing", ["file", "folder", "dangling-symlink"])
def test_destination_is_refused_before_the_source_is_read(tmp_path: Path, to: str, existing: str) -> None:
    marker = tmp_path / "pwned"
    src = tmp_path / "src"
    src.mkdir()
    (src / ".metadata").write_bytes(pickle.dumps(mf.Planted(marker)))  # refused, if it were ever read
    dst = tmp_path / "dst"
    if existing == "file":
        dst.write_bytes(b"keep me")
    elif existing == "folder":
        dst.mkdir()
    else:
        dst.symlink_to(tmp_path / "nowhere")
    out = assert_refused(("convert", src, dst, "--to", to), "already exists")
    assert len(out.strip().splitlines()) == 1 and ".metadata" not in out and not marker.exists()
    if existing == "file":
        assert dst.read_bytes() == b"keep me"


@pytest.mark.parametrize("to,dst", TARGETS)
def test_the_folders_above_the_destination_are_made(tmp_path: Path, to: str, dst: str) -> None:
    src = five_tensors(tmp_path)
    out = tmp_path / "new" / "deeper" / dst
    assert cli("convert", src, out, "--to", to)[0] == 0
    assert out.exists() and leftovers(out.parent, {dst}) == []


def test_a_failed_conversion_removes_the_folders_it_made(tmp_path: Path) -> None:
    src = five_tensors(tmp_path)
    file, offset, length = mf.item_bytes(src, "model.l4")
    mf.damage_item(file, offset, length, "pickle")
    assert_refused(("convert", src, tmp_path / "new" / "deeper" / "out.pt", "--to", "torch"), "item 'model.l4'")
    assert leftovers(tmp_path, {"src"}) == []


def test_a_file_above_the_destination_is_refused(tmp_path: Path) -> None:
    src = five_tensors(tmp_path)
    (tmp_path / "plain").write_bytes(b"keep me")
    assert_refused(("convert", src, tmp_path / "plain" / "sub" / "out.pt", "--to", "torch"), "not a folder")
    assert (tmp_path / "plain").read_bytes() == b"keep me"


def test_destination_inside_the_source_folder_is_refused(tmp_path: Path) -> None:
    src = five_tensors(tmp_path)
    assert_refused(("convert", src, src / "inside.pt", "--to", "torch"), "inside the source")
    assert sorted(p.name for p in src.iterdir()) == [".metadata", "__0_0.distcp"]


@pytest.mark.parametrize("name,data,expect", [
    ("empty.pt", b"", "empty file (0 bytes); not a checkpoint"),
    ("empty", b"", "empty file (0 bytes)"),
    ("empty.bin", b"", "empty file (0 bytes)"),
    ("empty.safetensors", b"", "empty file (0 bytes)"),
    ("three.pt", b"abc", "not a checkpoint"),
    ("text.pt", b"hello, this is not a model\n" * 10, "not a checkpoint"),
    ("zeros.bin", b"\0" * 100, "not a checkpoint"),
    ("truncated-zip.pt", b"PK\x03\x04" + b"\0" * 60, "not a complete torch.save zip"),
    ("legacy-garbage.pt", b"\x80\x02\x8a\x0a" + b"\0" * 20, "weights-only unpickler: Unsupported operand 0"),
])
def test_files_that_are_no_checkpoint_are_named_as_such(tmp_path: Path, name: str, data: bytes, expect: str) -> None:
    src = tmp_path / name
    src.write_bytes(data)
    assert_refused(("inspect", src), name, expect)
    assert_refused(("convert", src, tmp_path / "o.safetensors", "--to", "safetensors"), expect)
    assert_refused(("verify", src, src), expect)
    assert "not a safetensors" not in cli("inspect", src)[1] or name.endswith(".safetensors")


def test_a_missing_path_is_named(tmp_path: Path) -> None:
    assert_refused(("inspect", tmp_path / "nowhere"), "nowhere: no such file or folder")
    assert_refused(("verify", five_tensors(tmp_path), tmp_path / "nowhere"), "no such file or folder")


def run_in_pty(args: list[str]) -> tuple[int, str]:
    """Run ``hpcx ckpt ARGS`` with stderr on a terminal: (exit code, what the terminal received)."""
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "hpc.cli", "ckpt", *args], stdout=slave, stderr=slave,
                         stdin=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "100"})
    os.close(slave)
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], 60)
        try:
            chunk = os.read(master, 65536) if ready else b""
        except OSError:
            chunk = b""
        if not chunk:
            break
        out += chunk
    os.close(master)
    return p.wait(60), out.decode(errors="replace")


def test_no_progress_is_left_on_the_error_line_of_a_terminal(tmp_path: Path) -> None:
    src = five_tensors(tmp_path)
    code, screen = run_in_pty(["convert", str(src), str(tmp_path / "ok.pt"), "--to", "torch"])
    assert code == 0 and "torch" in screen and "%" in screen  # the bar is drawn on a terminal
    file, offset, length = mf.item_bytes(src, "model.l4")
    mf.damage_item(file, offset, length, "end-record")
    code, screen = run_in_pty(["convert", str(src), str(tmp_path / "bad.pt"), "--to", "torch"])
    last = screen.replace("\r\n", "\n").rstrip("\n").split("\n")[-1]
    visible = last.split("\r")[-1].split("\x1b[K")[-1]
    assert code == 2 and visible.startswith("error: ") and "model.l4" in visible, repr(screen)
    code, screen = run_in_pty(["inspect", str(src)])  # refused before any progress could start
    assert code == 2 and screen.lstrip().startswith("error: ") and "%" not in screen, repr(screen)


def test_the_api_refuses_an_existing_destination_without_opening_the_source(tmp_path: Path) -> None:
    (tmp_path / "dst.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="already exists"):
        convert_checkpoint(tmp_path / "no-such-source", tmp_path / "dst.pt", "torch")

"""The run folder: the single source of truth for one run. ``RunDir`` owns its file names.

Layout::

    RUN/spec.toml        copy of the submitted spec (overrides in resolved.json)
    RUN/resolved.json    spec + site + launch, read by every rank
    RUN/render.txt       what was submitted (the sbatch script, or the local parameters)
    RUN/job.json         scheduler, job id, submission time
    RUN/states.jsonl     scheduler states as hpcx observed them
    RUN/submitit/        submitit's pickles and per-task stdout/stderr
    RUN/logs/rank-N.log  the trainer's log per rank
    RUN/world.json       rank 0: who took part (hosts by rank) and the all-reduce check
    RUN/mesh.json        rank 0: the rank groups of each device-mesh dimension
    RUN/metrics.jsonl    rank 0's per-step metrics (and eval lines: eval_loss, eval_perplexity; the straggler
                         report's per-interval lines: kind = "ranks", trainer.straggler)
    RUN/data.json        rank 0: the data it trained on (manifest and tokenizer, with their SHA-256)
    RUN/ledger.jsonl     one line per start and stop of the job (goodput)
    RUN/requeue/         per incarnation: the one requeue's claim, and the ranks' failure reports
    RUN/nccl-trace/      NCCL flight-recorder dumps of a collective that timed out (GPU sites)
    RUN/checkpoints/step-NNNNNNN/

Every whole-file write goes through ``write_atomic`` (temp file, fsync, rename).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import time
import typing as tp
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hpc.core.config import JSON_SYNTAX, ConfigError, load_json_bounded, nesting_error
from hpc.core.validate import MAX_DEPTH

SUBMITIT_DIR = "submitit"  # under the run folder: submitit's pickles and per-task stdout/stderr


def modes(group_readable: bool) -> tuple[int, int, int]:
    """(umask, dir mode, file mode) for run folders."""
    return (0o027, 0o750, 0o640) if group_readable else (0o077, 0o700, 0o600)


@contextmanager
def private_umask(group_readable: bool) -> tp.Iterator[None]:
    """Create files 0600 (or 0640); the job inherits the umask from sbatch."""
    old = os.umask(modes(group_readable)[0])
    try:
        yield
    finally:
        os.umask(old)


def run_dir_name(job_name: str, stamp: str, token: str) -> str:
    """``NAME-YYYYmmdd-HHMMSS-TOKEN`` with the job name reduced to file-name-safe characters."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in job_name)[:60].lstrip(".") or "run"
    return f"{safe}-{stamp}-{token}"


def new_run_dir(root: Path, name: str, group_readable: bool) -> Path:
    """A fresh, never reused run folder under ``root``."""
    import secrets  # lazy: startup (`hpcx status` imports this module and never makes a folder)

    run = root / run_dir_name(name, time.strftime("%Y%m%d-%H%M%S"), secrets.token_hex(3))
    dir_mode = modes(group_readable)[1]
    try:
        root.mkdir(parents=True, exist_ok=True)
        run.mkdir(mode=dir_mode)
    except OSError as exc:
        raise ConfigError([f"run root {root}: cannot create a run folder: {exc.strerror}"]) from None
    try:
        os.chmod(run, dir_mode)
        for sub in RunDir.FOLDERS:
            (run / sub).mkdir(mode=dir_mode)
    except OSError as exc:  # out of inodes or quota: leave no half-made run
        shutil.rmtree(run, ignore_errors=True)
        raise ConfigError([f"run root {root}: cannot create a run folder: {exc.strerror}"]) from None
    return run


def write_atomic(path: Path, data: str | bytes, mode: int = 0o666) -> None:
    """Write a whole file or nothing: temp file, fsync, rename; the temp file is removed on failure.
    The umask (``private_umask``, inherited by the job) turns the default mode into 0600, or 0640
    on group-readable sites."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: Path, obj: tp.Any, mode: int = 0o666) -> None:
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n", mode)


def append_jsonl(path: Path, obj: tp.Any) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(obj, sort_keys=True) + "\n")


def read_json(path: Path) -> dict:
    """A run-folder JSON file ({} when absent); a torn or hostile one is a one-line ConfigError.

    Parsed first as it is (the C parser stops at its recursion limit with an error, never a crash), then
    its depth checked on the result: ten times cheaper than ``load_json_bounded``'s scan, which only
    runs to word the error (`hpcx status` reads a resolved.json per run listed)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return {}
    try:
        value = json.loads(text)
        if not deeper_than(value, MAX_DEPTH):
            return value
    except (ValueError, RecursionError):
        pass
    return load_json_bounded(text, str(path))


def deeper_than(value: tp.Any, limit: int) -> bool:
    """Whether parsed JSON nests lists and objects more than ``limit`` deep (iteratively)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            stack += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return False


def torn_json(path: Path) -> bool:
    """Whether a JSON file looks cut short (a writer killed mid-write, or one that wrote in place): empty,
    NULs only, or valid JSON up to where it stops. A file that says something else (nested too deep,
    extra data, not JSON) is not torn: it is reported."""
    try:
        body = path.read_text(encoding="utf-8", errors="replace").strip(" \t\r\n\0")
    except OSError:
        return False
    if not body:
        return True
    if nesting_error(body, JSON_SYNTAX, MAX_DEPTH):
        return False
    try:
        json.loads(body)
    except json.JSONDecodeError as exc:
        return exc.pos >= len(body) or exc.msg.startswith("Unterminated string")
    except (RecursionError, ValueError):
        return False
    return False


def tail_bytes(path: Path, chunk: int) -> tuple[int, bytes] | None:
    """(file size, its last ``chunk`` bytes); None when absent."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - chunk))
            return size, f.read()
    except FileNotFoundError:
        return None


def tail_lines(path: Path, chunk: int, tail: tuple[int, bytes] | None = None) -> tuple[int, list[bytes]] | None:
    """(file size, the complete lines among its last ``chunk`` bytes, newest first); None when absent.
    A line cut by the chunk's start is left out. ``tail``: those bytes, already read (``tail_bytes``)."""
    tail = tail or tail_bytes(path, chunk)
    if tail is None:
        return None
    size, data = tail
    lines = data.splitlines()
    return size, list(reversed(lines[1:] if size > chunk else lines))


def read_last_jsonl(path: Path, chunk: int = 8192) -> dict | None:
    """The last complete JSON line of a file, read from its end (metrics files grow to many MB)."""
    tail = tail_lines(path, chunk)
    if tail is None:
        return None
    size, lines = tail
    for line in lines:
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    if size <= chunk:
        return None
    whole = read_jsonl(path)  # no complete line in the last chunk: one huge line, read it all
    return whole[-1] if whole else None


def read_last_jsonl_with(path: Path, key: str, chunk: int = 1 << 16) -> dict | None:
    """The last complete JSON line holding ``key`` among the last ``chunk`` bytes (eval lines are
    sparse among the metrics lines: ``status`` reads no more than 64 KiB, some 200 lines, for them)."""
    raw = tail_bytes(path, chunk)
    needle = json.dumps(key).encode()
    if raw is None or needle not in raw[1]:  # the usual case for eval lines: no line to look at
        return None
    for line in (tail_lines(path, chunk, raw) or (0, []))[1]:
        if needle not in line:  # most lines are not the ones sought: no JSON parse for them
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and key in record:
            return record
    return None


def read_jsonl(path: Path) -> list[dict]:
    """Every complete JSON line; a torn last line (a writer killed mid-line) is skipped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except (json.JSONDecodeError, RecursionError):  # a torn line, or one nested past the parser
            continue
    return out


@dataclass(frozen=True)
class RunDir:
    """One run folder and the names of its files; the one place those names are spelled."""

    path: Path

    SPEC: tp.ClassVar[str] = "spec.toml"
    RESOLVED: tp.ClassVar[str] = "resolved.json"
    RENDER: tp.ClassVar[str] = "render.txt"
    JOB: tp.ClassVar[str] = "job.json"
    STATES: tp.ClassVar[str] = "states.jsonl"
    METRICS: tp.ClassVar[str] = "metrics.jsonl"
    DATA: tp.ClassVar[str] = "data.json"
    LEDGER: tp.ClassVar[str] = "ledger.jsonl"
    WORLD: tp.ClassVar[str] = "world.json"
    MESH: tp.ClassVar[str] = "mesh.json"
    LOGS: tp.ClassVar[str] = "logs"
    REQUEUE: tp.ClassVar[str] = "requeue"
    NCCL_TRACE: tp.ClassVar[str] = "nccl-trace"
    CHECKPOINTS: tp.ClassVar[str] = "checkpoints"
    SUBMITIT: tp.ClassVar[str] = SUBMITIT_DIR
    FOLDERS: tp.ClassVar[tuple[str, ...]] = (LOGS, CHECKPOINTS, SUBMITIT)

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def __fspath__(self) -> str:
        return str(self.path)

    @property
    def name(self) -> str:
        return self.path.name

    spec = property(lambda self: self.path / self.SPEC)
    resolved = property(lambda self: self.path / self.RESOLVED)
    render = property(lambda self: self.path / self.RENDER)
    job = property(lambda self: self.path / self.JOB)
    states = property(lambda self: self.path / self.STATES)
    metrics = property(lambda self: self.path / self.METRICS)
    data = property(lambda self: self.path / self.DATA)
    ledger = property(lambda self: self.path / self.LEDGER)
    world = property(lambda self: self.path / self.WORLD)
    mesh = property(lambda self: self.path / self.MESH)
    logs = property(lambda self: self.path / self.LOGS)
    requeue = property(lambda self: self.path / self.REQUEUE)
    nccl_trace = property(lambda self: self.path / self.NCCL_TRACE)
    checkpoints = property(lambda self: self.path / self.CHECKPOINTS)
    submitit = property(lambda self: self.path / self.SUBMITIT)

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.log"

    def read_job(self) -> dict:
        return read_json(self.job)

    def read_resolved(self) -> dict:
        return read_json(self.resolved)

    def read_states(self) -> list[dict]:
        return read_jsonl(self.states)

    def read_metrics(self) -> list[dict]:
        return read_jsonl(self.metrics)

    def read_ledger(self) -> list[dict]:
        return read_jsonl(self.ledger)

    def last_metrics(self) -> dict | None:
        """The newest metrics line, without reading the whole file."""
        return read_last_jsonl(self.metrics)

    def last_eval(self) -> dict | None:
        """The newest eval line of the metrics (``eval_loss``, ``eval_perplexity``)."""
        return read_last_jsonl_with(self.metrics, "eval_loss")

    def last_train_metrics(self) -> dict | None:
        """The newest training line of the metrics (an eval line may come after it)."""
        last = self.last_metrics()
        return last if last is None or "loss" in last else read_last_jsonl_with(self.metrics, "loss")

    def exists(self) -> bool:
        return self.resolved.is_file()


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` holds a ``resolved.json`` (False, never an error, when it cannot be looked into)."""
    try:
        return RunDir(path).exists()
    except OSError:
        return False


def owner_of(path: Path) -> int | None:
    """The uid that owns ``path``; None when it cannot be looked at."""
    try:
        return path.stat().st_uid
    except OSError:
        return None


def is_mine(path: Path) -> bool:
    """Whether the caller owns ``path``. A run root may be shared by many users (a project's scratch
    folder): names and job ids resolve only to the caller's own runs, and the list shows only those."""
    return owner_of(path) == os.getuid()


def find_run(ref: str, roots: tp.Sequence[Path]) -> Path:
    """A run folder from a path, a folder name under a run root, or a job id; by name or job id only the
    caller's own runs (another user's of the same name is refused, saying whose it is)."""
    path = Path(ref).expanduser()
    if is_run_dir(path):
        return path.resolve()
    others = []
    for root in roots:
        if is_mine(root / ref):
            if is_run_dir(root / ref):
                return (root / ref).resolve()
        elif owner_of(root / ref) is not None and (root / ref).is_dir():  # another user's (maybe unreadable)
            others.append(root / ref)
    if ref.isdigit():
        for run in list_runs(roots):
            if str(_job_id(run)) == ref:
                return run
    where = ", ".join(str(r) for r in roots)
    if others:
        raise ConfigError([f"{ref}: {others[0]} belongs to {user_name(owner_of(others[0]))}, not to you: hpcx "
                           "finds only your own runs by name or job id (give the folder's path to read it)"])
    raise ConfigError([f"{ref}: not a run folder, run name or job id (looked in {where})"])


def _job_id(run: Path) -> tp.Any:
    try:
        return RunDir(run).read_job().get("job_id")
    except (ConfigError, OSError):
        return None


def user_name(uid: int | None) -> str:
    """``user alice (uid 1001)``, or the uid alone when the system does not know the name."""
    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})" if uid is not None else "another user"
    except KeyError:
        return f"uid {uid}"


def list_runs(roots: tp.Sequence[Path]) -> list[Path]:
    """The caller's run folders under the roots, newest first. Other users' folders are skipped (by
    owner, before anything is read), and so is anything that cannot be read: never an error."""
    found: list[tuple[float, Path]] = []
    for root in roots:
        try:
            entries = list(os.scandir(root))
        except OSError:
            continue
        uid = os.getuid()
        for entry in entries:
            try:
                st = entry.stat()
                mine = st.st_uid == uid and entry.is_dir()
            except OSError:
                continue
            if mine and is_run_dir(Path(entry.path)):
                found.append((st.st_mtime, Path(entry.path)))
    return [p for _, p in sorted(found, key=lambda t: t[0], reverse=True)]

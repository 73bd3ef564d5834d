"""What a start's failure was, judged from the run folder alone: would it repeat, who died, how many saves.

Three questions the stop line of a failed start must answer without asking a process that is gone:

- **Would it fail again?** A failure before the first step of a start, outside joining the job, whose
  exception class says it comes from the code or the inputs (an import error, a config error found in
  the job, a user model without ``reset_parameters``, a type error in the first forward) repeats on every
  restart: it is never requeued (``would_repeat``). A connection error, a timeout, an out-of-memory or
  a node failure may not repeat, and joining the job (the rendezvous) never counts as deterministic.
  A start whose code did not load (``loading_failure``: submitit unpickling the task, an import,
  ``python -m trainer.entry`` itself) repeats too; no rank could report it, so it is told from what task
  0 wrote to stderr.
- **Which rank failed on its own, and which only lost a peer?** A rank whose collective failed because
  another rank vanished reports "Connection reset by peer" and the like (``is_echo``); that is not the
  failure, only its echo.
- **How many checkpoints did this start commit?** Rank 0 keeps ``RUN/requeue/<incarnation>.saves.json``
  up to date after each save (``record_saves``); ``saves_of`` reads it back and counts only saves whose
  folder is committed (a newer committed step means an older one was committed and rotated away).

Torch-free: exceptions are judged by the names of their classes, so torch's need not be imported.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import sysconfig
import traceback
import typing as tp
from pathlib import Path

from hpc.core import runs

# Where a rank can be when it fails (``trainer.train.run_rank`` sets them in order).
PHASES = ("load", "join", "build", "resume", "train")
# Failing here before the first step repeats: the code and the inputs are the same on every restart.
REPEATING_PHASES = ("load", "build", "resume", "train")
# Exception classes (or their bases, by name) that come from the code or the inputs.
REPEATING = ("ImportError", "SyntaxError", "NameError", "AttributeError", "TypeError", "ValueError", "LookupError",
             "NotImplementedError", "AssertionError", "ArithmeticError", "RecursionError", "UnicodeError",
             "FileNotFoundError", "IsADirectoryError", "NotADirectoryError", "PermissionError", "UserError")
# ... unless a base says the machine or the network is to blame (checked first).
TRANSIENT = ("ConnectionError", "TimeoutError", "MemoryError", "OutOfMemoryError", "DistError", "DistNetworkError",
             "DistStoreError", "DistBackendError", "BrokenPipeError", "InterruptedError", "ChildProcessError")
# What a rank says when a peer vanished under a collective (gloo, NCCL, the TCP store).
ECHO = re.compile(r"connection (reset|closed)|reset by peer|closed by peer|broken pipe|"
                  r"ncclRemoteError|remote process exited|socket timeout|Timed out waiting|"
                  r"communicator was aborted|ProcessGroupNCCL.*(abort|timeout)|recvBytes|sendBytes", re.I)


def class_names(exc: BaseException) -> list[str]:
    """The names of the exception's class and of every base, most specific first."""
    return [c.__name__ for c in type(exc).__mro__]


def would_repeat(exc: BaseException, phase: str, steps_done: int) -> bool:
    """True when a restart would fail the same way: before this start's first step, in a phase other
    than joining the job, with an exception class from the code or the inputs (``REPEATING``) and none
    that blames the machine or the network (``TRANSIENT``)."""
    names = class_names(exc)
    if any(n in ALWAYS_REPEATING for n in names) and not looks_like_infrastructure(exc):
        return True  # hpcx's own check of the job's code or inputs (a task's loss without grad): at any step
    if steps_done > 0 or phase not in REPEATING_PHASES:
        return False
    if any(n in TRANSIENT for n in names):
        return False
    return any(n in REPEATING for n in names) and not is_echo(str(exc))


# What a failure of the machine or the network says, whatever its class (a RuntimeError from NCCL, gloo,
# the c10d store or the CUDA driver): never blamed on the job's code, even when raised under it.
INFRA = re.compile(r"nccl|gloo|c10d|ProcessGroup|TCPStore|CUDA error|CUDA driver|CUDA-capable|cuDNN error|"
                   r"CUBLAS_STATUS|ECC error|NVML|Xid|unspecified launch failure|illegal memory access|"
                   r"uncorrectable|Input/output error|Stale file handle|No space left on device", re.I)
# Exceptions a scheduler's stop raises in the task (a cancel, the time limit's SIGINT), never the code's.
STOPS = ("KeyboardInterrupt", "SystemExit", "GeneratorExit")
# An exception of the job's own code (a user error) found by ``user_code_error``: repeats at any step.
ALWAYS_REPEATING = ("UserError", "TaskCodeError")
FRAME_TEXT = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


def looks_like_infrastructure(exc: BaseException) -> bool:
    """Whether an exception blames the machine or the network: its class (``TRANSIENT``) or its words
    (a peer gone: ``ECHO``; NCCL, gloo, the store, CUDA: ``INFRA``)."""
    text = str(exc)
    return (any(n in TRANSIENT for n in class_names(exc)) or is_echo(text) or bool(INFRA.search(text)))


def user_code_error(exc: BaseException, roots: tp.Sequence[str]) -> str | None:
    """``file:line in function`` of the job's own code where ``exc`` came from, when it is a user error:
    not a stop, not the machine's or the network's (``looks_like_infrastructure``), and raised while the
    job's code ran: the innermost frame of its traceback (or of the traceback a DataLoader worker wrote
    into its message) inside one of ``roots`` (the folders or files of the task's or the model's package).
    None otherwise: the failure may be the node's, and is requeued as one."""
    if any(n in STOPS for n in class_names(exc)) or looks_like_infrastructure(exc):
        return None
    frames = traceback_frames(exc)
    mine = [f for f in frames if in_roots(f[0], roots)]
    if not mine:
        return None
    file, line, func = mine[-1]
    return f"{file}:{line} in {func}"


def traceback_frames(exc: BaseException) -> list[tuple[str, int, str]]:
    """(file, line, function) of every frame of ``exc``'s traceback, outermost first, then those of a
    traceback printed in its message (a DataLoader worker's "Original Traceback")."""
    frames = [(f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(exc.__traceback__)]
    return frames + [(m["file"], int(m["line"]), m["func"]) for m in FRAME_TEXT.finditer(str(exc))]


def in_roots(file: str, roots: tp.Sequence[str]) -> bool:
    """Whether ``file`` is one of ``roots`` or inside one of them (a folder), and not hpcx's own code nor an
    installed package or a hidden folder below the root (a virtual environment in the submit folder)."""
    path = os.path.realpath(file)
    if any(path.startswith(own + os.sep) for own in HPCX_PACKAGES):
        return False
    for root in roots:
        if path == root:
            return True
        if path.startswith(root.rstrip(os.sep) + os.sep):
            below = path[len(root.rstrip(os.sep)) + 1:].split(os.sep)[:-1]
            if not any(p in ("site-packages", "dist-packages") or p.startswith(".") for p in below):
                return True
    return False


# hpcx's own packages: never the job's code, even when the job's folder holds them (a checkout)
HPCX_PACKAGES = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))), p)
                      for p in ("hpc", "trainer"))


def one_line(exc: BaseException, where: str | None = None) -> str:
    """``Class: first line of the message`` (at ``where``: the job's own code, when it is to blame)."""
    words = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {words[0] if words else ''}".rstrip(": ")
    return f"{text[:240]} (at {where})" if where else text


def code_roots(modules: tp.Sequence[str]) -> list[str]:
    """The folders of the job's own ``modules``, as imported in this process: where its code lives. A
    package's folder; a plain module's folder (the submit folder: its helpers beside it count too), or the
    file alone when it sits among installed packages or python's own."""
    installed = {os.path.realpath(p) for p in sysconfig.get_paths().values()}
    roots: list[str] = []
    for name in modules:
        top = sys.modules.get(name.split(".")[0])
        paths = list(getattr(top, "__path__", []) or [])
        if not paths and getattr(top, "__file__", None):
            file = os.path.realpath(str(getattr(top, "__file__")))
            paths = [file if os.path.dirname(file) in installed else os.path.dirname(file)]
        roots += [os.path.realpath(p) for p in paths if p]
    return roots


def first_failure_account(reports: tp.Sequence[dict], task_ends: tp.Sequence[dict]) -> dict[str, tp.Any]:
    """Where rank 0 writes the stop line (no check after srun): ``failed_ranks`` (the rank whose own failure
    was reported first; ranks that only lost a peer never count), ``reported_ranks`` and its ``error``.
    Without such a report, the ranks the scheduler says are gone without a word (killed: out of memory,
    SIGKILL) failed. ``reports`` in the order written (``hpc.core.requeue.failure_reports``)."""
    own = own_failures(reports)
    reported = sorted({r["rank"] for r in reports if "rank" in r})
    if own:
        first = own[0]
        return {"failed_ranks": [first.get("rank")], "reported_ranks": reported, "error": str(first.get("error"))}
    gone = sorted({r for e in task_ends for r in e.get("ranks", [])} - set(reported))
    if not gone:
        return {"failed_ranks": reported[:1], "reported_ranks": reported} if reported else {}
    lost = f"; {ranks_words(reported)} then lost the connection to it" if reported else ""
    return {"failed_ranks": gone, "reported_ranks": reported,
            "error": f"{ranks_words(gone)} ended without a Python error (killed: out of memory, SIGKILL){lost}"}


def repeat_reason(report: dict) -> str:
    """The ``not_requeued`` words for a failure that would repeat (``report``: a rank's failure report)."""
    error = str(report.get("error", "")).split(":", 1)[0] or "an error"
    if report.get("user_code"):
        return (f"{error} on rank {report.get('rank', '?')} in the job's own code at {report['user_code']}: it "
                "would fail the same way on a restart")
    if report.get("phase") == "train" and int(report.get("step") or 0) > 0:
        return (f"{error} on rank {report.get('rank', '?')} at step {report['step']}: the job's code or inputs "
                "are at fault; it would fail the same way on a restart")
    return (f"{error} on rank {report.get('rank', '?')} while {phase_words(report.get('phase', ''))}, before the "
            "first step: it would fail the same way on a restart")


def phase_words(phase: str) -> str:
    return {"load": "reading the run folder", "join": "joining the job", "build": "building the model",
            "resume": "resuming", "train": "running the first step"}.get(phase, phase or "starting")


def is_echo(error: str) -> bool:
    """True when a rank's error only says that a peer went away (the failure happened elsewhere)."""
    return bool(ECHO.search(error or ""))


def own_failures(reports: tp.Sequence[dict]) -> list[dict]:
    """The reports of ranks that failed on their own: not a peer's echo, not a SIGTERM's."""
    return [r for r in reports if not r.get("terminated") and not is_echo(str(r.get("error", "")))]


# ---------------------------------------------------------------- saves of one start, in the run folder


def saves_path(run_dir: Path, incarnation: str) -> Path:
    return runs.RunDir(run_dir).requeue / f"{incarnation}.saves.json"


def record_saves(run_dir: Path, incarnation: str, saves: int, save_s: float, last_step: int) -> None:
    """Rank 0, after each save of this start: how many so far, their time, the newest step."""
    folder = runs.RunDir(run_dir).requeue
    folder.mkdir(exist_ok=True)
    runs.write_json(saves_path(run_dir, incarnation), {"saves": saves, "save_s": round(save_s, 3),
                                                       "last_step": last_step})


def saves_of(run_dir: Path, incarnation: str) -> tuple[int, float]:
    """(saves committed by this start, seconds they took) from the run folder; (0, 0.0) when unknown.
    The newest save counts only when its folder is committed (an async save may have been in flight)."""
    try:
        record = runs.read_json(saves_path(run_dir, incarnation))
    except (runs.ConfigError, OSError):
        return 0, 0.0
    saves, last = record.get("saves"), record.get("last_step")
    if not isinstance(saves, int) or not isinstance(last, int):
        return 0, 0.0
    newest = newest_committed_step(run_dir)
    committed = saves if newest is not None and newest >= last else max(0, saves - 1)
    return committed, float(record.get("save_s") or 0.0)


def newest_committed_step(run_dir: Path) -> int | None:
    """The largest N of ``checkpoints/step-N`` holding ``.metadata`` (without trusting it further)."""
    folder = runs.RunDir(run_dir).checkpoints
    try:
        steps = [int(p.name[5:]) for p in folder.iterdir()
                 if p.name.startswith("step-") and p.name[5:].isdigit() and (p / ".metadata").is_file()]
    except OSError:
        return None
    return max(steps, default=None)


# ---------------------------------------------------------------- the account of a failed start (pure)


def failure_account(reports: tp.Sequence[dict], task_ends: tp.Sequence[dict], status: int) -> dict[str, tp.Any]:
    """The stop line's ``failed_ranks``, ``reported_ranks``, ``error`` (and ``signal``, ``exit_code``
    when srun said how those ranks ended) from the ranks' reports and srun's account of the tasks
    (``task_ends``: what ``JobSide.task_ends`` gives). Ranks that only lost a peer are never named.

    A rank that reported an error of its own failed, whoever srun saw end first (a rank that raised may
    take longer to exit than the peer whose collective broke: seen on the sandbox); among several, those
    srun names first. Without such a report, the ranks srun names first, less those that only reported a
    lost peer: a rank killed by a signal reports nothing."""
    first = [e for e in task_ends if e.get("first")]
    died = sorted({r for e in first for r in e.get("ranks", [])})
    own = sorted({r["rank"] for r in own_failures(reports) if "rank" in r})
    echoing = {r["rank"] for r in reports if "rank" in r and r["rank"] not in own}
    failed = ([r for r in died if r in own] or own) if own else ([r for r in died if r not in echoing] or died)
    out: dict[str, tp.Any] = {"failed_ranks": failed or sorted({r["rank"] for r in reports if "rank" in r}),
                              "reported_ranks": sorted({r["rank"] for r in reports if "rank" in r})}
    named = [e for e in first if set(e.get("ranks", [])) & set(failed)]
    for key in ("signal", "exit_code"):
        value = next((e[key] for e in named if key in e), None)
        if value is not None:
            out[key] = value
    out["error"] = failure_error(reports, named, failed, status)[:300]
    return out


def failure_error(reports: tp.Sequence[dict], named: tp.Sequence[dict], failed: list[int], status: int) -> str:
    """The one line that says what failed: a repeating start-up error first, then the earliest error of
    a failed rank, then srun's words for a failed rank ended by a signal, then any rank's error."""
    own = own_failures(reports)
    for candidates in ([r for r in reports if r.get("repeats")], [r for r in own if r.get("rank") in failed]):
        if candidates:
            return str(candidates[0].get("error") or "")
    if named:
        e = named[0]
        echoes = sorted({r["rank"] for r in reports if "rank" in r and r["rank"] not in failed
                         and is_echo(str(r.get("error", "")))})
        lost = f"; {ranks_words(echoes)} then lost their connection to it" if echoes else ""
        how = f"was killed by {e['signal']}" if "signal" in e else f"ended ({e.get('what', '')})"
        return f"{ranks_words(e.get('ranks', []))} on {e.get('host', '?')} {how} (srun: {e.get('what', '')}){lost}"
    if reports:
        return str(reports[0].get("error") or "")
    return srun_words(status)


def ranks_words(ranks: tp.Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def srun_words(status: int) -> str:
    """Why srun ended when no task said anything (srun itself killed, or a task that never started)."""
    if status > 128:
        try:
            name = signal.Signals(status - 128).name
        except ValueError:
            name = f"signal {status - 128}"
        return (f"srun ended with status {status} ({name}) and no rank reported a Python error: srun itself "
                "was killed, or a task was (out of memory, SIGKILL, the NCCL watchdog)")
    return (f"srun exited with status {status} and no rank reported a Python error: a task was killed "
            "(out of memory, SIGKILL, the NCCL watchdog) or could not start")


# ---------------------------------------------------------------- a start whose code did not load


# Raised while python loads code (an import, or submitit unpickling the job's task, which imports the
# task's module), these repeat on every restart: the same files are read again. AttributeError counts
# only while unpickling ("Can't get attribute 'X' on <module …>": the module lacks the pickled name).
# A torn pickle or an I/O error is not among them: that may be the file system's, once.
LOADING_ERRORS = ("ModuleNotFoundError", "ImportError", "SyntaxError", "IndentationError", "TabError")
TRACEBACK_HEAD = "Traceback (most recent call last):"
RANK_PREFIX = re.compile(r"^\[(rank|default)\d+\]:\s?")  # torch's prefix on a rank's stderr lines
EXCEPTION_LINE = re.compile(r"^(?P<cls>[A-Za-z_][\w.]*): (?P<msg>.*)$")
UNPICKLING_FRAME = re.compile(r'File ".*submitit[/\\]core[/\\]utils\.py", line \d+, in (load|pickle_load)$')
FILE_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)')
# ``python -m MODULE`` when MODULE cannot be found prints one line, no traceback.
MODULE_SPEC = re.compile(r"^(?P<python>\S+): Error while finding module specification for '(?P<target>[\w.]+)' "
                         r"\((?P<cls>\w+): (?P<msg>.*)\)$")
NO_MODULE = re.compile(r"^(?P<python>\S+): No module named (?P<target>[\w.]+)$")
# ``hpc.core.imports.main`` refusing a foreign ``hpc`` or ``trainer`` (another package's) prints one line.
REFUSED = re.compile(r"^hpcx: (?P<msg>`(?P<name>hpc|trainer)` .*)$")
# the first task's check inside a container image (``hpc.core.container.inside_problem``)
IMAGE_REFUSED = re.compile(r"^hpcx: (?P<msg>the container image (?P<image>\S+) has .*)$")
NAMED_MODULE = (re.compile(r"No module named '(?P<module>[\w.]+)'"),
                re.compile(r"cannot import name '[\w.]+' from '(?P<module>[\w.]+)'"),
                re.compile(r"on <module '(?P<module>[\w.]+)'"))


def loading_failure(text: str) -> dict[str, str] | None:
    """The error of a task whose code did not load, read from what it wrote to stderr in this start
    (``text``), when a restart would repeat it: ``error`` (the exception's line), ``module`` (the module
    or file it names) and ``where`` (what python was doing); None for any other failure, or none."""
    lines = [RANK_PREFIX.sub("", line.rstrip()) for line in text.splitlines()]
    found = [f for f in (_last_traceback(lines), _module_spec(lines), _refused(lines)) if f is not None]
    return max(found, key=lambda f: f[0])[1] if found else None  # the last failure the task wrote


def _last_traceback(lines: list[str]) -> tuple[int, dict[str, str] | None] | None:
    """(line index, the failure when it is a loading failure, else None) of the last traceback."""
    heads = [i for i, line in enumerate(lines) if line == TRACEBACK_HEAD]
    if not heads:
        return None
    frames = list(_frames(lines, heads[-1] + 1))
    end = heads[-1] + 1 + len(frames)
    match = EXCEPTION_LINE.match(lines[end]) if end < len(lines) else None
    if match is None:
        return heads[-1], None
    cls, msg = match.group("cls").rsplit(".", 1)[-1], match.group("msg")
    unpickling = any(UNPICKLING_FRAME.search(f) for f in frames)
    if cls not in LOADING_ERRORS and not (cls == "AttributeError" and unpickling):
        return end, None
    files = [m for m in (FILE_FRAME.match(f) for f in frames) if m]
    module = _named_module(msg)
    if cls in ("SyntaxError", "IndentationError", "TabError") and files:
        module = files[-1].group("file")
        msg = f"{msg} ({module}, line {files[-1].group('line')})"
    where = "unpickling the job's task" if unpickling else "importing the job's code"
    return end, {"error": f"{cls}: {msg}"[:300], "module": module, "where": where}


def _frames(lines: list[str], start: int) -> tp.Iterator[str]:
    """The indented lines of a traceback from ``start`` (its frames, their code, SyntaxError's caret)."""
    for line in lines[start:]:
        if not line.startswith((" ", "\t")):
            return
        yield line


def _module_spec(lines: list[str]) -> tuple[int, dict[str, str] | None] | None:
    """(line index, the failure) of python's own words for ``python -m MODULE`` it could not find."""
    for i in range(len(lines) - 1, -1, -1):
        spec, bare = MODULE_SPEC.match(lines[i]), NO_MODULE.match(lines[i])
        if spec and spec.group("cls") in LOADING_ERRORS:
            msg = spec.group("msg")
            return i, {"error": f"{spec.group('cls')}: {msg}"[:300], "module": _named_module(msg) or "",
                       "where": f"starting python -m {spec.group('target')}"}
        if bare:
            target = bare.group("target")
            return i, {"error": f"ModuleNotFoundError: No module named '{target}'", "module": target,
                       "where": f"starting python -m {target}"}
    return None


def _refused(lines: list[str]) -> tuple[int, dict[str, str]] | None:
    """(line index, the failure) of hpcx refusing a foreign ``hpc`` or ``trainer`` before loading any code."""
    for i in range(len(lines) - 1, -1, -1):
        match = REFUSED.match(lines[i])
        if match:
            return i, {"error": f"ImportError: {match.group('msg')}"[:300], "module": match.group("name"),
                       "where": "starting hpcx's own code"}
        match = IMAGE_REFUSED.match(lines[i])
        if match:
            return i, {"error": f"ImportError: {match.group('msg')}"[:300], "module": match.group("image"),
                       "where": "starting in the container image"}
    return None


def _named_module(msg: str) -> str:
    found = (p.search(msg) for p in NAMED_MODULE)
    return next((m.group("module") for m in found if m), "")


def loading_reason(found: dict[str, str]) -> str:
    """The ``not_requeued`` words for a start whose code did not load (``found``: ``loading_failure``)."""
    cls = found["error"].split(":", 1)[0]
    return f"{cls} while {found['where']}, before the trainer started: it would fail the same way on a restart"

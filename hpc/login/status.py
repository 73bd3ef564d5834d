"""`hpcx status`'s list: the run roots, the newest runs, their states and one line each.

The Click command (``hpc.cli``) and the console script's fast path (``hpc.entry``) both print it
from here. The fast path answers a bare ``hpcx status`` (or ``hpcx status --json``) without
importing Click: on a loaded login node most of the command's time was Python starting and
importing, not the listing. It prints exactly what the Click command prints: the same lines, ANSI
styles stripped when the stream is not a terminal (as ``click.echo`` does), ``error:`` lines and exit
status 2 for a UserError, 1 with ``Aborted!`` for Ctrl-C, and it hands anything else (other
arguments, shell completion, a stream that is not UTF-8) to Click.
"""

from __future__ import annotations

import json
import os
import re
import sys
import typing as tp
from pathlib import Path

from hpc.core.errors import UserError
from hpc.login.evals import eval_metrics

LIST_RUNS = 20
LIST_TIMEOUT_S = 3.0  # the list waits this long for the scheduler, then says "unknown (scheduler unreachable)"
ANSI = re.compile(r"\033\[[0-?]*[ -/]*[@-~]")  # what click.echo strips from a stream that is not a terminal


def run_roots(warn: tp.Callable[[str], None]) -> list[Path]:
    """Every site profile's run root (``hpc.login.siteroots``: a profile that does not load is named
    through ``warn``), then the roots of runs made under a spec's job.run_root or a site given as a path."""
    from hpc.login.roots import remembered  # lazy: startup
    from hpc.login.siteroots import run_roots as profiles_roots  # lazy: startup

    return list(dict.fromkeys(profiles_roots(warn) + remembered()))


def recent(warn: tp.Callable[[str], None]) -> list[dict[str, tp.Any]]:
    """The summaries of the caller's newest runs (the scheduler asked once, within LIST_TIMEOUT_S)."""
    from hpc.core import runs  # lazy: startup
    from hpc.login import submit as sub  # lazy: startup (the fast path)

    return sub.summaries(runs.list_runs(run_roots(warn))[:LIST_RUNS], LIST_TIMEOUT_S)


def format_status(info: dict) -> str:
    step = info["step"] if info["step"] is not None else "-"
    ledger = info["ledger"]
    return (f"{Path(info['run_dir']).name}  job {info['job_id']}  {info['state_words']}  nodes {info['nodes'] or '-'}  "
            f"step {step}  restarts {info['restarts']}  [{' > '.join(info['states'])}]"
            + throughput_text(info, "  ")
            + eval_text(info, "  ")
            + (f"  saves {ledger['save_s']} s, restores {ledger['restore_s']} s, "
               f"recomputed {ledger['steps_recomputed']} steps" if ledger["starts"] else "")
            + (f"  last stop: {info['last_stop']['words']}" if info.get("last_stop") else "")
            + health_text(info)
            + goodput_text(info))


def goodput_text(info: dict) -> str:
    """"  goodput 91.2% (lost: …)" for one run (``hpcx status RUN``: ``hpc.core.goodput``); "" in the list."""
    if not info.get("goodput"):
        return ""
    from hpc.core.goodput import words  # lazy: startup

    text = words(info["goodput"])
    return f"  {text}" if text else ""


def health_text(info: dict) -> str:
    """"  excluded n1 (41 min more)": the nodes the job keeps out now (``hpc.core.health``), and
    "  straggler: rank 3 on n7, 2.1× the median over the last 3 intervals" (``hpc.core.straggler``); "" if none."""
    import time  # lazy: startup

    from hpc.core.health import exclusion_words  # lazy: startup
    from hpc.core.straggler import all_words  # lazy: startup

    words = exclusion_words(info.get("excluded_nodes") or {}, time.time())
    slow = all_words(info.get("stragglers") or [])  # the ranks named slow now (hpc.core.straggler)
    return "".join(f"  {w}" for w in (words, slow) if w)


def throughput_text(info: dict, lead: str) -> str:
    """``lead`` + "1,234 real tokens/s (8.1% padding)" for a language model's run (its last metrics line:
    tokens/s less the windows' padding, packed or not), "5,678 tokens/s" for a task's; "" before the first."""
    if info.get("real_tokens_per_s") is not None:
        return f"{lead}{info['real_tokens_per_s']:,.0f} real tokens/s ({info.get('padding_fraction') or 0:.1%} padding)"
    if info.get("tokens_per_s") is not None:
        return f"{lead}{info['tokens_per_s']:,.0f} tokens/s"
    return ""


def eval_text(info: dict, lead: str) -> str:
    """``lead`` + "eval loss 2.1234 (perplexity 8.37)", with a task's metrics ("…, accuracy 0.9531");
    "" before the first evaluation."""
    if info.get("eval_loss") is None:
        return ""
    perplexity = f" (perplexity {info['eval_perplexity']:.2f})" if info.get("eval_perplexity") is not None else ""
    metrics = "".join(f", {k.removeprefix('eval_')} {v:.4g}" for k, v in eval_metrics(info).items())
    return f"{lead}eval loss {info['eval_loss']:.4f}{perplexity}{metrics}"


def as_json(obj: tp.Any) -> str:
    """``--json`` output (what ``hpc.cli.clickutil.echo_json`` prints)."""
    return json.dumps(obj, indent=2, sort_keys=True, default=str)


# ---------------------------------------------------------------- the console script's fast path


def without_click(args: list[str]) -> int | None:
    """Answer ``hpcx status [--json]`` and return the exit status; None (nothing done) for any other
    command line, or where Click would write differently (shell completion, a stream that is not UTF-8)."""
    if args not in (["status"], ["status", "--json"]) or os.environ.get("_HPCX_COMPLETE"):
        return None
    if not (_utf8(sys.stdout) and _utf8(sys.stderr)):
        return None
    from hpc.core import procs  # lazy: startup

    ahead = remembered_queries()
    procs.start_ahead(ahead)  # before the modules that ask them are imported: see `remembered_queries`
    procs.asked = []
    try:
        infos = recent(lambda message: echo(message, sys.stderr))
        asked, procs.asked = procs.asked, None
        if asked != ahead:
            remember_queries(asked)
        if args[1:]:
            echo(as_json(infos), sys.stdout)
        else:
            for info in infos:
                echo(format_status(info), sys.stdout)
    except UserError as exc:
        from hpc.core.validate import shown  # lazy: startup

        for message in exc.messages:  # a file name or key from the user may hold control characters
            echo(f"error: {shown(message, 4000)}", sys.stderr)
        return 2
    except (EOFError, KeyboardInterrupt):
        echo("", sys.stderr)  # the blank line closes the terminal's ^C echo
        echo("Aborted!", sys.stderr)
        return 1
    except BrokenPipeError:  # `hpcx status | head -1`: quietly, as Click does
        _quiet_streams()
        return 1
    finally:
        procs.asked = None
        procs.stop_ahead()  # those the listing did not ask this time (another set of jobs, a controller down)
    return 0


def echo(text: str, stream: tp.TextIO) -> None:
    """``click.echo(text)``: a line, stripped of ANSI styles unless ``stream`` is a terminal, flushed."""
    out = text + "\n"
    if not _isatty(stream):
        out = ANSI.sub("", out)
    stream.write(out)
    stream.flush()


def _isatty(stream: tp.TextIO) -> bool:
    try:
        return stream.isatty()
    except Exception:  # noqa: BLE001 - as click's isatty: a stream that cannot say is not a terminal
        return False


def _utf8(stream: tp.TextIO | None) -> bool:
    import codecs  # lazy: startup

    encoding = getattr(stream, "encoding", None)
    try:
        return isinstance(encoding, str) and codecs.lookup(encoding).name == "utf-8"
    except LookupError:
        return False


def _quiet_streams() -> None:
    """After EPIPE: point stdout and stderr at /dev/null, so the interpreter's last flush says nothing."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):
            pass


# ---------------------------------------------------------------- the scheduler queries, started early

MAX_QUERIES = 8  # commands a record may hold (a Slurm listing asks at most three)
QUERIES = "status-queries.json"  # in hpc.login.cache's folder


def remembered_queries() -> list[list[str]]:
    """The scheduler queries the caller's last ``hpcx status`` list ran (``squeue -j IDS``, ``sacct -j IDS``),
    to start again before anything else is imported. Their answer takes a fixed wait on the scheduler's
    side (slurmdbd: about 85 ms on the sandbox, almost no CPU), which otherwise came after this process's
    start-up instead of during it; a process is handed to the listing only when it asks the very same
    argument list (``hpc.core.procs.take_ahead``), so the states shown are the same, and one it does not
    ask is killed when the list ends. Empty unless the record can be trusted (``hpc.login.cache``) and
    each command is a plain name on $PATH with string arguments."""
    from hpc.login import cache  # lazy: startup

    record = cache.read(QUERIES)
    cmds = record.get("commands") if isinstance(record, dict) else None
    if not isinstance(cmds, list) or len(cmds) > MAX_QUERIES:
        return []
    if not all(isinstance(cmd, list) and cmd and all(isinstance(a, str) and "\0" not in a for a in cmd)
               and cmd[0] and os.sep not in cmd[0] and not cmd[0].startswith("-") for cmd in cmds):
        return []
    return cmds


def remember_queries(cmds: list[list[str]]) -> None:
    """Record what this list asked, for the next one."""
    from hpc.login import cache  # lazy: startup

    cache.write(QUERIES, {"commands": cmds[:MAX_QUERIES]})

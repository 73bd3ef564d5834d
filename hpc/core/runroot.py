"""A run root (``job.run_root``, ``storage.run_root``, ``--run-dir``): an absolute folder, and one every
scheduler kind can write its log files under (``hpc.schedulers.path_problem``). Above the registry, so
that ``hpc.core.validate`` (which the registry's users import) stays below it."""

from __future__ import annotations

from pathlib import Path

from hpc import schedulers
from hpc.core.errors import ConfigError
from hpc.core.validate import PATH_MAX, check_text, expand_path, shown


def check_run_root(path: str, value: str) -> list[str]:
    """What can be said of a run root before expanding it."""
    if not value.strip():
        return [f"`{path}` = {value!r}: expected a folder, e.g. \"$HOME/hpcx-runs\""]
    if not value.startswith(("/", "~", "$")):
        return [f"`{path}` = {shown(value)!r}: expected an absolute path (or one starting with ~ or $VAR), "
                "so that every command and every node finds the same folder"]
    problem = log_path_problem(value)
    return [f"`{path}` = {shown(value)!r}: {problem}"] if problem else []


def log_path_problem(value: str) -> str | None:
    """Why a scheduler would not write its log files under ``value`` (``hpc.schedulers.path_problem``), or None."""
    return schedulers.path_problem(value)


def check_run_dir_option(run_dir: str | None) -> None:
    """``hpcx render --run-dir``: it lands in ``--output``/``--error`` like a run root."""
    if run_dir is None:
        return
    errors = check_text("--run-dir", run_dir, PATH_MAX)
    problem = None if errors else log_path_problem(run_dir)
    if errors or problem:
        raise ConfigError(errors or [f"--run-dir {shown(run_dir)!r}: {problem}"])


def expand_run_root(value: str, where: str) -> Path:
    """A run root expanded (``expand_path``) and still free of Slurm's file-name patterns."""
    path = expand_path(value, where)
    problem = log_path_problem(str(path))
    if problem:
        raise ConfigError([f"{where}: expands to {shown(str(path))!r}: {problem}"])
    return path

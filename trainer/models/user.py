"""A user's model (``model.arch = "pkg.mod:function"``), trainer side: import ``pkg.mod`` and call
``function(**model.kwargs)``. What the model must offer is in ``trainer.model``'s docstring.
"""

from __future__ import annotations

import importlib
import typing as tp

from hpc.core.errors import ConfigError
from hpc.core.imports import submit_folder_last
from hpc.core.spec import Model as ModelSpec


def build(spec: ModelSpec) -> tp.Any:
    """Whatever the user's function returns (``trainer.model.build_model`` checks it is an nn.Module)."""
    return _user_function(spec.arch)(**spec.kwargs)


def _user_function(arch: str) -> tp.Callable[..., tp.Any]:
    """``pkg.mod:fn``'s function, imported from ``sys.path`` and then the current folder (where the job
    was submitted: ``hpc.core.imports.submit_folder_last``)."""
    module_name, function_name = arch.split(":")
    submit_folder_last()
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"`model.arch` = {arch!r}: cannot import {module_name!r} here: {exc}") from exc
    if not callable(getattr(module, function_name, None)):
        raise ConfigError(f"`model.arch` = {arch!r}: module {module_name!r} has no function {function_name!r}")
    return getattr(module, function_name)

"""The test extras (pyproject's ``test``: transformers, safetensors, matplotlib; peft where a test uses it).

A test that needs one asks ``extra(name)``: without it the test is skipped, except where
HPCX_REQUIRE_HF=1 (scripts/test-all and CI), where a missing extra is a failure, as HPCX_REQUIRE_SLURM
does for the sandbox. torch, tokenizers and the rest of ``dependencies`` are plain imports.
"""

from __future__ import annotations

import importlib
import os
import types

import pytest

REQUIRE_ENV = "HPCX_REQUIRE_HF"


def extra(name: str) -> types.ModuleType:
    """The module ``name``; a skip where it does not import, a failure where REQUIRE_ENV is set."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        why = f"{name} does not import ({exc}); pip install -e '.[test]'"
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"a test extra is required ({REQUIRE_ENV}=1) but {why}", pytrace=False)
        pytest.skip(why, allow_module_level=True)

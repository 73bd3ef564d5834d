"""The ``hpcx`` console script: a bare ``hpcx status`` (or ``hpcx status --json``) is answered by
``hpc.login.status`` without importing Click, everything else by the Click commands of ``hpc.cli``.

On a loaded login node importing Click and the command modules cost more than the listing itself,
and ``hpcx status`` is the command people run in a loop; its output is the same either way.
"""

from __future__ import annotations

import sys


def main() -> None:
    from hpc.login.status import without_click  # lazy: startup

    code = without_click(sys.argv[1:])
    if code is not None:
        sys.exit(code)
    from hpc.cli import main as with_click  # lazy: click

    with_click()

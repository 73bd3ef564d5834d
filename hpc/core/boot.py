"""How hpcx starts its own Python processes: ``python -c BOOT MODULE ARGS`` (see ``hpc.core.imports``,
whose ``main`` ``BOOT`` runs). A leaf: the scheduler interface builds task commands with it, and
``hpc.core.imports`` checks a container's image through modules above the schedulers.
"""

from __future__ import annotations

# The code of ``python -c``: sys.path[0] is then "" (the current folder); 3.11's -P (PYTHONSAFEPATH)
# would leave it out, but hpcx supports 3.10. No quotes, so that it is one word in a shell script.
BOOT = "import sys; sys.path[:1] = filter(None, sys.path[:1]); import hpc.core.imports as i; i.main()"


def python_command(python: str, module: str, *args: str, unbuffered: bool = False) -> list[str]:
    """``python -c BOOT MODULE ARGS``: ``python -m MODULE ARGS`` with hpcx's own ``hpc`` and ``trainer``,
    whatever the current folder holds."""
    return [python, *(["-u"] if unbuffered else []), "-c", BOOT, module, *args]

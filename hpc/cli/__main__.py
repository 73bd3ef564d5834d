"""``python -m hpc.cli``: the ``hpcx`` command (the tests run it this way, in a fresh interpreter)."""

from hpc.cli import main

main()

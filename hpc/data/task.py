"""The job side of ``hpcx data prepare --site S``: one array task tokenizes its group, the merge job
writes the manifest. Torch-free.

    python -m hpc.data.task group DIR INDEX
    python -m hpc.data.task merge DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hpc.data.prepare import STATE, merge, run_group
from hpc.data.progress import Progress
from hpc.core.errors import UserError


def group_task(folder: Path, index: int) -> None:
    """Tokenize group ``index`` (done already: nothing to do), printing progress lines to the job log."""
    plan = json.loads((folder / STATE / "plan.json").read_text())
    if (folder / STATE / f"group-{index:05d}.json").is_file():
        print(f"group {index}: already finished")
        return
    progress = Progress(sum(plan["inputs"][i]["bytes"] for i in plan["groups"][index]), sys.stdout)
    run_group(folder, plan, index, progress.update)
    progress.draw(final=True)


def main(argv: list[str]) -> int:
    """``group DIR INDEX`` or ``merge DIR``; a UserError is printed as ``error:`` lines, exit 2."""
    try:
        if argv[:1] == ["group"] and len(argv) == 3:
            group_task(Path(argv[1]), int(argv[2]))
        elif argv[:1] == ["merge"] and len(argv) == 2:
            manifest = merge(Path(argv[1]))
            print(f"{argv[1]}/manifest.json: {sum(s['tokens'] for s in manifest['splits'].values())} tokens")
        else:
            print("usage: python -m hpc.data.task group DIR INDEX | merge DIR", file=sys.stderr)
            return 2
    except UserError as exc:
        for message in exc.messages:
            print(f"error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

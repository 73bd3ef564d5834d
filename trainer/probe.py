"""``python -m trainer.probe OUT``: what a task sees inside the site's image, for ``hpcx container check``.

Each task writes OUT/rank-N.json: its Python, torch, CUDA and NCCL versions, the GPUs it sees, whether
hpcx's own ``hpc`` and ``trainer`` import there (``hpc.core.imports.problem``), then takes part in one
all-reduce over every task (NCCL on a GPU site, gloo otherwise; rendezvous through a file in OUT), whose
NCCL lines (``NCCL_DEBUG=INFO``, in the task's stderr) say which transports it chose.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

from hpc import schedulers
from hpc.core.imports import problem


def facts() -> dict:
    import torch  # lazy: torch

    cuda = torch.cuda.is_available()
    out = {"python": platform.python_version(), "executable": sys.executable, "torch": torch.__version__,
           "cuda": torch.version.cuda, "cuda_available": cuda,
           "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
           "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
           "hpcx_imports": problem() or "ok", "image": os.environ.get("HPCX_CONTAINER_IMAGE"),
           "host": platform.node()}
    return out


def all_reduce(out_dir: Path, rank: int, local_rank: int, world: int) -> dict:
    import torch  # lazy: torch
    import torch.distributed as dist  # lazy: torch

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    x = torch.ones(1 << 20, device="cuda" if backend == "nccl" else "cpu")
    dist.all_reduce(x)
    ok = bool(x[0].item() == world)
    dist.destroy_process_group()
    return {"backend": backend, "all_reduce_ok": ok, "world": world}


def main(argv: list[str]) -> None:
    out_dir = Path(argv[0])
    place = schedulers.rank_env(os.environ)  # the scheduler's own variables for a task of a plain step
    rank, local_rank, world = (place.rank, place.local_rank, place.world_size) if place else (0, 0, 1)
    found = facts()
    try:
        found.update(all_reduce(out_dir, rank, local_rank, world))
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the check prints what it saw
        found.update(all_reduce_ok=False, all_reduce_error=f"{type(exc).__name__}: {exc}"[:300])
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(found) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])

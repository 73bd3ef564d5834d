"""torch's fake process group: every rank of a job, simulated by one CPU process.

``init_process_group("fake", store=FakeStore(), rank=R, world_size=W)`` gives a process group whose
collectives return at once without sending anything, so device meshes, FSDP2 sharding and DCP
planning run exactly as on rank R of a W-rank job. ``hpcx dryrun`` and the tests use it.

Its two private torch APIs (``FakeStore``, and DTensor's sharding-propagation cache, which must be
cleared between two simulated worlds: it keys on meshes that compare equal across worlds, and would
hand the next world's DTensors the previous world's mesh) are reached through ``hpc.compat``.
"""

from __future__ import annotations

import contextlib
import typing as tp

import torch.distributed as dist

from hpc.compat import clear_sharding_cache, fake_store


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> tp.Iterator[None]:
    """This process as ``rank`` of ``world_size`` on the fake backend, torn down on leaving (so one
    process can simulate many worlds in a row)."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized in this process; the fake one needs its own")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size} ranks (0..{world_size - 1})")
    clear_sharding_cache()
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        clear_sharding_cache()

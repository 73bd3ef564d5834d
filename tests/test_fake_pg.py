"""The private torch APIs behind ``hpc.dryrun.fake_pg``: if a torch upgrade moves one, this fails and says which."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hpc.dryrun.fake_pg import clear_sharding_cache, fake_process_group, fake_store


def test_fake_store_is_where_hpc_fake_pg_looks():
    """torch.testing._internal.distributed.fake_pg.FakeStore: `hpcx dryrun` cannot run without it."""
    assert type(fake_store()).__name__ == "FakeStore"


def test_sharding_cache_can_be_cleared():
    """torch.distributed.tensor.debug._clear_sharding_prop_cache: without it a second fake world in
    the same process inherits the first one's meshes (tests/test_dryrun.py shows the symptom)."""
    clear_sharding_cache()


def test_a_fake_world_is_that_world_and_is_torn_down():
    with fake_process_group(64, rank=17):
        assert dist.get_world_size() == 64 and dist.get_rank() == 17
        t = torch.ones(3)
        dist.all_reduce(t)  # a no-op: nothing is sent
        assert torch.equal(t, torch.ones(3))
    assert not dist.is_initialized()


def test_a_rank_outside_the_world_and_a_second_group_are_refused():
    with pytest.raises(ValueError, match="rank 8 is not in a world of 8 ranks"):
        with fake_process_group(8, rank=8):
            pass
    with fake_process_group(2):
        with pytest.raises(RuntimeError, match="already initialized"):
            with fake_process_group(2):
                pass

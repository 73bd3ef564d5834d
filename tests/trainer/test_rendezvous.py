"""The rendezvous: store requests per rank independent of the world size, missing ranks named, device binding.

A counting store (a real ``torch.distributed.Store`` subclass over a ``HashStore`` or a real
``TCPStore``) records every request a rank makes; ranks run as threads against one store.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from hpc.schedulers.base import RankEnv
from trainer.dist import _rendezvous, bound_device


class CountingStore(dist.Store):
    """Forwards to ``inner`` and counts each request by kind (and keeps the timeouts of the waits)."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner, self.requests, self.wait_timeouts = inner, [], []

    def set(self, key, value):
        self.requests.append("set")
        return self.inner.set(key, value)

    def get(self, key):
        self.requests.append("get")
        return self.inner.get(key)

    def check(self, keys):
        self.requests.append("check")
        return self.inner.check(keys)

    def wait(self, keys, timeout=None):
        self.requests.append("wait")
        self.wait_timeouts.append(timeout)
        return self.inner.wait(keys, timeout) if timeout is not None else self.inner.wait(keys)

    def multi_get(self, keys):
        self.requests.append("multi_get")
        return self.inner.multi_get(keys)


def env(rank: int, world: int) -> RankEnv:
    return RankEnv(rank=rank, local_rank=rank % 8, world_size=world, master_addr="127.0.0.1", master_port=1,
                   hostname=f"node{rank // 8}")


def others_arrive(store: dist.Store, world: int, skip: set[int]) -> None:
    for r in range(world):
        if r not in skip:
            store.set(f"arrived/{r}", f"node{r // 8}")


@pytest.mark.parametrize("world", [1, 2, 8, 64, 1000])
def test_a_rank_makes_three_store_requests_at_any_world_size(world):
    shared = dist.HashStore()
    others_arrive(shared, world, skip={world - 1})
    store = CountingStore(shared)
    hosts = _rendezvous(store, env(world - 1, world), timeout_s=5)
    assert hosts == [f"node{r // 8}" for r in range(world)]
    assert store.requests == ["set", "wait", "multi_get"]


def test_through_the_prefix_store_the_trainer_uses():
    counting = CountingStore(dist.HashStore())
    store = dist.PrefixStore("hpcx/0", counting)
    others_arrive(store, 100, skip={0})
    assert _rendezvous(store, env(0, 100), timeout_s=5)[99] == "node12"
    assert counting.requests.count("wait") == 1 and counting.requests.count("multi_get") == 1
    assert "check" not in counting.requests and "get" not in counting.requests


@pytest.mark.parametrize("world,present,missing", [
    (4, {0}, [1, 2, 3]),
    (4, {1, 2, 3}, [0]),
    (8, {0, 2, 5}, [1, 3, 4, 6, 7]),
    (1000, set(range(1000)) - {17, 999}, [17, 999]),
])
def test_a_timeout_names_the_missing_ranks(world, present, missing):
    store = CountingStore(dist.HashStore())
    me = min(present)
    others_arrive(store, world, skip=set(range(world)) - present)
    with pytest.raises(RuntimeError) as err:
        _rendezvous(store, env(me, world), timeout_s=1)
    assert f"ranks {missing} of {world} did not arrive (this is rank {me} on node{me // 8})" in str(err.value)
    assert "timed out after 1 s" in str(err.value)
    assert store.wait_timeouts == [timedelta(seconds=1)]  # the store's own wait ends it, not a clock here


def test_a_late_rank_within_the_timeout_is_waited_for():
    store = dist.HashStore()
    others_arrive(store, 4, skip={0, 3})
    late = threading.Timer(0.5, lambda: store.set("arrived/3", "late-node"))
    late.start()
    try:
        assert _rendezvous(store, env(0, 4), timeout_s=20) == ["node0", "node0", "node0", "late-node"]
    finally:
        late.cancel()


def test_ranks_as_threads_on_a_real_tcp_store():
    """Every rank its own client connection to rank 0's TCPStore, all arriving at once."""
    world = 16
    master = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    results: dict[int, list[str]] = {}
    requests: dict[int, list[str]] = {}

    def rank(r: int) -> None:
        client = dist.TCPStore("127.0.0.1", master.port, None, False, timeout=timedelta(seconds=30))
        store = CountingStore(dist.PrefixStore("hpcx/0", client))
        results[r] = _rendezvous(store, env(r, world), timeout_s=30)
        requests[r] = store.requests

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    expected = [f"node{r // 8}" for r in range(world)]
    assert results == {r: expected for r in range(world)}
    assert all(req == ["set", "wait", "multi_get"] for req in requests.values())


@pytest.mark.parametrize("device,expected", [
    (torch.device("cuda", 3), {"device_id": torch.device("cuda", 3)}),
    (torch.device("cuda", 0), {"device_id": torch.device("cuda", 0)}),
    (torch.device("cpu"), {}),
    (None, {}),
])
def test_the_process_group_is_bound_to_the_gpu_only(device, expected):
    assert bound_device(device) == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nccl_group_is_bound_to_the_rank_gpu(tmp_path):
    from trainer.dist import init_distributed, shutdown

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    me = RankEnv(rank=0, local_rank=0, world_size=1, master_addr="127.0.0.1", master_port=0)
    try:
        assert init_distributed(me, "nccl", timeout_s=60, device=device) == [me.hostname]
        assert dist.distributed_c10d._get_default_group().bound_device_id == device
    finally:
        shutdown(30)

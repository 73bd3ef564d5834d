"""One rank's rendezvous against rank 0's TCPStore: ``trainer.dist._rendezvous`` against polling key by key.

    python bench/rendezvous/run.py [--worlds 8,64,512,1000] [--reps 5]

For each world size W, every other rank's key is already in the store (the last rank to arrive,
the common case at scale) and one client connection, as a rank has, runs the rendezvous:

- baseline: the previous implementation, kept here: one ``check`` per key, then one ``get`` per
  key: 2·W requests per rank, so W·2W on rank 0's store for the whole job (and W per rank on
  every 50 ms poll while ranks are still arriving);
- hpcx: ``set``, one ``wait`` on all keys, one ``multi_get``: 3 requests per rank.

Prints the median time of each (``--reps`` alternating runs), the ratio hpcx / baseline and the
requests per rank. Goal: hpcx's requests independent of W, and its time ≤ 0.1 × at W = 1000.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta


def polled(store, env, timeout_s: int) -> list[str]:
    """The rendezvous before: poll each key, then read each (the baseline)."""
    store.set(f"arrived/{env.rank}", env.hostname)
    keys = [f"arrived/{r}" for r in range(env.world_size)]
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        if not missing:
            return [store.get(k).decode() for k in keys]
        if time.monotonic() > deadline:
            raise RuntimeError(f"ranks {missing} did not arrive")
        time.sleep(0.05)


class Counting:
    """Counts the requests a rendezvous makes (wraps a store; only the calls both versions use)."""

    def __init__(self, inner) -> None:
        self.inner, self.requests = inner, 0

    def __getattr__(self, name):
        method = getattr(self.inner, name)

        def call(*args):
            self.requests += 1
            return method(*args)
        return call


def one_world(world: int, reps: int) -> str:
    import torch.distributed as dist

    from hpc.schedulers.base import RankEnv
    from trainer.dist import _rendezvous

    master = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    shared = dist.PrefixStore("hpcx/0", master)
    for r in range(world - 1):
        shared.set(f"arrived/{r}", f"node{r // 8}")
    client = dist.PrefixStore("hpcx/0", dist.TCPStore("127.0.0.1", master.port, None, False,
                                                      timeout=timedelta(seconds=60)))
    env = RankEnv(rank=world - 1, local_rank=0, world_size=world, master_addr="127.0.0.1", master_port=master.port,
                  hostname="last")
    times: dict[str, list[float]] = {"baseline": [], "hpcx": []}
    requests: dict[str, int] = {}
    for i in range(reps):
        for name, fn in (("baseline", polled), ("hpcx", _rendezvous))[:: 1 if i % 2 else -1]:
            store = Counting(client)
            tic = time.perf_counter()
            hosts = fn(store, env, 60)
            times[name].append(time.perf_counter() - tic)
            requests[name] = store.requests
            assert len(hosts) == world and hosts[-1] == "last"
    base, ours = (statistics.median(times[n]) for n in ("baseline", "hpcx"))
    return (f"{world:6d} {1000 * base:12.2f} {1000 * ours:9.2f} {ours / base:7.3f} "
            f"{requests['baseline']:14d} {requests['hpcx']:10d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="8,64,512,1000")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    print(f"one rank's rendezvous on a local TCPStore; load average {os.getloadavg()[0]:.1f} at start")
    print(f"{'world':>6s} {'baseline ms':>12s} {'hpcx ms':>9s} {'ratio':>7s} {'baseline req':>14s} {'hpcx req':>10s}")
    for world in (int(w) for w in args.worlds.split(",")):
        print(one_world(world, args.reps), flush=True)
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end (1, 5, 15 min)")


if __name__ == "__main__":
    main()

"""A user's own DDP training script, the kind the seed articles start from: ``dist.init_process_group``
from torchrun's variables, a ``DistributedSampler`` with ``set_epoch``, ``DistributedDataParallel``, its own
checkpoint with ``torch.save``. What makes it survive preemption under hpcx is the three ``hpc.job``
calls. Written for the script-mode tests (tests/script_mode/); nothing here is hpcx's trainer.

    python ddp_script.py OUT STEPS [--hold-at N]

OUT: a folder for its checkpoint and what each rank saw; ``--hold-at N`` waits after step N until
``hpc.job.preempted()`` (a test's drill comes then, so the preemption falls at a known step).
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from hpc import job


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("steps", type=int)
    parser.add_argument("--hold-at", type=int, default=-1)
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)

    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment
    rank, world = dist.get_rank(), dist.get_world_size()
    seen = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                           "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "HPCX_RESTART", "HPCX_INCARNATION",
                                           "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                                           "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
                                           "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")}
    seen["hostname"] = os.uname().nodename
    with open(os.path.join(out, f"env-{job.restart()}-rank{rank}.json"), "w") as f:
        json.dump(seen, f)

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(96, 8), torch.randint(0, 3, (96,)))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=1)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    # find_unused_parameters: DDP then keeps its first bucket layout instead of rebuilding it after the first
    # step, so a restarted run sums the gradients of 4 ranks in the same order as an uninterrupted one
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)),
                find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    ckpt = os.path.join(out, "ckpt.pt")
    step = 0
    if os.path.exists(ckpt):  # its own checkpoint: resume where it stopped
        state = torch.load(ckpt, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]

    per_epoch = len(loader)
    while step < args.steps:
        epoch, offset = divmod(step, per_epoch)
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if i < offset:
                continue
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            job.log(step, loss=loss.item())
            if step == args.hold_at and job.restart() == 0:
                deadline = time.time() + 600  # a hang guard, not a timing
                while not job.preempted() and time.time() < deadline:
                    time.sleep(0.2)
            stop = torch.tensor([int(job.preempted())])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # the ranks agree on when to stop
            if stop.item():
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt)
                job.requeue()
                leave()
            if step >= args.steps:
                break
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "step": step}, os.path.join(out, "final.pt"))
    leave()


def leave():
    """Tear the group down together and leave without the interpreter's finalization: under load, gloo's
    threads racing the finalization kill a rank with SIGABRT ("terminate called without an active
    exception"; pytorch/pytorch#179291) after its work is done, which any launcher reads as a failed rank
    (hpcx requeues it as a failed start: an extra start and stop in the ledger)."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

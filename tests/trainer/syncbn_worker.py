"""Run under torchrun (gloo, CPU): each rank's ``HostSyncBatchNorm`` on its half of a batch against one
``nn.BatchNorm`` on the whole batch. Writes the largest differences to ``OUT`` (rank 0) as JSON."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn

from trainer.syncbn import convert


def case(make: type, shape: tuple[int, ...], momentum: float | None, rank: int, world: int) -> dict[str, float]:
    torch.manual_seed(0)
    whole = torch.randn(*shape) * 3 + 1
    weights = torch.randn(*shape)  # the loss: a fixed weighting of the outputs, so gradients differ by sample
    reference = make(shape[1], momentum=momentum)
    nn.init.uniform_(reference.weight)
    ours = convert(nn.Sequential(make(shape[1], momentum=momentum)), "test", "cpu")[0]
    ours.load_state_dict(reference.state_dict())
    part = shape[0] // world
    mine = slice(rank * part, (rank + 1) * part)
    diffs: dict[str, float] = {}
    for step in range(3):  # the running statistics over several steps
        x = (whole + step).requires_grad_()
        expected = reference(x)
        (expected * weights).sum().backward()
        local = (whole[mine] + step).requires_grad_()
        out = ours(local)
        (out * weights[mine]).sum().backward()
        grad_w = ours.weight.grad.clone()
        dist.all_reduce(grad_w)  # the gradient of the global loss: each rank holds its samples' part
        pairs = {"out": (out, expected[mine]), "grad_x": (local.grad, x.grad[mine]),
                 "grad_w": (grad_w, reference.weight.grad), "mean": (ours.running_mean, reference.running_mean),
                 "var": (ours.running_var, reference.running_var)}
        for name, (a, b) in pairs.items():
            diffs[name] = max(diffs.get(name, 0.0), float((a.detach() - b.detach()).abs().max()))
        reference.zero_grad()
        ours.zero_grad()
    diffs["tracked"] = float(ours.num_batches_tracked != reference.num_batches_tracked)
    ours.eval()
    reference.eval()
    diffs["eval"] = float((ours(whole[mine]) - reference(whole[mine])).abs().max())
    return diffs


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {"2d": case(nn.BatchNorm2d, (8, 3, 5, 5), 0.1, rank, world),
               "1d": case(nn.BatchNorm1d, (8, 4), None, rank, world)}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()  # both ranks tear gloo down together (a peer gone first can abort the other at exit)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

"""Step time of the hpcx trainer, as users run it, against a hand-written torch loop doing the same work.

    python bench/trainer_overhead/run.py [--size small] [--seq-len 128] [--steps 60] [--warmup 10]
                                         [--strategies none,ddp,fsdp,hsdp] [--lr 3e-4]

Strategies: none (one process), ddp, fsdp and hsdp 2 × 1 (two ranks under torchrun, gloo on CPU,
one thread per rank; hsdp replicates over 2 groups of 1).

The two loops are interleaved step by step in the same processes: after each of its step
boundaries the trainer runs one step of the hand-written loop (the bench hands the trainer a
``Resilience`` that does its work, then the hand step). On a shared machine whose load swings by
±40 % between one minute and the next, separate rounds of each loop compared noise; interleaved,
every swing hits both alike. The hand step is timed on its own and taken back out of the
trainer's ``boundary`` phase (``hpcx_windows``).

Per step, both sides do the same work on the same numbers:

=============  =================================================================================
hpcx           ``trainer.loop.train`` as ``run_rank`` runs it: the run's DataLoader (synthetic
               tokens), forward, loss, backward, the trainer's clip (``optim.clip_grad_norm``),
               fused AdamW step, zero_grad, LambdaLR step; at its step boundary the
               ``Resilience`` vote (one all-reduce of the preemption flag, read on the host);
               every ``train.log_every`` steps (the spec default) the loss all-reduce and one
               metrics line (``metrics.jsonl``, the progress log line). The final save after the
               last step is outside every measured window.
hand           pre-built batches (the same samples the trainer's sampler gives that rank), the
               same model with the same initial weights (``WeightInit``), wrapped by hand (DDP;
               ``fully_shard`` per block, on the embeddings, on final norm + head, then the root,
               on a 2-D mesh for hsdp), loss, backward, ``torch.nn.utils.clip_grad_norm_``, the
               same fused AdamW (decay on matrices only) + LambdaLR; a preemption vote every
               step (all-reduce MAX of a flag, ``.item()``); every ``log_every`` steps the loss
               all-reduce, ``.item()`` of loss and norm, and one line written to a file.
=============  =================================================================================

Both run under the trainer's float settings (``loop.set_float_math``: subnormals flushed to zero on
CPU; ``bench/float_math`` measures what that setting itself is worth), so the ratio is the cost
of the trainer's machinery, not of different arithmetic; the losses of both sides are printed
side by side as the check. Each side's step time is the median over its windows of ``log_every``
steps after the warm-up window (the trainer's metrics lines; the hand loop's own, timed with
the same ``PhaseClock``); the ratio is the median over windows of hpcx / hand for the same steps.
Beside it, the split of both steps into phases: data, forward, backward, optimizer, log and
boundary (the vote). Goal: ratio ≤ 1.05.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STRATEGIES = {"none": ("none", []), "ddp": ("ddp", []), "fsdp": ("fsdp", []),
              "hsdp": ("hsdp", ["parallel.shard_size=1"])}  # hsdp 2 × 1: replicate 2, shard 1


def make_run(root: Path, name: str, strategy: str, ranks: int, args: argparse.Namespace) -> Path:
    """A run folder resolved as ``hpcx submit`` would, with the spec's default ``log_every``."""
    from hpc.core.resolve import resolved_document
    from hpc.plan.resolve import resolve
    from hpc.core.site import load_site
    from hpc.core.spec import load_spec

    kind, extra = STRATEGIES[strategy]
    spec = load_spec(REPO / "jobs" / "tiny-ddp.toml", [
        f"model.size={args.size!r}", f"model.seq_len={args.seq_len}", f"train.steps={args.warmup + args.steps}",
        f"train.global_batch={args.global_batch}", f"train.micro_batch={args.global_batch // ranks}",
        "train.warmup_steps=2", f"train.warmup_metrics_steps={args.warmup}", f"train.lr={args.lr}",
        f"parallel.strategy={kind!r}", f"job.tasks_per_node={ranks}", *extra])
    site = load_site("local")
    run_dir = root / name
    run_dir.mkdir(parents=True)
    (run_dir / "resolved.json").write_text(json.dumps(resolved_document(spec, site, resolve(spec, site), str(run_dir))))
    return run_dir


# ---------------------------------------------------------------- the two loops


class HandLoop:
    """The baseline: a plain loop written the way a user would, doing the trainer's work per step."""

    def __init__(self, run, rank: int, world: int):
        import torch

        from trainer.metrics import PhaseClock
        from trainer.optim import lr_factor

        t = run.spec.train
        self.t, self.rank, self.world, self.step_no = t, rank, world, 0
        self.model = hand_model(run, rank)
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        rest = [p for p in self.model.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                                      {"params": rest, "weight_decay": 0.0}],
                                     lr=t.lr, betas=tuple(t.betas), fused=True)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(s, t))  # the trainer's schedule
        self.batches = hand_batches(run, rank, t.steps)
        self.clock, self.windows, self.last_logged = PhaseClock(), [], 0
        self.logfile = open(run.run_dir / f"hand-rank{rank}.log", "a")

    def step(self) -> None:
        import time

        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        t, clock = self.t, self.clock
        self.step_no += 1
        clock.last = time.perf_counter()  # the time between two of its steps is the trainer's
        tokens = self.batches[self.step_no - 1]
        clock.lap("data")
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        clock.lap("forward")
        loss.backward()
        clock.lap("backward")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        clock.lap("optimizer")
        if self.step_no % t.log_every == 0 or self.step_no in (t.steps, t.warmup_metrics_steps):
            self.log(loss, norm)
        flag = torch.zeros(1)
        if self.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        flag.item()
        clock.lap("boundary")

    def log(self, loss, norm) -> None:
        import torch.distributed as dist

        mean = loss.detach().clone()
        if self.world > 1:
            dist.all_reduce(mean)
        value = mean.item() / self.world
        self.logfile.write(f"step {self.step_no} loss {value:.4f} gnorm {norm.item():.3f}\n")
        self.logfile.flush()
        self.clock.lap("log")
        phases = self.clock.take(self.step_no - self.last_logged)
        self.windows.append({"step": self.step_no, "loss": value, "step_s": sum(phases.values()), "phases": phases})
        self.last_logged = self.step_no


class Interleaved:
    """The trainer's ``Resilience``, running one hand-loop step after each of its step boundaries.

    The trainer charges that time to its ``boundary`` phase; it is timed here, per trainer step,
    and taken back out of the trainer's windows (``hpcx_windows``).
    """

    def __init__(self, resilience, hand: HandLoop):
        self.resilience, self.hand, self.hand_s = resilience, hand, {}

    def __getattr__(self, name: str):  # the rest of the trainer's Resilience (restart, …) as it is
        return getattr(self.resilience, name)

    def resume(self, t, state):
        return self.resilience.resume(t, state)

    def boundary(self, t, state) -> bool:
        import time

        stop = self.resilience.boundary(t, state)
        tic = time.perf_counter()
        self.hand.step()
        self.hand_s[state.step] = time.perf_counter() - tic
        return stop


def hand_model(run, rank: int):
    """The trainer's GPT with the trainer's initial weights, wrapped by hand for the run's strategy:
    DDP, or ``fully_shard`` on each block, on the embeddings and on final norm + head (torchtitan's
    units; the output side stays gathered after forward, as backward needs it first), then the root."""
    import torch

    from hpc.core.models.gpt import gpt_shape
    from trainer.model import WeightInit
    from trainer.models.gpt import GPT

    spec, dims = run.spec, run.launch.dims
    model = GPT(gpt_shape(spec.model.size, spec.model.seq_len), spec.model.dropout)
    WeightInit.of(model, spec.train.seed).initialise(model, torch.device("cpu"))  # the same numbers as the trainer
    if dims.strategy == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif dims.strategy in ("fsdp", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard")) \
            if dims.strategy == "hsdp" else None
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        outer = model.fsdp_units()
        for i, group in enumerate(outer):
            fully_shard(group, mesh=mesh, reshard_after_forward=i < len(outer) - 1)
        fully_shard(model, mesh=mesh)
    torch.manual_seed(spec.train.seed + rank)
    return model


def hand_batches(run, rank: int, steps: int) -> list:
    """This rank's micro-batch of every step, the samples the trainer's sampler picks, built beforehand."""
    import torch

    from hpc.core.models import model_facts
    from trainer.data import GlobalSampler, build_dataset, shuffle_enabled

    spec, facts = run.spec, model_facts(run.spec.model)
    kind = run.launch.data_source
    dataset = build_dataset(spec.data, kind, facts.seq_len, facts.vocab_size, spec.train.seed)
    sampler = GlobalSampler(len(dataset), spec.train.global_batch, spec.train.micro_batch, rank,
                            run.launch.world_size, spec.train.seed, shuffle_enabled(spec.data, kind))
    assert sampler.grad_accum == 1, "the hand loop takes one micro-batch per step"
    return [torch.stack([dataset[i] for i in sampler.step_batches(s * spec.train.global_batch)[0]])
            for s in range(steps)]


def hpcx_windows(lines: list[dict], hand_s: dict[int, float]) -> list[dict]:
    """The trainer's metrics lines, the interleaved hand steps taken out of their ``boundary`` phase.

    A line at step k covers the steps after the previous line's step a; the hand steps inside it are
    those run at the boundaries of steps a … k-1 (the boundary of a logged step comes after its line).
    """
    out, previous = [], 0
    for line in lines:
        steps = line["step"] - previous
        inside = sum(hand_s.get(s, 0.0) for s in range(previous, line["step"]))
        phases = dict(line["phases_s"], boundary=line["phases_s"]["boundary"] - inside / steps)
        out.append({"step": line["step"], "loss": line["loss"], "step_s": sum(phases.values()), "phases": phases})
        previous = line["step"]
    return out


def measure(run_dir: Path, rank: int, world: int) -> dict[str, list[dict]]:
    """One run of the trainer (vote attached, as ``run_rank`` builds it) with the hand loop interleaved."""
    import torch

    from trainer.loop import train
    from trainer.preemption import PreemptionFlag
    from trainer.resilience import resilience_for
    from trainer.run import load_run
    from trainer.train import build_trainer, resume

    run = load_run(run_dir)
    flag = PreemptionFlag()  # not installed: no signal comes, but every boundary votes on it
    trainer, state = build_trainer(run, rank, torch.device("cpu"), flag)
    hand = HandLoop(run, rank, world)
    guard = Interleaved(resilience_for(run, rank, flag), hand)
    trainer.resilience = guard
    train(trainer, resume(trainer, state))
    hand.logfile.close()
    if rank != 0:
        return {}
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"hpcx": hpcx_windows(lines, guard.hand_s), "hand": hand.windows}


def worker(run_dir: str, out: str) -> None:
    """One rank under torchrun."""
    import torch

    from trainer.dist import detect_rank_env, init_distributed, shutdown

    torch.set_num_threads(1)
    env = detect_rank_env()
    init_distributed(env, "gloo", timeout_s=300)
    result = measure(Path(run_dir), env.rank, env.world_size)
    if env.rank == 0:
        Path(out).write_text(json.dumps(result))
    shutdown(60)


def run_strategy(root: Path, strategy: str, args: argparse.Namespace) -> dict[str, list[dict]]:
    ranks = 1 if strategy == "none" else 2
    run_dir = make_run(root, strategy, strategy, ranks, args)
    if ranks == 1:
        import torch

        torch.set_num_threads(1)
        return measure(run_dir, 0, 1)
    out = root / f"{strategy}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
           "--worker", str(run_dir), str(out)]
    subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


# ---------------------------------------------------------------- report


def steady(windows: list[dict], warmup: int) -> list[dict]:
    return [w for w in windows if w["step"] > warmup]


def phase_medians(windows: list[dict]) -> dict[str, float]:
    return {name: statistics.median(w["phases"][name] for w in windows) for name in windows[0]["phases"]}


def report_line(strategy: str, times: dict, warmup: int) -> str:
    """Medians of both sides' windows, and the ratio: the median over windows of hpcx / hand for the same
    steps (each pair ran interleaved over the same minutes, so the pair's ratio is what load leaves alone)."""
    hpcx, hand = steady(times["hpcx"], warmup), steady(times["hand"], warmup)
    assert [w["step"] for w in hpcx] == [w["step"] for w in hand], "both loops log at the same steps"
    a, b = statistics.median(w["step_s"] for w in hpcx), statistics.median(w["step_s"] for w in hand)
    ratio = statistics.median(x["step_s"] / y["step_s"] for x, y in zip(hpcx, hand))
    pa, pb = phase_medians(hpcx), phase_medians(hand)
    split = "  ".join(f"{name} {1000 * pa[name]:.0f}/{1000 * pb[name]:.0f}" for name in pa)
    loss_gap = max(abs(x["loss"] - y["loss"]) for x, y in zip(times["hpcx"], times["hand"]))
    return (f"{strategy:9s} {1000 * a:9.1f} {1000 * b:9.1f} {ratio:7.3f}   {split}   "
            f"(windows {len(hpcx)}, max |loss hpcx - hand| {loss_gap:.1e})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60, help="measured steps")
    parser.add_argument("--warmup", type=int, default=10, help="steps per round before measuring (one window)")
    parser.add_argument("--strategies", default="none,ddp,fsdp,hsdp")
    parser.add_argument("--lr", type=float, default=3e-4, help="peak LR (tiny-ddp's 1e-2 makes the small GPT diverge, "
                        "and then the two loops' last-bit differences in clipping grow into different trajectories)")
    parser.add_argument("--json", help="also write every window of both loops to this file")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        os._exit(0)
    from hpc.core.spec import Train

    print(f"GPT {args.size}, seq_len {args.seq_len}, global batch {args.global_batch}, lr {args.lr}, {args.steps} "
          f"steps of each loop, interleaved, after {args.warmup} warm-up steps, log_every {Train().log_every} "
          f"(the default); load average {os.getloadavg()[0]:.1f} at start")
    print(f"{'strategy':9s} {'hpcx ms':>9s} {'hand ms':>9s} {'ratio':>7s}   per-phase ms per step, hpcx/hand")
    raw = {}
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in args.strategies.split(","):
            raw[strategy] = run_strategy(Path(tmp), strategy, args)
            print(report_line(strategy, raw[strategy], args.warmup), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end (1, 5, 15 min)")


if __name__ == "__main__":
    main()

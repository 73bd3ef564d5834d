"""The GPU check: what one GPU must prove in at most 8 minutes, from a bare checkout.

    python bench/gpu_check/run.py [--budget-s 420] [--only throughput,resume,staging,strategies,offload,pytest]
                                  [--site-draft FILE]

Needs torch (and CUDA for most parts) and nothing else: it puts the repository root on ``sys.path``
itself (no install step, no submitit), downloads nothing, and prints one table. Parts:

1. ``throughput``: FSDP2 + bf16 + activation checkpointing + compile, GPT 350m, world size 1 on
   NCCL: tokens/s, MFU, peak memory against the planner; the steady steps again under
   ``torch.cuda.set_sync_debug_mode("error")``, without and with a loss mask (no hidden host sync);
   one flight-recorder dump that holds NCCL entries. The MFU also on the planner's basis: the planner's compute time at MFU 1
   over the measured median step (one GPU, no communication, activation checkpointing's recompute
   counted as the planner counts it).
2. ``resume``: FSDP2 with async saves, ``python -m trainer`` preempted by USR2, resumed by a fresh
   process: the losses and grad norms after the resume, and the final model and optimizer state,
   equal an uninterrupted run's bit for bit (dropout on, so the device RNG counts; on a GPU at
   seq_len 1024 with ``train.deterministic``, which bit for bit needs there).
   ``staging``: an async save without a process group right after in-place updates queued on the
   GPU: the saved tensors equal the live ones.
3. ``strategies``: none, ddp, fsdp and fsdp no_shard (world size 1, grad_accum 2, fp32), 5 steps:
   identical initial weights, losses within 1e-3.
4. ``offload``: FSDP2 CPU offload under bf16 and fp16, fused and multi-tensor AdamW: parameters
   pinned, losses as without offload, step time.
5. ``pytest``: ``pytest -m gpu tests/gpu``. The lent machine lacks pytest, and tests/gpu also runs
   ``hpcx submit`` (submitit, click): carry them in the working tree (git ignores the folder; all
   pure Python), made here with ``python -m pip install --target .gpu_check_deps pytest submitit click``
   (check that no torch or numpy landed in it); children get it on ``PYTHONPATH``.

With ``--site-draft FILE`` (a new file; an existing one is refused before anything runs) the parent
writes, after the parts, this machine as a one-GPU local site profile draft whose ``node.mfu`` is the
throughput part's MFU on the planner's basis, with ``node.mfu_source`` saying where it came from
(``hpc.core.site_draft``); where no throughput run measured one (CUDA absent, the part skipped or
failed, the GPU's peak unknown) it says so and writes nothing.

What needs 2 GPUs or 2 nodes is listed as unchecked. Where CUDA is absent it says so in one line,
runs the CPU-possible parts (resume, staging, strategies on gloo) and exits 0 unless one failed.

Every part runs in a child process of its own session, under a deadline; on overrun the whole
process group is killed, so no child keeps the GPU while the next part runs. The remaining budget
is checked before each part and inside it. Everything is written into one temporary folder
(run folders, compile caches, TMPDIR, logs) that is removed at the end whatever happens; no
bytecode is written into the checkout; the requested site draft is the one file left behind.
"""

from __future__ import annotations

import sys

sys.dont_write_bytecode = True  # nothing written into the checkout

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
DEPS = REPO / ".gpu_check_deps"  # what the lent machine lacks (pytest), carried in the working tree
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "L4": 121.0}
CUDA_ABSENT = "CUDA absent: torch.cuda.is_available() is False; running the CPU-possible parts only"


@dataclass(frozen=True)
class Part:
    """One child process: its name, whether it needs CUDA, the least and the most seconds it takes."""

    name: str
    cuda: bool
    min_s: float
    max_s: float


PARTS = (Part("throughput", True, 120, 200), Part("resume", False, 40, 90), Part("staging", False, 15, 40),
         Part("strategies", False, 20, 60), Part("offload", True, 40, 90), Part("pytest", True, 30, 300))
UNCHECKED = ("dp over 2+ GPUs (DataParallel's threads under bf16; dp + compile refused)",
             "ddp / fsdp / hsdp over 2+ GPUs on NCCL (tests/gpu runs them where the GPUs are)",
             "a timed-out collective's flight-recorder dump (2 GPUs)",
             "2 nodes: gloo side groups on GLOO_SOCKET_IFNAME, HSDP across nodes")


def row(part: str, item: str, result: str, status: str) -> dict:
    """One line of the table; status: ok, MISSED, FAILED, skipped or unchecked."""
    return {"part": part, "item": item, "result": result, "status": status}


# ====================================================================== the parent


class Budget:
    """The whole check's deadline."""

    def __init__(self, seconds: float) -> None:
        self.end = time.time() + seconds

    def left(self) -> float:
        return self.end - time.time()


def child_env(tmp: Path) -> dict[str, str]:
    """The children's environment: the checkout (and carried deps) importable, every cache and
    temporary file inside ``tmp``, no rank variables inherited."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "SUBMITIT_EXECUTOR", "SLURM_STEP_ID", "SLURM_PROCID", "TORCHELASTIC_USE_AGENT_STORE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    paths = [str(REPO)] + ([str(DEPS)] if DEPS.is_dir() else [])
    for sub in ("tmp", "inductor", "triton"):
        (tmp / sub).mkdir(exist_ok=True)
    env.update(PYTHONPATH=os.pathsep.join(paths), PYTHONDONTWRITEBYTECODE="1", TMPDIR=str(tmp / "tmp"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"), TRITON_CACHE_DIR=str(tmp / "triton"))
    return env


_children: list[subprocess.Popen] = []  # the part running now, stopped with everything below it on any exit
GRACE_S = 5.0  # SIGTERM first (torchrun then stops its workers), SIGKILL what is left after this


def become_subreaper() -> None:
    """Orphans below this process (torchrun's workers lead sessions of their own, so a group kill misses
    them) are re-parented to it instead of init, so that ``stop_part`` still finds them (Linux)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def process_tree() -> dict[int, int]:
    """pid -> parent pid of every process this one can see."""
    tree = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            tree[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return tree


def below(roots: set[int], tree: dict[int, int]) -> set[int]:
    """``roots`` and every process under them."""
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += [child for child, parent in tree.items() if parent == pid]
    return found


def stop_part(proc: subprocess.Popen, spared: set[int]) -> None:
    """Stop the part's child and everything it started (its group, other sessions, orphans re-parented
    here; not the ``spared`` processes that were below this one before): SIGTERM, then SIGKILL; reap."""
    tree = process_tree()
    orphans = {pid for pid, parent in tree.items() if parent == os.getpid() and pid not in spared}
    running = {proc.pid} if proc.poll() is None else set()  # a reaped child's pid may be another's now
    victims = below(orphans | running, tree) - spared
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in victims:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        end = time.time() + GRACE_S
        while time.time() < end and any(alive(pid) for pid in victims):
            reap(victims)
            time.sleep(0.05)
    proc.wait()
    reap(victims)


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def reap(pids: set[int]) -> None:
    """Collect the exit status of those of ``pids`` that are this process's children and have ended."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def run_part(part: Part, tmp: Path, timeout_s: float) -> list[dict]:
    """Run one part in a child (own session); stopped with all it started past ``timeout_s``."""
    out = tmp / part.name
    out.mkdir()
    spared = below({os.getpid()}, process_tree()) - {os.getpid()}
    with open(out / "log.txt", "w") as log:
        proc = subprocess.Popen(part_command(part.name, out, time.time() + timeout_s), cwd=tmp,
                                env=child_env(tmp), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _children.append(proc)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            if timeout_s < part.max_s:  # cut short by the whole check's budget, not past its own limit
                return [row(part.name, "part", f"stopped at the budget's end after {timeout_s:.0f} s (it may take "
                            f"{part.max_s:.0f} s)", "skipped")]
            return [row(part.name, "part", f"killed after {timeout_s:.0f} s (its deadline)", "FAILED")]
        finally:
            stop_part(proc, spared)  # also whatever it started that is still alive
            _children.remove(proc)
    return part_rows(part, out, proc.returncode)


def part_command(name: str, out: Path, deadline: float) -> list[str]:
    """This script again, as the child that runs part ``name`` into ``out`` until ``deadline``."""
    return [sys.executable, str(Path(__file__).resolve()), "--part", name, "--out", str(out),
            "--deadline", str(deadline)]


def part_rows(part: Part, out: Path, code: int) -> list[dict]:
    """The rows the child wrote, or one FAILED row with the end of its log."""
    result = out / "rows.json"
    if code == 0 and result.is_file():
        return json.loads(result.read_text())
    tail = " | ".join((out / "log.txt").read_text(errors="replace").strip().splitlines()[-4:])[-600:]
    return [row(part.name, "part", f"exit {code}: {tail}", "FAILED")]


def probe(tmp: Path, budget: Budget) -> dict:
    """The device, asked in a child so that this process never holds a CUDA context."""
    rows = run_part(Part("probe", False, 0, 90), tmp, max(1.0, min(90.0, budget.left() - 5)))
    return json.loads(rows[0]["result"]) if rows[0]["status"] == "ok" else {"cuda": False, "error": rows[0]}


def planned(only: list[str], info: dict, budget: Budget, tmp: Path) -> list[dict]:
    """Run the parts in order, each if CUDA allows and the budget still holds its minimum."""
    rows = []
    for part in (p for p in PARTS if p.name in only):
        if part.cuda and not info["cuda"]:
            rows.append(row(part.name, "part", "needs CUDA", "skipped"))
        elif budget.left() - 5 < part.min_s:
            rows.append(row(part.name, "part", f"{budget.left():.0f} s left, needs {part.min_s:.0f} s", "skipped"))
        else:
            rows += run_part(part, tmp, min(part.max_s, budget.left() - 5))
    gpus = info.get("count", 0)
    for item in UNCHECKED:
        covered = gpus >= 2 and "2 nodes" not in item and "pytest" in only
        rows.append(row("multi", item, f"see the pytest part ({gpus} GPUs)" if covered else "needs more hardware",
                        "pytest" if covered else "unchecked"))
    return rows


def one_device_doc(gpu: dict | None) -> dict:
    """This machine as a one-device local site without storage: ``gpu`` (the probe's name, memory_gb and
    peak_tflops) on NCCL, or, with none, gloo."""
    node: dict = {"gpus": 0, "cpus": os.cpu_count() or 1, "intra_link": "none"}
    if gpu:
        node.update(gpus=1, gpu_model=gpu["name"], gpu_memory_gb=round(gpu["memory_gb"], 1),
                    gpu_peak_tflops=gpu["peak_tflops"])
    return {"scheduler": {"kind": "local", "gpu_directive": "none"}, "node": node, "network": {"fabric": "none"}}


def draft_refused(path: Path | None) -> str | None:
    """Why ``--site-draft`` cannot be written there (checked before the parts run); None when it can."""
    if path is None:
        return None
    if path.exists():
        return f"site draft: {path}: exists; a site draft is never written over a file (choose a new name)"
    if not path.parent.is_dir():
        return f"site draft: {path}: its folder {path.parent} does not exist"
    return None


def write_site_draft(path: Path, rows: list[dict], info: dict) -> tuple[str, bool]:
    """This machine's site draft with the throughput part's planner-basis MFU (``hpc.core.site_draft``):
    the line saying what was written, or why nothing was, and whether that is a failure."""
    from hpc.core.config import ConfigError
    from hpc.core.site import parse_site
    from hpc.core.site_draft import write_draft

    measured = [r for r in rows if r["part"] == "throughput" and r.get("mfu")]
    if not measured or not info.get("cuda"):
        return f"site draft: not written (no throughput run measured an MFU): {path}", False
    try:
        site = parse_site(one_device_doc(info), "gpu-check", "<gpu_check>")
        drafted = write_draft(path, site, measured[-1]["mfu"], measured[-1]["mfu_source"])
    except (ConfigError, OSError) as exc:
        why = "; ".join(exc.messages) if isinstance(exc, ConfigError) else str(exc)
        return f"site draft: not written ({why}): {path}", True
    return f"site draft: {path}: node.mfu = {drafted.node.mfu} ({drafted.node.mfu_source})", False


def table(rows: list[dict]) -> str:
    """The rows as one aligned text table."""
    head = {"part": "part", "item": "item", "result": "result", "status": "status"}
    widths = {k: min(60 if k != "result" else 200, max(len(str(r[k])) for r in [head, *rows])) for k in head}
    lines = ["  ".join(str(r[k])[:widths[k]].ljust(widths[k]) for k in ("part", "item", "status", "result"))
             for r in [head, *rows]]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.part:
        return child_main(args)
    unknown = set(args.only.split(",")) - {p.name for p in PARTS}
    if unknown:
        print(f"unknown parts {sorted(unknown)}: expected some of {', '.join(p.name for p in PARTS)}")
        return 2
    if draft_refused(args.site_draft):
        print(draft_refused(args.site_draft))
        return 2
    budget, start = Budget(args.budget_s), time.monotonic()
    become_subreaper()
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))  # so that the finally below still runs
    tmp = Path(tempfile.mkdtemp(prefix="hpcx-gpu-check-"))
    try:
        info = probe(tmp, budget)
        failed = [info.pop("error")] if "error" in info else []
        print(describe(info, args.budget_s) if info["cuda"] else CUDA_ABSENT if not failed else
              f"the device probe failed: {failed[0]['result']}", flush=True)
        rows = failed + planned(args.only.split(","), info, budget, tmp)
    finally:
        for proc in list(_children):
            stop_part(proc, set())
        shutil.rmtree(tmp, ignore_errors=True)
    print(table(rows))
    line, draft_failed = write_site_draft(args.site_draft, rows, info) if args.site_draft else ("", False)
    if line:
        print(line)
    print(f"wall {time.monotonic() - start:.0f} s of a {args.budget_s:.0f} s budget")
    return 1 if draft_failed or any(r["status"] in ("FAILED", "MISSED") for r in rows) else 0


def describe(info: dict, budget_s: float) -> str:
    peak = info.get("peak_tflops") or "unknown"
    return (f"{info['name']} × {info['count']}, {info['memory_gb']:.0f} GB, bf16 peak {peak} TFLOP/s; "
            f"torch {info['torch']}; budget {budget_s:.0f} s")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=420.0, help="the whole check's deadline")
    parser.add_argument("--only", default=",".join(p.name for p in PARTS), help="comma-separated parts")
    parser.add_argument("--site-draft", type=Path, default=None, metavar="FILE",
                        help="write this machine's site profile draft with the measured node.mfu here (a new file)")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # a child: run this part
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ====================================================================== a child: one part


@dataclass
class Ctx:
    """What a part works with: its folder, its device, its deadline."""

    out: Path
    device: object  # torch.device
    deadline: float

    def left(self) -> float:
        return self.deadline - time.time()

    def check(self, what: str) -> None:
        """Stop the part (its row says where) once its deadline has passed."""
        if self.left() <= 0:
            raise TimeoutError(f"deadline passed during {what}")


def child_main(args: argparse.Namespace) -> int:
    import torch

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx = Ctx(args.out, device, args.deadline)
    try:
        rows = CHILD_PARTS[args.part](ctx)
    except Exception as exc:  # noqa: BLE001  (the part's one row says what broke)
        rows = [row(args.part, "part", f"{type(exc).__name__}: {str(exc)[-500:]}", "FAILED")]
    (args.out / "rows.json").write_text(json.dumps(rows))
    sys.stdout.flush()
    os._exit(0)  # skip native teardown (NCCL, gloo) once the rows are written


def part_probe(ctx: Ctx) -> list[dict]:
    import torch

    info: dict = {"cuda": torch.cuda.is_available(), "torch": torch.__version__, "count": 0}
    if info["cuda"]:
        info.update(device_facts(), count=torch.cuda.device_count())
    return [row("probe", "device", json.dumps(info), "ok")]


def device_facts() -> dict:
    """GPU 0's name, memory (GB) and dense bf16 peak, as the probe reports them and ``one_device_doc`` reads them."""
    import torch

    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "memory_gb": props.total_memory / 1e9, "peak_tflops": peak_tflops(props.name)}


def peak_tflops(name: str) -> float:
    """Dense bf16 peak of a known GPU model (0: unknown, MFU left out)."""
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0)


# ---------------------------------------------------------------- run folders and trainers


def site_doc(ctx: Ctx) -> dict:
    """This machine as a one-device local site (one GPU: NCCL; none: gloo), its runs in the part's folder."""
    doc = one_device_doc(device_facts() if ctx.device.type == "cuda" else None)
    return {**doc, "storage": {"run_root": str(ctx.out)}}


def make_run(ctx: Ctx, name: str, overrides: list[str]) -> Path:
    """A run folder resolved as ``hpcx submit`` resolves it, for this one-device machine."""
    from hpc.core.resolve import resolved_document
    from hpc.core.site import parse_site
    from hpc.core.spec import load_spec
    from hpc.plan.resolve import resolve

    spec = load_spec(REPO / "jobs" / "tiny-ddp.toml", [
        "job.tasks_per_node=1", "train.log_every=1", "train.warmup_steps=2", "train.warmup_metrics_steps=2",
        "parallel.timeout_s=120", *overrides])
    site = parse_site(site_doc(ctx), "gpu-check", "<gpu_check>")
    run_dir = ctx.out / name
    for sub in ("logs", "checkpoints"):
        (run_dir / sub).mkdir(parents=True)
    doc = resolved_document(spec, site, resolve(spec, site), str(run_dir))
    (run_dir / "resolved.json").write_text(json.dumps(doc))
    return run_dir


def start_group(ctx: Ctx, run_dir: Path) -> None:
    """The one-process group FSDP and DDP need, flight recorder on (NCCL on a GPU, gloo on the CPU)."""
    import torch.distributed as dist

    from trainer.dist import apply_nccl_trace, init_single, open_side_groups

    if dist.is_initialized():
        return
    if ctx.device.type == "cuda":
        apply_nccl_trace(run_dir)
    init_single("nccl" if ctx.device.type == "cuda" else "gloo", 120, ctx.device)
    open_side_groups(120, async_saves=True)


def build(ctx: Ctx, run_dir: Path):
    """``build_trainer`` on this run folder, in this process."""
    from trainer.run import load_run
    from trainer.train import build_trainer

    start_group(ctx, run_dir)
    trainer, _ = build_trainer(load_run(run_dir), 0, ctx.device)
    return trainer


def one_step(trainer, batches) -> None:
    """One optimizer step of the trainer's own ``train_step`` (no logging, no boundary)."""
    from trainer.loop import train_step

    train_step(trainer, [next(batches) for _ in range(trainer.sampler.grad_accum)])
    trainer.sampler.advance()


# ---------------------------------------------------------------- 1. throughput


MICRO = 8  # 350m × 2048 tokens × 8 per step, activation checkpointing on: well inside one H100/H200


THROUGHPUT = ["model.size='350m'", "model.seq_len=2048", f"train.global_batch={MICRO}", f"train.micro_batch={MICRO}",
              "parallel.strategy='fsdp'", "parallel.mixed_precision='bf16'", "parallel.activation_checkpointing=true",
              "parallel.compile=true", "train.steps=1000"]


def part_throughput(ctx: Ctx) -> list[dict]:
    run_dir = make_run(ctx, "throughput", THROUGHPUT)
    t = build(ctx, run_dir)
    batches = iter(t.loader)
    for _ in range(3):  # compilation, allocator warm-up
        one_step(t, batches)
        ctx.check("the compile steps")
    seconds = timed_steps(ctx, t, batches, 8)
    rows = rate_rows(t, run_dir, seconds)
    rows.append(planner_row(run_dir, statistics.median(seconds)))
    rows.append(sync_row(ctx, t, batches))
    rows.append(flight_recorder_row())
    return rows


def timed_steps(ctx: Ctx, t, batches, steps: int) -> list[float]:
    """Seconds of each step, by CUDA events (the host returns long before the GPU is done)."""
    import torch

    times = []
    for _ in range(steps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        one_step(t, batches)
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1000)
        ctx.check("the timed steps")
    return times


def rate_rows(t, run_dir: Path, seconds: list[float]) -> list[dict]:
    import torch

    from trainer.metrics import mfu

    rate = t.tokens_per_step / statistics.median(seconds)
    util = mfu(t.flops_per_token, rate, 1, t.peak_tflops)
    measured, predicted = torch.cuda.max_memory_allocated() / 1e9, predicted_gb(run_dir)
    rows = [row("throughput", "GPT 350m FSDP2 bf16+AC+compile, 8 × 2048", f"{rate:,.0f} tokens/s, step "
                f"{1000 * statistics.median(seconds):.0f} ms", "ok"),
            row("throughput", "MFU", f"{100 * util:.1f}%" if util else "unknown (GPU peak not in the table)", "ok")]
    if predicted:
        ratio = measured / predicted
        rows.append(row("throughput", "peak memory vs plan", f"{measured:.1f} GB measured, {predicted:.1f} GB "
                        f"planned: {ratio:.2f}", "ok" if abs(ratio - 1) <= 0.10 else "MISSED"))
    else:
        rows.append(row("throughput", "peak memory vs plan", f"{measured:.1f} GB; the plan has no row", "MISSED"))
    return rows


def resolved(run_dir: Path) -> tuple[dict, object, object]:
    """The run folder's resolved document, its spec and its site (JobSpec, SiteProfile)."""
    from hpc.core.site import parse_site
    from hpc.core.spec import spec_from_dict

    doc = json.loads((run_dir / "resolved.json").read_text())
    site = {k: v for k, v in doc["site"].items() if k in ("scheduler", "node", "network", "storage", "nccl")}
    return doc, spec_from_dict(doc["spec"]), parse_site(site, "gpu-check", "<gpu_check>")


def planner_row(run_dir: Path, step_s: float) -> dict:
    """The MFU on the planner's basis: its compute time at MFU 1 over the measured median step (one GPU, no
    communication, the recompute counted as it counts it); with ``mfu`` and ``mfu_source`` for ``--site-draft``."""
    from hpc.core.models import model_facts
    from hpc.plan import compute_seconds, setup_of

    _, spec, site = resolved(run_dir)
    at_peak = compute_seconds(model_facts(spec.model), setup_of(spec, site, 1), site, 1.0)
    item = "MFU on the planner's basis (--site-draft)"
    if not at_peak or step_s <= 0:
        return row("throughput", item, "unknown (GPU peak not in the table)", "ok")
    mfu = at_peak / step_s
    source = (f"bench/gpu_check on one {site.node.gpu_model}, {time.strftime('%Y-%m-%d')}: GPT {spec.model.size} "
              f"FSDP2 bf16+AC+compile, micro {spec.train.micro_batch} x {spec.model.seq_len}, "
              f"step {step_s * 1e3:.1f} ms")
    return {**row("throughput", item, f"{100 * mfu:.1f}% (the planner's compute at MFU 1 / the measured step, "
                  "recompute counted)", "ok"), "mfu": mfu, "mfu_source": source}


def predicted_gb(run_dir: Path) -> float | None:
    """The planner's per-rank estimate (without headroom) for the layout this run uses (``launch_row``:
    FSDP at world size 1, which the plan itself does not list; its ``none`` row holds gradients and
    autocast copies an FSDP2 bf16 run does not)."""
    from hpc.core.resolve import Launch
    from hpc.plan import launch_row

    doc, spec, site = resolved(run_dir)
    memory = launch_row(spec, site, Launch.from_dict(doc["launch"])).memory
    return memory.total if memory else None


def sync_row(ctx: Ctx, t, batches) -> dict:
    """Three steady steps under CUDA's sync detector, then three with a loss mask (pinned, as the loader
    pins a masked dataset's pairs): any host sync raises."""
    import torch

    item = "steady steps under set_sync_debug_mode('error')"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for source in (batches, masked(batches)):
            for _ in range(3):
                one_step(t, source)
                ctx.check("the sync-checked steps")
    except RuntimeError as exc:
        return row("throughput", item, str(exc).splitlines()[0][:300], "MISSED")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return row("throughput", item, "3 steps, 3 more with a loss mask: no host sync", "ok")


def masked(batches):
    """The loader's batches with a loss mask beside them, in pinned memory: half the targets counted."""
    import torch

    gen = torch.Generator().manual_seed(0)
    for tokens in batches:
        yield tokens, (torch.rand(tokens.shape, generator=gen) < 0.5).pin_memory()


def flight_recorder_row() -> dict:
    """One on-demand flight-recorder dump: the collectives of the steps must be in it."""
    import pickle

    import torch
    import torch.distributed as dist

    from hpc import compat

    dist.all_reduce(torch.ones(1, device="cuda"))
    torch.cuda.synchronize()
    which, dump = compat.dump_flight_recorder()
    entries = pickle.loads(dump).get("entries", [])
    names = sorted({e.get("profiling_name", "?") for e in entries})[:4]
    nccl = [n for n in names if "nccl" in n.lower()]
    return row("throughput", f"flight-recorder dump ({which} recorder)", f"{len(entries)} entries "
               f"({', '.join(names)})", "ok" if which == "nccl" and entries and nccl else "MISSED")


# ---------------------------------------------------------------- 2. preempt and resume; staging


RESUME_SEQ = 1024  # where flash attention's backward adds its key blocks with atomics unless told not to


def resume_overrides(ctx: Ctx) -> list[str]:
    """FSDP2, async saves every 5 steps, dropout on (the device RNG must resume too), deterministic kernels
    (bit for bit on a GPU needs them: docs/checkpoints.md), 30 steps: long enough that the USR2 sent once
    step 4 is logged lands well before the end, even where a step takes milliseconds. On a GPU at
    ``RESUME_SEQ`` tokens, where the attention backward would otherwise differ in the last bits."""
    size = ["model.size='small'", f"model.seq_len={RESUME_SEQ}", "train.micro_batch=4", "train.global_batch=4"]
    if ctx.device.type != "cuda":
        size = ["model.size='tiny'", "train.micro_batch=2", "train.global_batch=2"]
    return [*size, "parallel.strategy='fsdp'", "model.dropout=0.1", "checkpoint.async_save=true",
            "checkpoint.interval_steps=5", "train.steps=30", "train.deterministic=true"]


def trainer_process(ctx: Ctx, run_dir: Path, usr2_at: int | None = None) -> int:
    """``python -m trainer RUN`` as a user runs it; with ``usr2_at``, USR2 once that step is logged.
    Killed (and the part failed) at the part's deadline."""
    with open(run_dir / "logs" / "stdout.txt", "a") as log:
        proc = subprocess.Popen([sys.executable, "-m", "trainer", str(run_dir)], stdout=log,
                                stderr=subprocess.STDOUT, cwd=ctx.out)
    try:
        while proc.poll() is None:
            if usr2_at is not None and logged_steps(run_dir) and logged_steps(run_dir)[-1] >= usr2_at:
                proc.send_signal(signal.SIGUSR2)
                usr2_at = None
            if ctx.left() <= 0:
                raise TimeoutError(f"{run_dir.name}: the trainer outlived the part's deadline")
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode


def logged_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in metrics(run_dir)]


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def part_resume(ctx: Ctx) -> list[dict]:
    reference, resumed = (make_run(ctx, name, resume_overrides(ctx)) for name in ("uninterrupted", "resumed"))
    codes = [trainer_process(ctx, reference), trainer_process(ctx, resumed, usr2_at=4)]
    stop = ledger(resumed)[-1]
    codes.append(trainer_process(ctx, resumed))
    starts = [e for e in ledger(resumed) if e.get("event") == "start"]
    if any(codes) or stop.get("reason") != "preempted" or len(starts) != 2:
        return [row("resume", "preempted and resumed", f"exit codes {codes}, stop {stop}", "FAILED")]
    return [losses_row(reference, resumed, int(starts[-1]["step"])), state_row(reference, resumed),
            resume_setup_row(resumed)]


def resume_setup_row(run_dir: Path) -> dict:
    """What the bit-for-bit rows were measured on: the sequence length and the kernel choice."""
    from hpc.core.models import model_facts

    _, spec, _ = resolved(run_dir)
    return row("resume", "sequence length, deterministic kernels", f"seq_len {model_facts(spec.model).seq_len}, "
               f"train.deterministic = {str(spec.train.deterministic).lower()}",
               "ok" if spec.train.deterministic else "MISSED")


def ledger(run_dir: Path) -> list[dict]:
    path = run_dir / "ledger.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def losses_row(reference: Path, resumed: Path, step: int) -> dict:
    """The logged loss and grad norm of every step after the resume, against the uninterrupted run."""
    ref = {r["step"]: (r["loss"], r["grad_norm"]) for r in metrics(reference)}
    after = {r["step"]: (r["loss"], r["grad_norm"]) for r in metrics(resumed) if r["step"] > step}
    same = bool(after) and all(ref.get(s) == v for s, v in after.items())
    worst = max((abs(ref[s][0] - v[0]) for s, v in after.items() if s in ref), default=float("nan"))
    return row("resume", f"USR2 at step {step}, a fresh process: steps {min(after, default=0)}-"
               f"{max(after, default=0)}", "losses and grad norms bit for bit" if same else
               f"differ (largest loss difference {worst:.3g})", "ok" if same else "MISSED")


def state_row(reference: Path, resumed: Path) -> dict:
    """The final checkpoints' model and optimizer tensors (every step after the resume included)."""
    import torch

    from hpc.ckpt.dcp import DcpReader
    from trainer.checkpoint import latest_checkpoint

    a, b = DcpReader(latest_checkpoint(reference)), DcpReader(latest_checkpoint(resumed))
    keys = sorted(k for k in a.entries if k.startswith(("model.", "optim.")))
    differ = [k for k in keys if not _same(a.read(k), b.read(k), torch)]
    a.close()
    b.close()
    return row("resume", "final model + optimizer state", f"{len(keys)} entries, {len(differ)} differ "
               f"{differ[:3] if differ else ''}".strip(), "ok" if keys and not differ else "MISSED")


def _same(x, y, torch) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    return x == y


def part_staging(ctx: Ctx) -> list[dict]:
    """Async saves with no process group, each right after in-place updates still queued on the GPU."""
    import torch
    from torch import nn

    from hpc.ckpt.dcp import DcpReader
    from trainer.checkpoint import Checkpointer

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).to(ctx.device)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(64, 1024, device=ctx.device)).square().mean().backward()
    optimizer.step()
    differ, saves, checkpointer = 0, 3, Checkpointer(ctx.out / "staging", keep=2, async_save=True)
    for step in range(1, saves + 1):
        keep_gpu_busy(ctx.device)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # the step that is still running when the save starts
        path = checkpointer.save(step, model, optimizer, None, {"tokens_seen": 0})
        checkpointer.wait_staged()
        live = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        checkpointer.wait()
        reader = DcpReader(path)
        differ += sum(not torch.equal(reader.read(f"model.{k}"), v) for k, v in live.items())
        reader.close()
        ctx.check("the staging saves")
    return [row("staging", f"async save without a process group ({ctx.device.type}), {saves} saves",
                f"{differ} of {saves * len(live)} saved tensors differ from the live ones",
                "ok" if not differ else "MISSED")]


def keep_gpu_busy(device) -> None:
    """Queue ~0.1 s of matmuls, so that the next kernels run well after the host moved on."""
    import torch

    if device.type != "cuda":
        return
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(50):
        b = a @ a
    del a, b


# ---------------------------------------------------------------- 3. strategies agree


STRATEGIES = (("none", "full_shard"), ("ddp", "full_shard"), ("fsdp", "full_shard"), ("fsdp", "no_shard"))


def part_strategies(ctx: Ctx) -> list[dict]:
    """The same seed, 5 steps of grad_accum 2 in fp32, under each strategy at world size 1."""
    from trainer.loop import TrainState, train

    losses, states = {}, {}
    for strategy, sharding in STRATEGIES:
        name = strategy if sharding == "full_shard" else f"{strategy}-{sharding}"
        run_dir = make_run(ctx, name, [
            "train.steps=5", "train.global_batch=4", "train.micro_batch=2", "parallel.mixed_precision='none'",
            f"parallel.strategy={strategy!r}", f"parallel.sharding={sharding!r}", "train.seed=7"])
        t = build(ctx, run_dir)
        states[name] = full_state(t.model)
        losses[name] = train(t, TrainState())["losses"]
        ctx.check(f"strategy {name}")
    same_init = [n for n in states if not same_state(states["none"], states[n])]
    worst = max(abs(a - b) for n in losses for a, b in zip(losses[n], losses["none"]))
    return [row("strategies", "identical initial weights", ", ".join(states) if not same_init else
                f"differ: {same_init}", "ok" if not same_init else "MISSED"),
            row("strategies", "5 steps, grad_accum 2: losses agree", f"largest difference from none {worst:.2e} "
                "(≤ 1e-3)", "ok" if worst <= 1e-3 and all(len(v) == 5 for v in losses.values()) else "MISSED")]


def full_state(model) -> dict:
    """The whole (unsharded) model state on the CPU, by its wrapper-free names."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def same_state(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- 4. CPU offload


def part_offload(ctx: Ctx) -> list[dict]:
    """FSDP2 with and without CPU offload, bf16 and fp16, fused and multi-tensor AdamW: 4 steps each."""
    rows = []
    for precision in ("bf16", "fp16"):
        for fused in (True, False):
            rows.append(offload_row(ctx, precision, fused))
            ctx.check(f"offload {precision}")
    return rows


def offload_row(ctx: Ctx, precision: str, fused: bool) -> dict:
    kind = "fused" if fused else "multi-tensor"
    try:
        plain, _, _ = offload_run(ctx, precision, fused, offload=False)
        losses, step_s, pinned = offload_run(ctx, precision, fused, offload=True)
    except RuntimeError as exc:
        known = precision == "fp16" and fused and "broadcast shape" in str(exc)
        return row("offload", f"{precision}, {kind} AdamW", ("fails as documented in trainer.optim (ShardedGradScaler"
                   "'s found_inf); the trainer uses multi-tensor" if known else str(exc)[:300]),
                   "ok" if known else "FAILED")
    worst = max(abs(a - b) for a, b in zip(losses, plain))
    good = pinned and worst <= 1e-3 and len(losses) == len(plain) == 4
    return row("offload", f"{precision}, {kind} AdamW", f"pinned: {pinned}; losses vs no offload: largest "
               f"difference {worst:.2e}; step {1000 * step_s:.0f} ms", "ok" if good else "MISSED")


def offload_run(ctx: Ctx, precision: str, fused: bool, offload: bool) -> tuple[list[float], float, bool]:
    """(losses, median step seconds, every parameter in pinned host memory) of one 4-step run."""
    from trainer.loop import TrainState, train
    from trainer.run import load_run

    name = f"offload-{precision}-{'fused' if fused else 'multi'}-{'on' if offload else 'off'}"
    run_dir = make_run(ctx, name, offload_overrides(precision, offload))
    t = build(ctx, run_dir)
    with_optimizer(t, fused, load_run(run_dir).spec.train)
    pinned = all(p.to_local().is_pinned() for p in t.model.parameters()) if offload else True
    result = train(t, TrainState())
    return result["losses"], result["step_time_s"], pinned


def offload_overrides(precision: str, offload: bool) -> list[str]:
    """FSDP2 (world size 1) of the 125m GPT for 4 steps, with or without CPU offload."""
    return ["model.size='125m'", "model.seq_len=256", "train.micro_batch=4", "train.global_batch=4", "train.steps=4",
            "parallel.strategy='fsdp'", f"parallel.mixed_precision={precision!r}",
            f"parallel.cpu_offload={str(offload).lower()}"]


def with_optimizer(t, fused: bool, train_spec) -> None:
    """The trainer's AdamW as the fused or the multi-tensor kernel: same groups, settings and schedule."""
    import torch

    from trainer.optim import build_scheduler

    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in t.optimizer.param_groups]
    t.optimizer = torch.optim.AdamW(groups, lr=train_spec.lr, betas=tuple(train_spec.betas), fused=fused,
                                    foreach=None if fused else True)
    t.scheduler = build_scheduler(t.optimizer, train_spec)


# ---------------------------------------------------------------- 5. pytest -m gpu


def part_pytest(ctx: Ctx) -> list[dict]:
    """``pytest -m gpu tests/gpu`` (but not the test that runs this check's parts again), for as long as
    the part's deadline allows: stopped there, the tests that ran are counted."""
    import importlib.util

    item = "pytest -m gpu tests/gpu"
    if importlib.util.find_spec("pytest") is None:
        return [row("pytest", item, f"pytest is not importable: carry {DEPS.name}/ "
                    f"(python -m pip install --target {DEPS.name} pytest submitit click)", "unchecked")]
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-rfE", "-p", "no:cacheprovider",
           "--ignore=tests/gpu/test_check_parts.py", f"--basetemp={ctx.out / 'pytest'}"]
    log = ctx.out / "pytest.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = proc.wait(timeout=max(1.0, ctx.left() - 10))
    except subprocess.TimeoutExpired:
        stop_pytest(proc)
        passed, failed, skipped = progress_counts(log.read_text(errors="replace"))
        return [row("pytest", item, f"stopped at the deadline: {passed} passed, {failed} failed, {skipped} skipped "
                    "so far", "FAILED" if failed else "skipped")]
    summary = (log.read_text(errors="replace").strip().splitlines() or ["(no output)"])[-1]
    return [row("pytest", item, summary[:300], "ok" if code == 0 else "FAILED")]


def stop_pytest(proc: subprocess.Popen) -> None:
    """SIGTERM pytest's group (its torchrun agents then stop their workers), SIGKILL after GRACE_S."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        try:
            proc.wait(timeout=GRACE_S)
            break
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def progress_counts(text: str) -> tuple[int, int, int]:
    """(passed, failed or errors, skipped) from pytest -q's progress characters so far."""
    marks = "".join(line.split("[")[0].strip() for line in text.splitlines()
                    if line.rstrip().endswith("%]") or set(line.strip()) <= set(".FEsx"))
    return marks.count("."), marks.count("F") + marks.count("E"), marks.count("s")


CHILD_PARTS = {"probe": part_probe, "throughput": part_throughput, "resume": part_resume, "staging": part_staging,
               "strategies": part_strategies, "offload": part_offload, "pytest": part_pytest}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The pre-flight check at a job's start (``health.preflight``): the decisions, from every rank's results.

Before the first step each rank checks its device (``trainer.preflight``: visible, a small matmul right,
its memory as the site profile says) and then times two things across all ranks: an all-reduce of a few
MB (its bus bandwidth, nccl-tests' ``algbw × 2(n−1)/n``, against the site's expected figure) and, on a job
of several nodes, a shift to the next node and one to the previous (what each rank receives from its
neighbours, against the inter-node link's share of one rank). Here, torch-free and pure: the formulas, the
floors, and which nodes to blame:

- a node with a failed device check, or whose ranks never posted their results (stuck: the check's
  timeout), is to blame;
- a node whose ranks receive below the floor from *both* neighbours is to blame (a slow link between two
  nodes slows one direction of each; a slow node slows both of its own);
- a failure on every node is the fabric's (or the partition's), never a node's: nobody is excluded, and
  a slow fabric only warns;
- at most ``max(1, health.exclude_nodes)`` nodes are named, the worst first (a failed device or a stuck
  rank before a slow one, the slowest first, then by name).

A one-node job's all-reduce runs over that node's own links: below the floor, the node is to blame.
"""

from __future__ import annotations

import statistics
import typing as tp
from dataclasses import dataclass, field

MEMORY_TOLERANCE = 0.10  # a GPU may report this much less than the site's nominal memory
NBYTES = 4 * 2**20  # the all-reduce's size: a few MB, enough to leave the latency-bound regime


class PreflightFailed(RuntimeError):
    """The check named nodes that failed it: the job is requeued without them (a node fault). ``reported``:
    the blamed ranks' failure reports are already written (``trainer.preflight``)."""

    def __init__(self, message: str, verdict: dict[str, tp.Any] | None = None, reported: bool = False) -> None:
        super().__init__(message)
        self.verdict = verdict or {}
        self.reported = reported


@dataclass(frozen=True)
class Expected:
    """What the site profile promises: the all-reduce's bus bandwidth and one rank's share of the link to
    another node, GB/s (0: unknown: only logged)."""

    allreduce_gbs: float = 0.0
    link_gbs: float = 0.0


@dataclass
class Verdict:
    """``ok``: train. ``blamed``: node → why (the job is requeued without them). ``warning``: a fabric
    problem no node is to blame for (training starts). ``busbw_gbs``: the measured bus bandwidth."""

    blamed: dict[str, str] = field(default_factory=dict)
    warning: str = ""
    busbw_gbs: float | None = None
    failed: bool = False  # set with no node blamed: every node failed its device check
    expected_gbs: float = 0.0  # the site's all-reduce figure it was held against (0: none)
    shift: int = 0  # ranks per node for the shifts across nodes (0: none: one node, or uneven blocks)

    @property
    def ok(self) -> bool:
        return not self.blamed and not self.failed

    def words(self) -> str:
        """``preflight: n7 failed: cuda:3 matmul wrong; n9 failed: …``."""
        return "; ".join(f"preflight: {node} failed: {why}" for node, why in self.blamed.items())


# ---------------------------------------------------------------- formulas


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> float:
    """nccl-tests' all-reduce bus bandwidth in GB/s: ``nbytes / seconds`` (algbw) × 2(n−1)/n; 0 alone."""
    if world <= 1 or seconds <= 0:
        return 0.0
    return nbytes / seconds / 1e9 * 2 * (world - 1) / world


def expected(gpus: int, intra_gbs: float, network_gbs: float, nodes: int, local_world: int) -> Expected:
    """The site's figures for a job of ``nodes`` × ``local_world`` ranks: inside one node the intra-node
    bus bandwidth (GPU sites only); across nodes the slower of it and the node's injection bandwidth
    (``network.bandwidth_gbs``), and each rank's share of the latter for the shifts."""
    intra = intra_gbs if gpus and local_world > 1 else 0.0
    if nodes <= 1:
        return Expected(allreduce_gbs=intra)
    inter = min(network_gbs, intra) if intra else network_gbs
    return Expected(allreduce_gbs=inter, link_gbs=network_gbs / max(1, local_world))


def memory_problem(total_bytes: int, expected_gb: float, tolerance: float = MEMORY_TOLERANCE) -> str:
    """Words when a GPU holds less memory than the site says (beyond ``tolerance``); "" when fine or unknown."""
    if expected_gb <= 0 or total_bytes >= (1 - tolerance) * expected_gb * 1e9:
        return ""
    return f"memory {total_bytes / 1e9:.1f} GB, expected {expected_gb:g} GB"


def floor_words(measured: float, floor: float, of: float) -> str:
    return f"{measured:.3g} GB/s, expected ≥ {floor:.3g} GB/s of {of:.3g} GB/s"


# ---------------------------------------------------------------- nodes and ranks


def nodes_of(results: tp.Sequence[dict]) -> dict[str, list[int]]:
    """Host → its ranks, in the order hosts first appear."""
    found: dict[str, list[int]] = {}
    for r in sorted(results, key=lambda r: r["rank"]):
        found.setdefault(str(r["host"]), []).append(int(r["rank"]))
    return found


def shift_peers(hosts: tp.Sequence[str]) -> tuple[int, int] | None:
    """(ranks per node, nodes) when the ranks sit in equal contiguous blocks per node over several nodes:
    the shifts then pair rank r with r ± ranks per node. None otherwise (no shifts)."""
    order = list(dict.fromkeys(hosts))
    if len(order) < 2 or len(hosts) % len(order):
        return None
    per = len(hosts) // len(order)
    same = all(hosts[i] == order[i // per] for i in range(len(hosts)))
    return (per, len(order)) if same else None


def node_receive(results: tp.Sequence[dict]) -> dict[str, float]:
    """Host → what its slowest rank received from its better neighbour, GB/s (the larger of the two
    shifts: a node is slow when both of its own directions are). Ranks without shift figures are left out."""
    found: dict[str, float] = {}
    for r in results:
        if isinstance(r.get("fwd_gbs"), (int, float)) and isinstance(r.get("bwd_gbs"), (int, float)):
            best = max(float(r["fwd_gbs"]), float(r["bwd_gbs"]))
            found[str(r["host"])] = min(best, found.get(str(r["host"]), best))
    return found


def allreduce_seconds(results: tp.Sequence[dict]) -> float | None:
    """The slowest rank's median all-reduce time (every rank waits for the slowest); None when any is missing."""
    times = [r.get("allreduce_s") for r in results]
    if not times or any(not isinstance(t, (int, float)) for t in times):
        return None
    return max(float(t) for t in times)  # type: ignore[arg-type]  # checked above


def median(values: tp.Sequence[float]) -> float:
    return float(statistics.median(values))


# ---------------------------------------------------------------- the verdict


def verdict(results: tp.Sequence[dict], missing: tp.Mapping[int, str], want: Expected, fraction: float,
            cap: int, nbytes: int = NBYTES) -> Verdict:
    """The check's outcome from the ranks' ``results`` (rank, host, ``device``: None or what failed,
    ``allreduce_s``, ``fwd_gbs``/``bwd_gbs``) and the ranks that posted nothing (``missing``: rank → host)."""
    hosts = nodes_of([*results, *({"rank": r, "host": h} for r, h in missing.items())])
    hard = hard_failures(results, missing)
    if hard:
        return decide(hard, {}, list(hosts), cap, failed_alone=True)
    world = len(results)
    seconds = allreduce_seconds(results)
    busbw = bus_bandwidth(nbytes, seconds, world) if seconds is not None else None
    slow = slow_nodes(results, want, fraction)
    out = decide({}, slow, list(hosts), cap, failed_alone=False)
    out.busbw_gbs = None if busbw is None else round(busbw, 3)
    if out.blamed or busbw is None or not want.allreduce_gbs:
        return out
    least = fraction * want.allreduce_gbs
    if busbw < least:
        words = f"all-reduce {floor_words(busbw, least, want.allreduce_gbs)}"
        if len(hosts) == 1:
            out.blamed = {next(iter(hosts)): words}
        else:
            out.warning = out.warning or f"preflight: {words} on {len(hosts)} nodes: the fabric, no one node"
    return out


def hard_failures(results: tp.Sequence[dict], missing: tp.Mapping[int, str]) -> dict[str, str]:
    """Host → why, for failed device checks and ranks that posted nothing."""
    found: dict[str, str] = {}
    for r in sorted(results, key=lambda r: r["rank"]):
        if r.get("device") or r.get("error"):
            found.setdefault(str(r["host"]), str(r.get("device") or r.get("error")))
    for rank, host in sorted(missing.items()):
        found.setdefault(host, f"rank {rank} did not finish the check in time (stuck or gone)")
    return found


def slow_nodes(results: tp.Sequence[dict], want: Expected, fraction: float) -> dict[str, tuple[float, str]]:
    """Host → (its figure, why) for nodes receiving below the link floor from both neighbours."""
    if not want.link_gbs:
        return {}
    least = fraction * want.link_gbs
    return {host: (gbs, f"receives {floor_words(gbs, least, want.link_gbs)} from its neighbours")
            for host, gbs in node_receive(results).items() if gbs < least}


def decide(hard: tp.Mapping[str, str], slow: tp.Mapping[str, tuple[float, str]], hosts: tp.Sequence[str],
           cap: int, failed_alone: bool) -> Verdict:
    """Blame the worst ``max(1, cap)`` of the failing nodes, unless every node of a multi-node job fails
    (the fabric's or the partition's fault): then a hard failure fails with no node blamed, slowness warns."""
    failing = set(hard) | set(slow)
    if not failing:
        return Verdict()
    if len(hosts) > 1 and failing >= set(hosts):
        if failed_alone:
            return Verdict(failed=True, warning=f"preflight: every node failed (e.g. {next(iter(hard.values()))}): "
                                                "not one node's fault")
        return Verdict(warning=f"preflight: every node is slow ({len(hosts)} nodes): the fabric, no one node")
    ranked = sorted(hard, key=lambda h: (hosts.index(h) if h in hosts else 0, h))
    ranked += sorted((h for h in slow if h not in hard), key=lambda h: (slow[h][0], h))
    reasons = {**{h: why for h, (_, why) in slow.items()}, **hard}
    return Verdict(blamed={h: reasons[h] for h in ranked[:max(1, cap)]})


def blamed_ranks(results: tp.Sequence[dict], missing: tp.Mapping[int, str], found: Verdict) -> list[int]:
    """The ranks of the blamed nodes, in order."""
    everyone = [*results, *({"rank": r, "host": h} for r, h in missing.items())]
    return sorted(int(r["rank"]) for r in everyone if str(r["host"]) in found.blamed)

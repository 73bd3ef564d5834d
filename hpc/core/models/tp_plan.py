"""A family's tensor-parallel plan as data, torch-free: which modules split by column or row, which stay replicated.

A built-in family declares one ``TpPlan`` (``Family`` objects implementing ``TpPlanned``: ``tp_plan``); both
sides read it: the planner derives ``ModelFacts.tp_split`` (the dimension each parameter is split on) and
``tp_divides`` from it (``tp_facts``), ``hpc.core.tensor_parallel`` checks the degree against its ``divides``,
and the trainer maps each role to a torch ``ParallelStyle`` (``trainer.tp``). Module names are relative to the
model (outer modules) or to one block (``BlockTp``). A model without a plan (a user's, a task's) has no
tensor parallelism.

Roles, as torchtitan's plans apply them (sequence parallelism: the residual stream between blocks is split
along the sequence):

- ``embedding``: split by rows (the vocabulary), its output split along the sequence;
- ``head``: split by columns (the vocabulary), its logits kept split for the vocabulary-parallel loss;
- ``final_norm`` and a block's ``norms``: sequence parallel (weight replicated, each rank normalises its tokens);
- ``positions``: learned positions, replicated, their output split along the sequence (the GPT's);
- ``column`` / ``row``: split by output (dim 0, with their biases) / input (dim 1; the output reduce-scattered
  along the sequence);
- ``gathered``: modules whose input (the sequence-split stream, then ``inputs - 1`` others as they are) is
  all-gathered first;
- ``whole``: modules computed whole on every rank (their parameters replicated over the group), between a
  gathered input and an output split back along the sequence.
"""

from __future__ import annotations

import typing as tp
from dataclasses import dataclass

# the dimension of a parameter the split takes (``ModelFacts.tp_split``): rows / output, columns / input, none
OUT_DIM, IN_DIM, REPLICATED = 0, 1, -1


@dataclass(frozen=True)
class BlockTp:
    """One block's plan: module names relative to the block."""

    column: tuple[str, ...] = ()  # split by output features (dim 0): heads, MLP hidden units
    row: tuple[str, ...] = ()  # split by input features (dim 1), output reduce-scattered along the sequence
    norms: tuple[str, ...] = ()  # sequence parallel
    gathered: tuple[tuple[str, int], ...] = ()  # (module, its positional inputs): the first all-gathered
    whole: tuple[str, ...] = ()  # computed whole on each rank: input gathered, output split back

    def roles(self) -> dict[str, str]:
        """Module → role (the field's name), in the order the trainer applies them."""
        named = [("norms", m) for m in self.norms] + [("gathered", m) for m, _ in self.gathered]
        named += [("whole", m) for m in self.whole] + [("column", m) for m in self.column]
        return {module: role for role, module in named + [("row", m) for m in self.row]}

    @property
    def sequence_exchanges(self) -> int:
        """Sequence-parallel all-gathers (and as many reduce-scatters or splits back) of one block's forward."""
        return len(self.gathered) + len(self.whole)


@dataclass(frozen=True)
class TpPlan:
    """A family's tensor-parallel plan (module names relative to the model; ``block`` to one block)."""

    block: BlockTp
    embedding: str = "tok_emb"
    head: str = "head"
    final_norm: str = "norm"
    positions: str = ""  # learned positions ("" none)
    blocks: str = "blocks"  # the blocks' ModuleList (parameter names ``blocks.<i>.<module>.<param>``)
    divides: tuple[str, ...] = ("n_heads",)  # the shape's fields a degree must divide (each rank whole heads)
    # the planner counts the split (``ModelFacts.tp_split``) and may choose tp under `auto`; False: the trainer
    # applies the plan, the planner takes an even split and unsplit activations as bounds (the GPT's, not yet counted)
    planned: bool = True

    def roles(self) -> dict[str, str]:
        """Outer module → role."""
        out = {self.embedding: "embedding", self.head: "head", self.final_norm: "final_norm"}
        return {**out, **({self.positions: "positions"} if self.positions else {})}

    def split_dim(self, name: str) -> int:
        """The dimension TP splits of the parameter ``name`` (``OUT_DIM``, ``IN_DIM``, ``REPLICATED``)."""
        module, _, param = name.rpartition(".")
        prefix, index, inner = (module.split(".", 2) + ["", ""])[:3]
        in_block = prefix == self.blocks and index.isdigit()
        role = self.block.roles().get(inner, "") if in_block else self.roles().get(module, "")
        if role in ("embedding", "head", "column"):
            return OUT_DIM
        return IN_DIM if role == "row" and param == "weight" else REPLICATED

    def split(self, names: tp.Iterable[str]) -> tuple[int, ...]:
        """``split_dim`` of each parameter name (a model's in its ``param_shapes`` order)."""
        return tuple(self.split_dim(name) for name in names)


@tp.runtime_checkable
class TpPlanned(tp.Protocol):
    """A family with a tensor-parallel plan (``parallel.tp`` > 1 runs only on these)."""

    tp_plan: TpPlan


def tp_plan_of(family: tp.Any) -> TpPlan | None:
    """The family's plan, or None (a user's or a task's model)."""
    return family.tp_plan if isinstance(family, TpPlanned) else None


def tp_facts(plan: TpPlan, shape: tp.Any, names: tp.Iterable[str]) -> dict[str, tp.Any]:
    """``ModelFacts`` fields of a planned family (``tp_split`` over its parameter ``names``, ``tp_divides``
    from the shape); none for a plan the planner does not count."""
    if not plan.planned:
        return {}
    return {"tp_split": plan.split(names), "tp_divides": tuple(getattr(shape, f) for f in plan.divides)}

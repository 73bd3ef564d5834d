"""What a task's batch may be (``trainer.tasks.to_device``): tensors, dicts, lists and tuples, namedtuples and
dataclasses (moved field by field, rebuilt as the same type), and any object with ``to(device)``. Moved to
the meta device, so a test on a CPU machine still sees every tensor leave the CPU."""

from __future__ import annotations

import collections
import dataclasses
import typing as tp

import pytest
import torch

from trainer.tasks import to_device

META = torch.device("meta")


def moved(x: torch.Tensor) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "meta"


class Pair(tp.NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


Triple = collections.namedtuple("Triple", ["a", "b", "name"])


@dataclasses.dataclass
class Images:
    pixels: torch.Tensor
    labels: torch.Tensor
    names: list[str] = dataclasses.field(default_factory=list)
    extra: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Frozen:
    ids: torch.Tensor
    mask: torch.Tensor | None = None


@dataclasses.dataclass
class WithDerived:
    ids: torch.Tensor
    length: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.length = torch.tensor(len(self.ids))


class OwnBatch:
    """A task's own batch class with a ``to`` method (as transformers' ``BatchEncoding`` has)."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids
        self.calls: list[torch.device] = []

    def to(self, device: torch.device) -> OwnBatch:
        out = OwnBatch(self.ids.to(device))
        out.calls = [*self.calls, device]
        return out


class Opaque:
    pass


def test_a_tensor_and_plain_containers_are_moved_nested():
    batch = {"x": torch.ones(2), "pair": (torch.zeros(1), [torch.ones(3), 7]), "name": "a"}
    out = to_device(batch, META)
    assert type(out) is dict and moved(out["x"]) and type(out["pair"]) is tuple and type(out["pair"][1]) is list
    assert moved(out["pair"][0]) and moved(out["pair"][1][0]) and out["pair"][1][1] == 7 and out["name"] == "a"
    assert moved(to_device(torch.ones(2), META))


def test_an_ordered_dict_and_a_mapping_subclass_keep_their_keys():
    out = to_device(collections.OrderedDict(b=torch.ones(1), a=torch.ones(1)), META)
    assert type(out) is collections.OrderedDict and list(out) == ["b", "a"] and all(map(moved, out.values()))
    out = to_device(collections.defaultdict(list, x=torch.ones(1)), META)
    assert moved(out["x"])


def test_namedtuples_are_rebuilt_as_their_own_type():
    out = to_device(Pair(torch.ones(2), torch.zeros(2)), META)
    assert type(out) is Pair and moved(out.x) and moved(out.y)
    out = to_device(Triple(torch.ones(1), [Pair(torch.ones(1), torch.ones(1))], "n"), META)
    assert type(out) is Triple and moved(out.a) and type(out.b[0]) is Pair and moved(out.b[0].y) and out.name == "n"


def test_dataclasses_are_moved_field_by_field_and_rebuilt_as_their_type():
    batch = Images(torch.ones(2, 3), torch.zeros(2), ["a", "b"], {"w": torch.ones(2)})
    out = to_device(batch, META)
    assert type(out) is Images and moved(out.pixels) and moved(out.labels) and moved(out.extra["w"])
    assert out.names == ["a", "b"] and not moved(batch.pixels)  # the original is untouched
    frozen = to_device(Frozen(torch.ones(2)), META)
    assert type(frozen) is Frozen and moved(frozen.ids) and frozen.mask is None


def test_a_dataclass_field_outside_init_is_moved_too():
    out = to_device(WithDerived(torch.ones(4)), META)
    assert type(out) is WithDerived and moved(out.ids) and moved(out.length)


def test_an_object_with_to_is_moved_by_its_own_method():
    out = to_device([OwnBatch(torch.ones(2))], META)
    assert type(out[0]) is OwnBatch and moved(out[0].ids) and out[0].calls == [META]


def test_transformers_batch_encoding_is_moved_by_its_to():
    from tests.extras import extra

    transformers = extra("transformers")
    enc = transformers.BatchEncoding({"input_ids": torch.ones(2, 3, dtype=torch.long)})
    out = to_device(enc, META)
    assert isinstance(out, transformers.BatchEncoding) and moved(out["input_ids"])


@pytest.mark.parametrize("value", [3, 2.5, "s", None, Opaque()])
def test_anything_else_is_kept_as_it_is(value):
    assert to_device(value, META) is value

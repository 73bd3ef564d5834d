"""The trainer's side of each model family (torchtitan's ``ModelSpec``, torch half): one module per
family implementing ``Builder``, ``build(spec.model)`` (the ``nn.Module``, built under the caller's
``torch.device``), with its initialisation in its modules' ``reset_parameters`` and its FSDP units
outside the blocks in the root's ``fsdp_units()``.

The registry is the torch-free one, ``hpc.core.models.FAMILIES``: each ``Family`` names its module
here (``Family.builder``). What the built-in decoders share is ``trainer.models.decoder``.
"""

from __future__ import annotations

import importlib
import typing as tp

from hpc.core.models import family as core_family

if tp.TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from hpc.core.spec import Model as ModelSpec


@tp.runtime_checkable
class Builder(tp.Protocol):
    """A family's torch half (``Family.builder``)."""

    def build(self, spec: ModelSpec) -> nn.Module:
        """The model of ``spec`` (a checked ``[model]``), under the caller's ``torch.device``: every module
        that owns tensors defines ``reset_parameters``; the root may define ``fsdp_units()``."""


def family(arch: str) -> Builder:
    """The module that builds ``arch``'s family (``hpc.core.models.family(arch).builder``)."""
    return importlib.import_module(core_family(arch).builder)

"""The trainer's side of each model family: one module per family giving ``build(spec.model)`` (the
``nn.Module``, built under the caller's ``torch.device``), with its initialisation in its modules'
``reset_parameters`` and its FSDP units outside the blocks in ``fsdp_units()``.

The torch-free side of the same family is ``hpc.core.models.<family>``. Adding a family is a module
here, one there, and a line in each ``FAMILIES``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# arch -> the module building that family; any other arch is a user model (``pkg.mod:function``)
FAMILIES = {"gpt": "trainer.models.gpt"}


def family(arch: str) -> ModuleType:
    """The module that builds ``arch``'s family (``FAMILIES``, else ``trainer.models.user``)."""
    return importlib.import_module(FAMILIES.get(arch, "trainer.models.user"))

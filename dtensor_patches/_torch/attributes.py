"""The module attributes and class methods the library may replace, as ledger tables.

One mechanism replaces and restores every attribute the library changes in torch: an
:class:`AttributeTable` shows an object's *own* attributes (a module's globals, a class's
``__dict__``, an instance's ``__dict__``) as a table the ledger (:mod:`dtensor_patches.ledger`)
can layer and restore. Restoring an attribute the object did not have deletes it, so an
inherited method shows through again exactly as before.

The functions torch looks up by name when it runs, and where (same names 2.9 to 2.15):

- ``torch.optim`` and ``torch.nn.utils.clip_grad`` group tensors with
  ``_group_tensors_by_device_and_dtype``, imported by name into each module, so each module's
  global is a site of its own; ``clip_grad_norm_`` calls the module globals
  ``_get_total_norm`` and ``_clip_grads_with_norm_`` (public aliases in ``torch.nn.utils``);
- the parallel styles call ``distribute_module`` through ``torch.distributed.tensor.parallel.
  style``'s globals;
- leaving ``loss_parallel()`` calls ``torch.distributed.tensor.parallel.loss.
  _disable_custom_loss_ops``;
- DTensor asks ``OpDispatcher._try_replicate_spec_for_scalar_tensor`` what a plain tensor
  argument means, only for calls that have one; ``OpDispatcher._allow_implicit_replication`` is
  the property ``implicit_replication()`` sets (:mod:`.implicit_replication`);
- a propagation cache miss runs ``ShardingPropagator.propagate_op_sharding_non_cached``
  (2.10+: the C++ path's slow path, directly or through the Python cache built over it);
- user code calls ``torch.linalg.matrix_rank`` (a public function, wrapped only because its
  ``out=`` kernel loses the write under any ``__torch_dispatch__``).
"""

from __future__ import annotations

import importlib
from typing import Any

from dtensor_patches._torch.access import ABSENT, moved
from dtensor_patches.ledger import MISSING

__all__ = [
    "FUNCTION_SITES",
    "AttributeTable",
    "attribute_table",
    "is_attribute_table",
    "site_table_names",
    "table_name",
]

PREFIX = "attributes of "

FUNCTION_SITES: dict[str, tuple[str, ...]] = {
    "_group_tensors_by_device_and_dtype": (
        "torch.utils._foreach_utils",
        "torch.optim.optimizer",
        "torch.nn.utils.clip_grad",
    ),
    "_get_total_norm": ("torch.nn.utils.clip_grad",),
    "get_total_norm": ("torch.nn.utils",),
    "_clip_grads_with_norm_": ("torch.nn.utils.clip_grad",),
    "clip_grads_with_norm_": ("torch.nn.utils",),
    "distribute_module": ("torch.distributed.tensor.parallel.style",),
    "_disable_custom_loss_ops": ("torch.distributed.tensor.parallel.loss",),
    "_try_replicate_spec_for_scalar_tensor": ("torch.distributed.tensor._dispatch:OpDispatcher",),
    "_allow_implicit_replication": ("torch.distributed.tensor._dispatch:OpDispatcher",),
    "load_state_dict": ("torch.nn.modules.module:Module",),
    "_process_value_according_to_param_policy": ("torch.optim.optimizer:Optimizer",),
    "from_local": ("torch.distributed.tensor._api:DTensor",),
    "propagate_op_sharding_non_cached": (
        "torch.distributed.tensor._sharding_prop:ShardingPropagator",
    ),
    "matrix_rank": ("torch.linalg",),
}
"""Function name -> the owners (``module`` or ``module:Class``) where torch looks it up."""


class AttributeTable:
    """An object's own attributes as a table: ``get`` reads ``vars(owner)``, writes go through
    ``setattr``/``delattr`` (a class's ``__dict__`` cannot be written directly)."""

    __slots__ = ("dotted", "owner")

    def __init__(self, owner: object, dotted: str) -> None:
        self.owner = owner
        self.dotted = dotted

    def get(self, name: str, default: Any = MISSING) -> Any:
        return vars(self.owner).get(name, default)

    def __setitem__(self, name: str, value: Any) -> None:
        setattr(self.owner, name, value)

    def pop(self, name: str, default: Any = None) -> Any:
        value = vars(self.owner).get(name, ABSENT)
        if value is ABSENT:
            return default
        delattr(self.owner, name)
        return value

    def __contains__(self, name: object) -> bool:
        return name in vars(self.owner)

    def __repr__(self) -> str:
        return f"AttributeTable({self.dotted})"


def _resolve(owner: str) -> object:
    module_name, _, class_name = owner.partition(":")
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise moved(module_name) from exc
    for part in filter(None, class_name.split(".")):
        value = getattr(obj, part, ABSENT)
        if value is ABSENT:
            raise moved(f"{module_name}.{class_name}")
        obj = value
    return obj


def attribute_table(name: str) -> AttributeTable:
    """The table named ``"attributes of <owner>"`` (``owner``: ``module`` or ``module:Class``).

    Raises:
        PatchError: the module or class does not exist in this release.
    """
    owner = name.removeprefix(PREFIX)
    return AttributeTable(_resolve(owner), owner)


def is_attribute_table(name: str) -> bool:
    return name.startswith(PREFIX)


def site_table_names(function: str) -> list[str]:
    """The table names of every site of ``function`` (see :data:`FUNCTION_SITES`)."""
    return [PREFIX + owner for owner in FUNCTION_SITES[function]]


def table_name(owner: str) -> str:
    """The table name of ``owner``'s attributes."""
    return PREFIX + owner

"""Names for torch's private types, for annotations only.

Signatures across the package name the types they take (``OpSchema``, ``OpOverload``,
``OpStrategy``…), several of which live in private torch modules. They are imported here, under
``TYPE_CHECKING`` (no cost at run time), so that no other module names a private torch module::

    if TYPE_CHECKING:
        from dtensor_patches._torch.types import OpOverload, OpSchema
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch._ops import OpOverload
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import (
        OpSchema,
        OpSpec,
        OpStrategy,
        OutputSharding,
        RuntimeSchemaInfo,
        TupleStrategy,
    )

__all__ = [
    "DTensorSpec",
    "OpOverload",
    "OpSchema",
    "OpSpec",
    "OpStrategy",
    "OutputSharding",
    "RuntimeSchemaInfo",
    "TensorMeta",
    "TupleStrategy",
]

"""Keys of torch's sharding decisions, read from its ``OpSchema``, and whether a decision may
serve another call: for a cache of decisions kept beside torch's.

torch keys a decision by the op, its tensor arguments' specs and the non-tensor arguments its
``RuntimeSchemaInfo`` declares as deciding (``static_argnum``, ``static_kwargkey``). From 2.10
the key is computed in C++ (``_DTensor_OpSchema_recompute_comparison_key``, used by the C++
cache and the Python one alike); on 2.10 and 2.11 it holds every keyword argument, declared or
not (measured: ``addcdiv_(..., value=v)`` and ``add(..., alpha=v)`` propagate again for every
new ``v`` on 2.10.0 and 2.11.0, once on 2.12.0 and 2.13.0).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from dtensor_patches._torch.access import attribute

__all__ = ["float_keywords_left_out", "serves_other_scalars"]


def _hashable(value: Any) -> Any:
    return tuple(_hashable(v) for v in value) if isinstance(value, list | tuple) else value


def float_keywords_left_out(op_schema: Any) -> Hashable | None:
    """A key of the decision for ``op_schema`` that leaves out its ``float`` keyword arguments
    that torch's ``RuntimeSchemaInfo`` does not declare as deciding (an optimizer's
    ``value=-step_size``, ``alpha=-lr``), and keeps everything else: the op, every positional
    argument (specs included) and every other keyword argument. ``None`` where there is no such
    keyword argument (torch's own key is as good) or the key cannot be hashed (symbolic shapes
    while tracing).

    Raises:
        PatchError: ``OpSchema`` lost an attribute read here.
    """
    kwargs = attribute(op_schema, "kwargs_schema", "OpSchema.kwargs_schema")
    if not kwargs:
        return None
    info = attribute(op_schema, "schema_info", "OpSchema.schema_info")
    declared = getattr(info, "static_kwargkey", None) or ()
    kept = []
    left_out = False
    for name, value in kwargs.items():
        if type(value) is float and name not in declared:
            left_out = True
        else:
            kept.append((name, _hashable(value)))
    if not left_out:
        return None
    args = attribute(op_schema, "args_schema", "OpSchema.args_schema")
    key = (op_schema.op, _hashable(args), tuple(kept))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def serves_other_scalars(output_sharding: Any) -> bool:
    """Whether torch's decision holds no non-tensor argument of the call it was made for: an
    ``OutputSharding`` whose redistribution (if any) takes the non-tensor arguments from the
    call itself (``use_val_from_redistribute_schema`` unset), not from its suggested schema."""
    if not hasattr(output_sharding, "needs_redistribute"):
        return False  # not a decision (torch computed an output itself)
    if not output_sharding.needs_redistribute:
        return True
    return not getattr(output_sharding, "use_val_from_redistribute_schema", True)

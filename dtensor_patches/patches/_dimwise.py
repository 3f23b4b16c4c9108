"""Registration builder shared by the patches whose ops work along some dims (reductions, scans,
order statistics, flips): see :func:`dtensor_patches.strategies.dimwise_strategy`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dtensor_patches.patch import Strategy
from dtensor_patches.strategies import arg, dimwise_strategy, schema_info

DimsOf = Callable[[Any], "int | Sequence[int] | None"]


def dims_arg(index: int, name: str = "dim", default: Any = None) -> DimsOf:
    """Read the op's dims from argument ``name`` (positional ``index``)."""
    return lambda op_schema: arg(op_schema, index, name, default)


def keepdim_arg(index: int, name: str = "keepdim") -> Callable[[Any], bool]:
    return lambda op_schema: bool(arg(op_schema, index, name, False))


def dimwise(
    op: str,
    *,
    dims: DimsOf,
    keepdim: bool | Callable[[Any], bool] = True,
    num_outputs: int | Callable[[Any], int] = 1,
    linear: bool = False,
    tuple_output: bool = False,
    static_argnum: int = 1,
    static_kwargkey: Sequence[str] | None = None,
) -> Strategy:
    """A :class:`Strategy` for ``op`` built on ``dimwise_strategy``.

    ``static_argnum``/``static_kwargkey`` name the non-tensor arguments (dims, keepdim, k…)
    that key the propagation cache; every argument from ``static_argnum`` on is hashed.
    """

    def strategy(op_schema: Any) -> Any:
        return dimwise_strategy(
            op_schema,
            dims=dims(op_schema),
            keepdim=keepdim(op_schema) if callable(keepdim) else keepdim,
            num_outputs=num_outputs(op_schema) if callable(num_outputs) else num_outputs,
            linear=linear,
            tuple_output=tuple_output,
        )

    return Strategy(op, strategy, schema_info(static_argnum, static_kwargkey))

"""torch's context parallelism (``torch.distributed.tensor.experimental.context_parallel``):
the ring-attention internals the library uses.

Measured 2.9 to 2.15 (``docs/design.md`` §2): the module is
``torch.distributed.tensor.experimental._context_parallel._attention`` from 2.10 and
``torch.distributed.tensor.experimental._attention`` on 2.9. While a ``context_parallel()``
block is active, DTensor's custom-handler table is a copy of itself plus the module's op ->
handler dict (``custom_ops`` from 2.10, ``customized_ops`` on 2.9), read at the moment the
block is entered. Its ring loops ``_templated_ring_attention(group, seq_dim, op, query, key,
value, is_causal, **kwargs)`` and ``_templated_ring_attention_backward(group, seq_dim, op,
grad_out, grad_out_name, query, key, value, out, logsumexp, is_causal, **kwargs)`` take the
attention kernel as an argument and implement the head-tail load balancing of the causal mask
(``_cp_options.enable_load_balance``).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from dtensor_patches._torch.access import ABSENT, module, moved

__all__ = [
    "CONTEXT_PARALLEL_HANDLERS",
    "attention_module",
    "handler_table",
    "load_balanced",
    "ring_attention",
    "ring_attention_backward",
]

CONTEXT_PARALLEL_HANDLERS = "context_parallel.custom_ops"
"""The ledger name of ``context_parallel()``'s op -> handler dict."""

_MODULES = (
    "torch.distributed.tensor.experimental._context_parallel._attention",  # 2.10+
    "torch.distributed.tensor.experimental._attention",  # 2.9
)
_TABLE_NAMES = ("custom_ops", "customized_ops")


def attention_module() -> ModuleType:
    """The module that holds torch's ring attention.

    Raises:
        PatchError: neither the 2.10+ nor the 2.9 module exists.
    """
    for name in _MODULES:
        try:
            return module(name)
        except Exception:  # noqa: BLE001 - try the older location next
            continue
    raise moved(_MODULES[0], "torch's context parallelism moved")


def handler_table() -> dict[Any, Any]:
    """``context_parallel()``'s op -> handler dict (installed into DTensor's handler table for
    the duration of a block).

    Raises:
        PatchError: the module or the dict moved.
    """
    mod = attention_module()
    for name in _TABLE_NAMES:
        table = getattr(mod, name, ABSENT)
        if isinstance(table, dict):
            return table
    raise moved(f"{mod.__name__}.custom_ops", "context_parallel()'s handler dict moved")


def _function(name: str) -> Any:
    mod = attention_module()
    value = getattr(mod, name, ABSENT)
    if value is ABSENT:
        raise moved(f"{mod.__name__}.{name}")
    return value


def load_balanced() -> bool:
    """Whether ``context_parallel()`` shards the sequence head-tail (torch's default).

    Raises:
        PatchError: ``_cp_options.enable_load_balance`` moved.
    """
    options = _function("_cp_options")
    value = getattr(options, "enable_load_balance", ABSENT)
    if value is ABSENT:
        raise moved(f"{attention_module().__name__}._cp_options.enable_load_balance")
    return bool(value)


def ring_attention(
    op: Any,
    group: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    is_causal: bool,
    **kwargs: Any,
) -> tuple[torch.Tensor, ...]:
    """torch's ring attention forward over ``group`` with ``op`` as the block kernel
    (``op(q, k, v, is_causal=..., **kwargs) -> (out, logsumexp, ...)``), sequence dim 2.

    Raises:
        PatchError: ``_templated_ring_attention`` moved.
    """
    ring = _function("_templated_ring_attention")
    return tuple(ring(group, 2, op, query, key, value, is_causal=is_causal, **kwargs))


def ring_attention_backward(
    op: Any,
    group: Any,
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    *,
    is_causal: bool,
    **kwargs: Any,
) -> tuple[torch.Tensor, ...]:
    """torch's ring attention backward over ``group`` with ``op`` as the block kernel
    (``op(grad_out=, query=, key=, value=, out=, logsumexp=, is_causal=, **kwargs) ->
    (grad_query, grad_key, grad_value, ...)``), sequence dim 2.

    Raises:
        PatchError: ``_templated_ring_attention_backward`` moved.
    """
    ring = _function("_templated_ring_attention_backward")
    return tuple(
        ring(
            group,
            2,
            op,
            grad_out=grad_out,
            grad_out_name="grad_out",
            query=query,
            key=key,
            value=value,
            out=out,
            logsumexp=logsumexp,
            is_causal=is_causal,
            **kwargs,
        )
    )


def check() -> None:
    """Resolve every internal this module uses, so a moved one fails at apply time.

    Raises:
        PatchError: naming the internal that moved.
    """
    handler_table()
    load_balanced()
    _function("_templated_ring_attention")
    _function("_templated_ring_attention_backward")

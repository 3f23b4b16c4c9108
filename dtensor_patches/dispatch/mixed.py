"""Plain tensors beside DTensors (or DTensors on several meshes): decided where the meaning is
certain, a clear error where it is not.

Certain: optimizers' ``foreach`` steps and gradient-norm clipping. DTensor refuses
``_foreach_*`` calls over lists that mix kinds (``got mixed torch.Tensor and DTensor``) before
sharding propagation, so the fallback never sees them. They come from one place:
``torch.optim`` and ``torch.nn.utils.clip_grad`` group tensors with
``_group_tensors_by_device_and_dtype``, which puts a DTensor and a plain tensor of one device
and dtype into one list (an optimizer over FSDP2 ``ignored_params`` with ``foreach=True``).
The wrapped grouping keeps torch's groups and splits a group only where it mixes kinds, so
each ``_foreach_*`` call sees one kind: the fix sits at the source, with no handler on the
``_foreach_*`` ops (the optimizer's hot path), and costs one ``type()`` look per tensor per
grouping. ``clip_grad_norm_`` / ``get_total_norm`` over such lists compute the true global
norm: one norm per kind (a DTensor group's norm reduced over its mesh), combined as torch
combines per-tensor norms (``vector_norm`` of the stacked norms).

Any other plain tensor beside DTensors in an op: :mod:`.plain_checked` (``copy_`` in either
direction as the full value, anything else as ``Replicate()`` once the ranks are found to hold
the same values, else a :class:`~dtensor_patches.errors.MixedTensorError` naming both readings
and how to choose: ``implicit_replication()`` or :func:`gathered_locally`).

These are the fallback's registrations (:func:`registrations`): on while it is on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from dtensor_patches._torch import tables as torch_tables
from dtensor_patches._torch.dtensors import dtensor_class, full_tensor
from dtensor_patches._torch.implicit_replication import (
    CPP_FLAG_KEY,
    CPP_FLAG_TABLE,
    intent_property,
)
from dtensor_patches.dispatch.gathered import GatherMode
from dtensor_patches.dispatch.plain_checked import checked_reading, readings_error
from dtensor_patches.dispatch.wrappers import WrappedFunction, original_function
from dtensor_patches.errors import MixedTensorError, first_line
from dtensor_patches.norms import PlainGrads, grad_norm

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "CppFlagOn",
    "PlainGrads",
    "ambiguity_error",
    "clip_grads_with_norm",
    "gathered_locally",
    "registrations",
    "total_norm",
]


class _KindKey(tuple[Any, ...]):
    """A ``(device, dtype)`` group key that also tells groups of other kinds apart (it unpacks
    to ``(device, dtype)`` as torch's callers expect)."""

    kind: Any

    def __new__(cls, key: tuple[Any, Any], kind: Any) -> _KindKey:
        self = super().__new__(cls, key)
        self.kind = kind
        return self

    def __hash__(self) -> int:
        return hash((tuple(self), id(self.kind)))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _KindKey) and tuple(self) == tuple(other) and self.kind is other.kind
        )


def _kind(tensor: Any, dtensor: type) -> DeviceMesh | None:
    """``None`` for a plain tensor, the mesh for a DTensor."""
    mesh: DeviceMesh | None = getattr(tensor, "device_mesh", None)
    return mesh if isinstance(tensor, dtensor) else None


def _grouping(original: Callable[..., Any]) -> Callable[..., Any]:
    def grouped_by_kind(tensorlistlist: Any, with_indices: bool = False) -> Any:
        """torch's ``_group_tensors_by_device_and_dtype``, with each group split by kind
        (plain tensors; DTensors per mesh) where it mixes them."""
        grouped = original(tensorlistlist, with_indices)
        dtensor = dtensor_class()
        out: dict[Any, Any] = {}
        for key, (lists, indices) in grouped.items():
            first = lists[0]
            types = {type(t) for t in first}
            if len(types) == 1 and not issubclass(next(iter(types)), dtensor):
                out[key] = (lists, indices)
                continue
            by_kind: dict[int, tuple[Any, list[int]]] = {}
            for position, t in enumerate(first):
                kind = _kind(t, dtensor)
                by_kind.setdefault(id(kind), (kind, []))[1].append(position)
            if len(by_kind) == 1:
                out[key] = (lists, indices)
                continue
            for n, (kind, positions) in enumerate(by_kind.values()):
                # Empty lists (amsgrad's max_exp_avg_sqs when unused) stay empty.
                sub_lists = [[lst[p] for p in positions] if lst else lst for lst in lists]
                sub_indices = (
                    [indices[p] for p in positions] if len(indices) == len(first) else indices
                )
                out[key if n == 0 else _KindKey(key, kind)] = (sub_lists, sub_indices)
        return out

    return grouped_by_kind


def _split(tensors: Iterable[Any]) -> dict[int, tuple[Any, list[Any]]]:
    dtensor = dtensor_class()
    by_kind: dict[int, tuple[Any, list[Any]]] = {}
    for t in tensors:
        kind = _kind(t, dtensor)
        by_kind.setdefault(id(kind), (kind, []))[1].append(t)
    return by_kind


def total_norm(
    tensors: Any,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    original: Callable[..., torch.Tensor] | None = None,
    plain: PlainGrads = "auto",
    group: Any = None,
) -> torch.Tensor:
    """``torch.nn.utils.get_total_norm``, also over DTensors of any meshes beside plain tensors.

    Plain tensors only: torch's own function and result. With any DTensor:
    :func:`dtensor_patches.norms.grad_norm` (every element counted once, one all-reduce per
    reduction group; a ``Replicate()`` DTensor when every tensor is on one mesh, else a plain
    0-dim tensor, the same on every rank).

    Plain tensors beside DTensors (gradients of FSDP2 ``ignored_params``, of parameters left
    out of TP) may hold the same values on every rank or each rank's own: ``plain`` says
    which (``"replicated"``, ``"per_rank"``), and ``"auto"`` (the default, and what torch's
    wrapped ``get_total_norm`` / ``clip_grad_norm_`` use) finds out with one all-gather of one
    scalar per rank over ``group`` (default: the world), taking per-rank norms that differ as
    per-rank. Either way every rank gets the same norm, so each shard of a DTensor is clipped
    by the same coefficient (issue 23, item 14: a per-rank plain gradient taken as replicated
    gave each rank its own norm).

    Raises:
        RuntimeError: ``error_if_nonfinite`` and the norm is nan or inf (torch's message).
        ValueError: ``plain`` is not one of the three readings.
    """
    if plain not in ("auto", "replicated", "per_rank"):
        raise ValueError(f"plain must be 'auto', 'replicated' or 'per_rank', got {plain!r}")
    torch_norm = original if original is not None else original_function("_get_total_norm")
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    dtensor = dtensor_class()
    if not any(isinstance(t, dtensor) for t in tensors):
        return torch_norm(tensors, norm_type, error_if_nonfinite, foreach)
    # torch's result has the gradients' widest dtype: float64 gradients give a float64 norm.
    wide = any(t.dtype == torch.float64 for t in tensors)
    return grad_norm(
        tensors,
        norm_type,
        error_if_nonfinite=error_if_nonfinite,
        foreach=foreach,
        plain=plain,
        group=group,
        dtype=torch.float64 if wide else torch.float32,
    )


def clip_grads_with_norm(
    parameters: Any,
    max_norm: float,
    total_norm: torch.Tensor,
    foreach: bool | None = None,
    *,
    original: Callable[..., None] | None = None,
) -> None:
    """``torch.nn.utils.clip_grads_with_norm_``, also over parameters of several kinds: each
    kind is scaled by the one coefficient, given to it as that kind (a plain ``total_norm``
    becomes a ``Replicate()`` DTensor on each mesh; a DTensor one is gathered for plain
    tensors)."""
    from torch.distributed.tensor import DTensor, Replicate

    torch_clip = original if original is not None else original_function("_clip_grads_with_norm_")
    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    kinds = _split(parameters)
    if len(kinds) <= 1:
        kind = next(iter(kinds.values()))[0] if kinds else None
        if kind is None and isinstance(total_norm, DTensor):
            total_norm = total_norm.full_tensor()
        elif kind is not None and not isinstance(total_norm, DTensor):
            total_norm = DTensor.from_local(
                total_norm, kind, [Replicate()] * kind.ndim, run_check=False
            )
        torch_clip(parameters, max_norm, total_norm, foreach)
        return
    full = full_tensor(total_norm)
    for kind, group in kinds.values():
        norm = (
            full
            if kind is None
            else DTensor.from_local(full, kind, [Replicate()] * kind.ndim, run_check=False)
        )
        torch_clip(group, max_norm, norm, foreach)


def _norm_of_kinds(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @torch.no_grad()
    def get_total_norm(
        tensors: Any,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        return total_norm(tensors, norm_type, error_if_nonfinite, foreach, original=original)

    return get_total_norm


def _clip_of_kinds(original: Callable[..., None]) -> Callable[..., None]:
    @torch.no_grad()
    def clip_grads_with_norm_(
        parameters: Any, max_norm: float, total_norm: torch.Tensor, foreach: bool | None = None
    ) -> None:
        clip_grads_with_norm(parameters, max_norm, total_norm, foreach, original=original)

    return clip_grads_with_norm_


def ambiguity_error(
    op: Any, plain: torch.Tensor, mesh: DeviceMesh, error: RuntimeError
) -> MixedTensorError:
    """The error for a plain tensor ``plain`` beside DTensors on ``mesh`` in a call of ``op``
    that DTensor refused (``error``): a :class:`~dtensor_patches.errors.MixedTensorError`
    naming both readings and the one line that says which is meant."""
    return readings_error(
        op, plain, mesh, f"what it holds is ambiguous (torch: {first_line(error)})"
    )


class CppFlagOn:
    """Keeps the C++ implicit-replication flag of the applying thread on, so that calls with a
    plain tensor beside DTensors reach :func:`~dtensor_patches.dispatch.plain_checked.
    checked_reading` from 2.10 too (:mod:`dtensor_patches._torch.implicit_replication`)."""

    kind = "thread flag"

    @property
    def concerns(self) -> tuple[str, ...]:
        return ()

    def entries(self) -> list[tuple[str, str]]:
        return [(CPP_FLAG_TABLE, CPP_FLAG_KEY)]

    def install(self) -> None:
        torch_tables.tables()[CPP_FLAG_TABLE][CPP_FLAG_KEY] = True


def registrations() -> list[Any]:
    """The wrapped torch functions and settings that make mixed kinds work (or fail clearly)."""
    return [
        WrappedFunction("_allow_implicit_replication", intent_property),
        CppFlagOn(),
        WrappedFunction("_try_replicate_spec_for_scalar_tensor", checked_reading),
        WrappedFunction("_group_tensors_by_device_and_dtype", _grouping),
        WrappedFunction("_get_total_norm", _norm_of_kinds),
        WrappedFunction("get_total_norm", _norm_of_kinds),
        WrappedFunction("_clip_grads_with_norm_", _clip_of_kinds),
        WrappedFunction("clip_grads_with_norm_", _clip_of_kinds),
    ]


def gathered_locally() -> torch.overrides.TorchFunctionMode:
    """``with dtensor_patches.gathered_locally(): ...``: every DTensor argument of a torch call
    in the block is gathered (its full value, once per block while in use) and the call runs on
    plain tensors, returning plain tensors.

    The second reading of a plain tensor beside a DTensor (``got mixed torch.Tensor and
    DTensor``): the plain tensor is this rank's own data and the DTensor a sharded parameter
    whose full value is wanted, e.g. ``hidden @ lm_head.weight.T`` outside an FSDP2 module.
    For the first reading (the plain tensor is the same on every rank: a causal mask beside
    sharded scores) use ``torch.distributed.tensor.experimental.implicit_replication()``.

    - Gradients flow back as FSDP's do: each rank's gradient of the full value, summed over
      ranks onto the DTensor's placements (a reduce-scatter for ``Shard``, an all-reduce for
      ``Replicate`` and ``Partial``).
    - Writes into a DTensor in the block (in-place methods, ``out=``, ``w[i] = v``,
      ``_foreach_*_``, an optimizer step, a write through a view taken in the block) are
      carried into its shards, placements kept; the value written is taken as the same on
      every rank. Attribute access (``p.grad``) is the DTensor's own.

    Raises (inside the block):
        PatchError: a write into a DTensor that requires grad while grad mode is on (autograd
            cannot follow it through the gathered copy), or one that changes its shape;
            nothing is written to the DTensor then.
    """
    return GatherMode()

"""``gathered_locally()``: DTensors gathered for plain-tensor calls, with the adjoint gradient
and every write carried back to the shards.

Inside the block every DTensor argument of a torch call is replaced by its full value (one
all-gather per DTensor and block while that value is in use), and the call runs on plain
tensors. Two things make it the program a single device would run:

- **Gradients.** The gather's backward is its adjoint, a sum over ranks: each rank's gradient
  of the full value is reduce-scattered onto the shards (``Shard``), all-reduced (``Replicate``;
  the shares of a ``Partial(sum)``), as FSDP reduces the gradients of a gathered parameter. The
  plain tensors are read as this rank's own data, so a loss computed on every rank counts once
  per rank (issue 23, item 1).
- **Writes.** A call that writes into a gathered value (an in-place method, ``out=``,
  ``__setitem__``, ``_foreach_*_``, or a write through a view of it taken in the block) is seen
  by the value's version counter, and this rank's shard of the written value is copied into the
  DTensor's local tensor after the call succeeded; placements are kept (issue 23, item 3). The
  value written is taken as the same on every rank: each rank keeps its own shard of what it
  computed. A differentiable write (grad mode on, the DTensor requires grad) is refused with a
  :class:`~dtensor_patches.errors.PatchError` before anything is copied: autograd cannot follow
  a write through the gather (stock raises too for a leaf).

Attribute reads and writes (``p.grad``, ``p.data = ...``, ``p.shape``) act on the DTensor
itself, not on a gathered copy, so an optimizer step in the block sees the gradients and updates
the shards; the properties that are views of the values (``T``, ``mT``, ``H``, ``mH``, ``real``,
``imag``) are gathered like calls.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from dtensor_patches._torch.dtensors import (
    dtensor_class,
    has_base,
    local_tensor,
    version_of,
    view_root,
)
from dtensor_patches._torch.schemas import tree_leaves, tree_map
from dtensor_patches.dispatch.shards import contiguous_stride, shard_of
from dtensor_patches.errors import PatchError

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["GatherMode", "gather_full"]

_ATTRIBUTE_ACCESS = frozenset({"__get__", "__set__", "__delete__"})
# Properties that compute a tensor from the values (views): these are gathered like calls.
_COMPUTED_PROPERTIES = frozenset({"T", "mT", "H", "mH", "real", "imag"})


class _Gather(torch.autograd.Function):
    """A DTensor's full value as a plain tensor (forward: all-gather, or all-reduce of
    ``Partial`` shares); backward: the adjoint, this rank's gradient of the full value summed
    over ranks onto the DTensor's placements (reduce-scatter for ``Shard``, all-reduce for
    ``Replicate`` and ``Partial``)."""

    @staticmethod
    def forward(ctx: Any, value: DTensor) -> torch.Tensor:
        from torch.distributed.tensor import Replicate

        ctx.mesh, ctx.placements = value.device_mesh, tuple(value.placements)
        ctx.shape = tuple(value.shape)
        local = local_tensor(value).detach()
        if all(isinstance(p, Replicate) for p in ctx.placements):
            # A copy: writes in the block reach the DTensor only through the write-back.
            return local.clone()
        if value.numel() == 0:
            return torch.empty(value.shape, dtype=value.dtype, device=local.device)
        full: torch.Tensor = value.detach().full_tensor()  # type: ignore[attr-defined]
        if value.is_contiguous() and not full.is_contiguous():
            # 2.9 gathers a Shard(d > 0) as a permuted view.
            full = full.contiguous()
        if has_base(full):
            # A view (of the padded gather buffer): autograd forbids writing into a view made
            # in a custom Function, and writes in the block are this value's.
            full = full.clone()
        return full

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        from torch.distributed.tensor import DTensor, Partial, Replicate

        mesh, placements = ctx.mesh, ctx.placements
        partial = DTensor.from_local(
            grad.detach().contiguous(),
            mesh,
            [Partial()] * mesh.ndim,
            run_check=False,
            shape=torch.Size(ctx.shape),
            stride=contiguous_stride(ctx.shape),
        )
        target = [Replicate() if p.is_partial() else p for p in placements]
        out = partial.redistribute(mesh, target)
        for mesh_dim, p in enumerate(placements):
            if isinstance(p, Partial) and p.reduce_op == "avg":
                # The full value is the mean of the shares: each share's gradient is 1/n.
                out = out / mesh.size(mesh_dim)
        return out


def gather_full(value: DTensor) -> torch.Tensor:
    """``value``'s full value as a plain tensor on every rank, differentiable with the adjoint
    gradient (summed over ranks onto ``value``'s placements; see :class:`_Gather`).

    Shapes: the DTensor's global shape, contiguous when the DTensor is.
    """
    out: torch.Tensor = _Gather.apply(value)
    return out


class _Gathered:
    """One DTensor's gathered value in a block: the DTensor, a weak reference to the value, and
    the versions seen (the value's, and the DTensor's local tensor's when it was gathered)."""

    __slots__ = ("dtensor", "local_version", "tracked", "value", "value_id", "version")

    def __init__(self, dtensor: DTensor, value: torch.Tensor, callback: Any) -> None:
        self.dtensor = dtensor
        self.value = weakref.ref(value, callback)
        self.value_id = id(value)
        self.version = version_of(value)
        self.local_version = version_of(local_tensor(dtensor))
        self.tracked = value.requires_grad


class GatherMode(torch.overrides.TorchFunctionMode):
    """The torch-function mode of :func:`~dtensor_patches.dispatch.mixed.gathered_locally`.

    Its state (the values gathered in the block, by DTensor and by value) lives as long as
    the values do (weak references) and is dropped at the block's end.
    """

    def __init__(self) -> None:
        super().__init__()
        self._by_dtensor: dict[int, _Gathered] = {}
        self._by_value: dict[int, _Gathered] = {}

    def __exit__(self, *exc: Any) -> Any:
        self._by_dtensor.clear()
        self._by_value.clear()
        return super().__exit__(*exc)

    def _forget(self, entry: _Gathered) -> None:
        for table, key in ((self._by_dtensor, id(entry.dtensor)), (self._by_value, entry.value_id)):
            if table.get(key) is entry:
                del table[key]

    def _gathered(self, dtensor: DTensor) -> tuple[torch.Tensor, _Gathered]:
        """The value of ``dtensor`` in this block: the one gathered before while it is alive,
        the DTensor unchanged since and autograd's needs met; else a new gather."""
        entry = self._by_dtensor.get(id(dtensor))
        if entry is not None and entry.dtensor is dtensor:
            value = entry.value()
            wants_graph = torch.is_grad_enabled() and dtensor.requires_grad
            if (
                value is not None
                and entry.local_version == version_of(local_tensor(dtensor))
                and (entry.tracked or not wants_graph)
            ):
                return value, entry
            self._forget(entry)
        value = gather_full(dtensor)
        holder: list[_Gathered] = []

        def dropped(_ref: Any) -> None:
            if holder:
                self._forget(holder[0])

        entry = _Gathered(dtensor, value, dropped)
        holder.append(entry)
        self._by_dtensor[id(dtensor)] = entry
        self._by_value[id(value)] = entry
        return value, entry

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if (
            getattr(func, "__name__", None) in _ATTRIBUTE_ACCESS
            and getattr(getattr(func, "__self__", None), "__name__", None)
            not in _COMPUTED_PROPERTIES
        ):
            # ``p.grad``, ``p.data = x``, ``p.shape``: the DTensor's own attributes, not a
            # gathered copy's (``w.T`` is a view of the values: gathered below).
            return func(*args, **kwargs)
        dtensor = dtensor_class()
        touched: dict[int, _Gathered] = {}
        has_dtensor = False
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, dtensor):
                has_dtensor = True
            elif self._by_value and isinstance(leaf, torch.Tensor):
                # A gathered value or a view of one, taken earlier in the block.
                root = view_root(leaf)
                entry = self._by_value.get(id(root))
                if entry is not None and entry.value() is root:
                    touched[id(entry)] = entry
        if has_dtensor:

            def gather(v: Any) -> Any:
                if not isinstance(v, dtensor):
                    return v
                value, entry = self._gathered(v)
                touched[id(entry)] = entry
                return value

            args, kwargs = tree_map(gather, args), tree_map(gather, kwargs)
        if not touched:
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        self._write_back(func, list(touched.values()))
        return out

    def _write_back(self, func: Any, entries: list[_Gathered]) -> None:
        """Copy this rank's shard of every gathered value ``func`` wrote into its DTensor; all
        checks and shards first, the copies last."""
        written = []
        for entry in entries:
            value = entry.value()
            if value is not None and version_of(value) != entry.version:
                written.append((entry, value))
        if not written:
            return
        for entry, value in written:
            target = entry.dtensor
            problem = None
            if tuple(value.shape) != tuple(target.shape):
                problem = (
                    f"changes its shape ({list(target.shape)} -> {list(value.shape)}); a "
                    "DTensor's shape cannot change in place"
                )
            elif torch.is_grad_enabled() and target.requires_grad:
                leaf = " (a leaf Variable that requires grad)" if target.is_leaf else ""
                problem = (
                    f"requires grad{leaf}, and autograd cannot follow an in-place write "
                    "through the gathered copy; write under torch.no_grad() or outside the block"
                )
            if problem is not None:
                # The gathered copy no longer matches the DTensor: gather afresh next time.
                for e, _ in written:
                    self._forget(e)
                raise PatchError(
                    f"{getattr(func, '__name__', func)} inside gathered_locally() writes into a "
                    f"DTensor {list(target.shape)}{tuple(target.placements)} that {problem}; "
                    "nothing was written to it"
                )
        with torch.no_grad():
            shards = [
                (entry, value, shard_of(value, entry.dtensor.device_mesh, entry.dtensor.placements))
                for entry, value in written
            ]
            for entry, value, shard in shards:
                local = local_tensor(entry.dtensor)
                local.copy_(shard)
                entry.version = version_of(value)
                entry.local_version = version_of(local)

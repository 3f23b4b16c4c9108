"""torch 2.9 and 2.10 find no mesh for a call whose DTensors all sit in a list or in ``out=``.

torch 2.10's C++ dispatch (2.9's Python one alike) looks for the call's mesh among the positional tensor arguments
(and inside lists only for ops whose strategy asks for it), so a call whose DTensors are all in
a list or keyword-only raises ``found no DeviceMesh from dtensor args`` before any strategy or
fallback can see it: a factory writing into a DTensor (``torch.zeros(4, 3, out=d)``,
``torch.arange(n, out=d)``), ``torch.block_diag(a, b)``, ``einsum`` under
``torch.inference_mode()`` (which reaches DTensor undecomposed), a c10d collective called on a
DTensor (``dist.all_gather(parts, d)``). From 2.11 torch finds the mesh (and runs them, or
refuses clearly for want of a strategy). On 2.9 the fallback takes the refusal; on 2.10 it
cannot, as torch raises in C++.

Fix (2.9 and 2.10): a custom handler, which both consult before they look for a mesh, for every ``aten``/``c10d`` overload whose tensor arguments are all lists, optional or
``out=`` (read from the registered schemas at ``apply_all()``, about 10 ms) and that has no
DTensor strategy or handler: the call goes to the fallback (gathered inputs, one computation
on full tensors, outputs placed like the inputs, ``out=`` written shard by shard after the
computation succeeded): the fallback's machinery, as ``as_strided`` uses it. Only calls of those ops with a DTensor among their
arguments reach a handler; they cost what the fallback costs, and every other call nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch import tables as torch_tables
from dtensor_patches._torch.schemas import ops_with_tensors_only_in_lists_or_out, resolve_op
from dtensor_patches.ledger import EntryKey
from dtensor_patches.patch import Patch
from dtensor_patches.reproducers import compare, failure_of, randn

OPS = ("aten.zeros.out", "aten.block_diag.default", "aten.einsum.default")


def _gathered(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    from dtensor_patches.dispatch import gather

    return gather.run_gathered(op, tuple(args), dict(kwargs), "DTensors only in a list or out=")


@dataclass(frozen=True)
class _MeshlessHandlers:
    """One handler per op whose DTensors 2.10 cannot find (see the module docstring), for the
    ops among them that DTensor has no strategy or handler for when the patch is applied."""

    kind: ClassVar[str] = "handler"
    _ops: list[Any] = field(default_factory=list, compare=False)

    @property
    def concerns(self) -> tuple[str, ...]:
        return ()

    def _targets(self) -> list[Any]:
        if not self._ops:
            for name in ops_with_tensors_only_in_lists_or_out():
                try:
                    op = resolve_op(name)
                except Exception:  # noqa: BLE001 - a schema without a Python overload
                    continue
                if not (
                    torch_tables.has_native_strategy(op) or torch_tables.has_native_handler(op)
                ):
                    self._ops.append(op)
        return self._ops

    def entries(self) -> Sequence[EntryKey]:
        return [(torch_tables.HANDLERS, op) for op in self._targets()]

    def install(self) -> None:
        for op in self._targets():
            torch_tables.register_custom_handler(op, _gathered)


def reproduce(mesh: Any) -> str | None:
    """``torch.zeros(4, 3, out=d)``, ``torch.block_diag(d, e)`` and ``einsum`` under
    ``inference_mode`` with ``Shard(0)`` DTensors, against plain tensors."""
    from torch.distributed.tensor import Shard, distribute_tensor

    a, b = randn(4, 3), randn(4, 3, seed=1)

    def run() -> list[torch.Tensor]:
        d = distribute_tensor(a.clone(), mesh, [Shard(0)])
        e = distribute_tensor(b, mesh, [Shard(0)])
        torch.zeros(4, 3, out=d)
        out = [d.full_tensor(), torch.block_diag(d, e).full_tensor()]
        with torch.inference_mode():
            out.append(torch.einsum("ij,kj->ik", e, e).full_tensor())
        return out

    got, error = failure_of(run)
    if error is not None:
        # Only the missing mesh is this bug; a missing strategy (2.11+, no fallback) is not.
        return f"DTensors only in a list or out=: {error}" if "DeviceMesh" in error else None
    expected = [torch.zeros(4, 3), torch.block_diag(torch.zeros(4, 3), b), b @ b.T]
    for what, g, e in zip(("zeros(out=)", "block_diag", "einsum"), got, expected, strict=True):
        problem = compare(g, e, what=what)
        if problem is not None:
            return problem
    return None


PATCH = Patch(
    name="mesh_in_lists",
    summary="calls whose DTensors are all in a list or out= find their mesh (2.9, 2.10)",
    ops=OPS,
    gate=SpecifierSet("<2.11"),
    registrations=lambda: [_MeshlessHandlers()],
    reproduce=reproduce,
    overrides_existing=True,
    communication="what the fallback moves: the inputs gathered",
    replicates=True,
)

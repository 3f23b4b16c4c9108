"""Leaving a ``with loss_parallel():`` block deletes the patches' ``nll_loss`` handlers.

``loss_parallel()`` installs its own handlers into ``DTensor._op_dispatcher.
_custom_op_handlers`` on entering and *pops* them on leaving (``_disable_custom_loss_ops``),
whatever was there before. The ``nll_loss`` patch (2.9 to 2.13) owns handlers for
``nll_loss_forward`` / ``nll_loss_backward``: after the first ``loss_parallel()`` block they are
gone, ``cross_entropy`` over an unevenly sharded batch raises again and weighted or
``ignore_index`` means are silently wrong again, while ``apply_all()``'s report still says
``applied``. Measured on 2.9.1 and 2.13.0; on 2.14+ no patch owns those ops (the ``nll_loss``
gate ends at 2.14), so nothing is lost.

Fix: ``_disable_custom_loss_ops`` (a global that ``loss_parallel()`` looks up when it
leaves) is wrapped: after torch's own, every entry it removed that a patch owns is put back
(the ledger's ``reassert``) and the propagation caches are cleared. Costs nothing outside a
``loss_parallel()`` exit. ``dtensor_patches.health()`` reports any entry still lost. The
reproducer needs the ``nll_loss`` patch applied (``requires``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from packaging.specifiers import SpecifierSet

from dtensor_patches import state
from dtensor_patches._torch import tables as torch_tables
from dtensor_patches.patch import Patch, WrappedFunction
from dtensor_patches.reproducers import compare, failure_of, randn

OPS = (
    "aten.nll_loss_forward.default",
    "aten.nll_loss_backward.default",
    "aten.nll_loss2d_forward.default",
    "aten.nll_loss2d_backward.default",
)


def _keeping_patches(disable: Callable[[], None]) -> Callable[[], None]:
    def disable_and_restore() -> None:
        disable()
        with state.LOCK:
            directory = torch_tables.tables()
            ops = list(directory[torch_tables.LOSS_PARALLEL_HANDLERS])  # type: ignore[call-overload]
            entries = [(torch_tables.HANDLERS, op) for op in ops]
            if state.LEDGER.reassert(directory, entries):
                torch_tables.clear_sharding_caches()

    disable_and_restore.__wrapped__ = disable  # type: ignore[attr-defined]
    return disable_and_restore


def _registrations() -> list[WrappedFunction]:
    return [WrappedFunction("_disable_custom_loss_ops", _keeping_patches)]


def reproduce(mesh: object) -> str | None:
    """With the ``nll_loss`` patch applied (``requires``): one ``loss_parallel()`` block, then ``cross_entropy``
    over an uneven ``Shard(0)`` batch with ``ignore_index``: must still be single-device
    right (and the patch's handler still in torch's table)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    # Sizes that leave no rank an empty shard on 2 or 4 ranks (7 rows: 4, 3 and 2, 2, 2, 1).
    logits, target = randn(4, 8), torch.tensor([0, 5, 2, 3])
    with loss_parallel():
        F.cross_entropy(
            distribute_tensor(logits, mesh, [Shard(1)]),
            distribute_tensor(target, mesh, [Replicate()]),
        )
    x, t = randn(7, 3), torch.tensor([0, 2, 1, 1, 0, 2, 1])

    def after() -> torch.Tensor:
        return F.cross_entropy(
            distribute_tensor(x, mesh, [Shard(0)]),
            distribute_tensor(t, mesh, [Shard(0)]),
            ignore_index=1,
        ).full_tensor()

    got, error = failure_of(after)
    if error is not None:
        return f"cross_entropy(7x3 Shard(0)) after a loss_parallel() block: {error}"
    return compare(
        got, F.cross_entropy(x, t, ignore_index=1), what="cross_entropy after loss_parallel()"
    )


PATCH = Patch(
    name="loss_parallel_keeps_patches",
    summary="leaving loss_parallel() no longer deletes the patches' nll_loss handlers (2.9-2.13)",
    ops=OPS,
    gate=SpecifierSet(">=2.9,<2.14"),
    registrations=_registrations,
    reproduce=reproduce,
    requires=("nll_loss",),
    overrides_existing=True,
    communication="none",
)

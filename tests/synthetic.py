"""A stand-in patch for registry tests that must behave the same on every torch release.

``aten.alias_copy.default`` has no DTensor sharding strategy on any release from 2.9 to 2.15
(checked by the tests before relying on it), and a copy keeps its input's layout, so the
library's follow-input strategy is correct for it.
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches import Patch, Strategy
from dtensor_patches.reproducers import compare, failure_of
from dtensor_patches.strategies import follow_input_strategy

OP = "aten.alias_copy.default"


def reproduce(mesh: Any) -> str | None:
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(12.0).reshape(2 * mesh.size(), -1)
    dx = distribute_tensor(full, mesh, [Shard(0)])
    out, error = failure_of(lambda: torch.ops.aten.alias_copy.default(dx))
    if error is not None:
        return error
    return compare(out.full_tensor(), full, what="alias_copy")


def make(
    name: str = "synthetic",
    *,
    op: str = OP,
    calls: list[str] | None = None,
    fail_after_install: bool = False,
) -> Patch:
    """A patch for ``op`` (default ``alias_copy``) gated to every release.

    ``calls`` records each install; ``fail_after_install`` makes the second registration raise
    after the first one was installed, to prove that apply() rolls back.
    """

    def install_strategy(op_schema: Any) -> Any:
        return follow_input_strategy(op_schema)

    def registrations() -> list[Strategy]:
        if calls is not None:
            calls.append(name)
        regs = [Strategy(op, install_strategy)]
        if fail_after_install:
            regs.append(_FailingInstall(op))  # type: ignore[arg-type]
        return regs

    return Patch(
        name=name,
        summary="test stand-in",
        ops=(op,),
        gate=SpecifierSet(">=2.0"),
        registrations=registrations,
        reproduce=reproduce,
    )


class _FailingInstall:
    """A registration whose install raises, as a moved torch internal would."""

    kind = "failing"

    def __init__(self, op: str) -> None:
        self.op = op
        self.concerns = (op,)

    def entries(self) -> list[tuple[str, Any]]:
        from dtensor_patches._torch.schemas import resolve_op

        return [("propagator.op_strategy_funcs", resolve_op(self.op))]

    def install(self) -> None:
        raise RuntimeError("simulated failure while installing")

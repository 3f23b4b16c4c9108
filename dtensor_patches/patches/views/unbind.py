"""``aten.unbind.int`` has no sharding strategy on torch 2.9.

Trigger: ``x.unbind(d)`` (also ``for row in x``-style iteration and ``torch.stack`` inverses in
user code) on any DTensor.

Fix: each output is one slice along ``d``: shards on other dims stay sharded (renumbered past
``d``), a shard on ``d`` itself is gathered first. Measured fixed upstream in torch 2.10; from
2.10 torch's own strategy refuses to unbind along a sharded dim, which this patch does not
override.
"""

from __future__ import annotations

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.patches._builders import dims_arg, dimwise
from dtensor_patches.reproducers import Case, randn
from dtensor_patches.strategies import arg, normalize_dims, tensor_meta


def _num_outputs(op_schema: object) -> int:
    shape = tensor_meta(op_schema.args_schema[0]).shape  # type: ignore[attr-defined]
    (dim,) = normalize_dims(arg(op_schema, 1, "dim", 0), len(shape))
    return int(shape[dim])


def _registrations() -> list[Strategy]:
    return [
        dimwise(
            "aten.unbind.int",
            dims=dims_arg(1, default=0),
            keepdim=False,
            num_outputs=_num_outputs,
            tuple_output=True,
        )
    ]


# Along unsharded dims only: that is the 2.9 gap. Unbinding along a sharded dim is refused
# from 2.10 by torch's own strategy (an explicit error, not a wrong result), which this patch
# does not override; on 2.9 the patch gathers that dim (tested in the oracle suite).
# The tripwire's cases: ``unbind`` along unsharded dims vs single-device results.
CASES = [
    Case("x.unbind(1)", lambda x: torch.stack(x.unbind(1)), lambda: [randn(4, 6)], ["S0"]),
    Case("x.unbind(0)", lambda x: x.unbind(0), lambda: [randn(3, 4, 6)], ["S2"]),
    Case("x.unbind(1) one output", lambda x: x.unbind(1), lambda: [randn(4, 1)], ["S0"]),
]


PATCH = Patch(
    name="unbind",
    summary="strategy for aten.unbind.int (torch 2.9)",
    ops=("aten.unbind.int",),
    gate=SpecifierSet(">=2.9,<2.10"),
    registrations=_registrations,
    cases=CASES,
    upstream_fix="native strategy from torch 2.10 (measured)",
    communication="only a shard on `dim`",
)

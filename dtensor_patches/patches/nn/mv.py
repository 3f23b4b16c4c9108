"""Matrix-vector products have no sharding strategy on torch 2.9 and 2.10: ``aten.mv`` (also
``matrix @ vector`` and ``torch.matmul`` with a 1-d right operand) and ``aten.addmv``.

Trigger: a scalar head written as ``hidden @ w`` with a 1-d ``w`` (value heads, reward heads,
probes) on a DTensor: ``NotImplementedError: Operator aten.mv.default does not have a sharding
strategy registered``.

Fix: per mesh dim, for ``mv(A[m, k], v[k])``:

- ``A`` sharded on rows: the output is sharded alike, ``v`` replicated (no communication);
- ``A`` sharded on columns or ``v`` sharded: both are sharded along ``k`` and the output is
  ``Partial(sum)`` (a shard of the dot products, summed later);
- ``A`` or ``v`` ``Partial(sum)``, the other replicated: ``mv`` is linear in each, the output
  stays ``Partial(sum)``;
- anything else is replicated first.

``addmv(b, A, v, beta, alpha)``: ``b`` takes the output's placement (a replicated ``b`` becomes
a ``Partial(sum)`` share without communication). Measured fixed upstream in torch 2.11.
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.dtensors import dtensor_types, spec_with_placements
from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.reproducers import Case, randn
from dtensor_patches.strategies import is_shard, redistribute_cost, reduce_op_of


def _rule(a: Any, v: Any) -> tuple[Any, Any, Any]:
    """(placement for A, for v, for the output) on one mesh dim."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if is_shard(a) and a.dim == 0:
        return a, Replicate(), Shard(0)
    if (is_shard(a) and a.dim == 1) or (is_shard(v) and v.dim == 0):
        return Shard(1), Shard(0), Partial("sum")
    if reduce_op_of(a) == "sum" and not reduce_op_of(v):
        return a, Replicate(), a
    if reduce_op_of(v) == "sum" and not reduce_op_of(a):
        return Replicate(), v, v
    return Replicate(), Replicate(), Replicate()


def _strategy(op_schema: Any, first: int) -> Any:
    """``first``: position of the matrix (0 for ``mv``, 1 for ``addmv`` after the bias)."""
    from torch.distributed.tensor import Replicate

    types = dtensor_types()
    args = op_schema.args_schema
    matrix, vector = args[first], args[first + 1]
    bias = args[0] if first == 1 else None
    current_a = matrix.strategies[0].output_spec
    current_v = vector.strategies[0].output_spec
    specs = []
    seen = set()
    candidates = [(s.output_spec.placements, current_v.placements) for s in matrix.strategies]
    candidates += [(current_a.placements, s.output_spec.placements) for s in vector.strategies]
    # Everything replicated: always possible, the fallback when no other candidate is.
    replicated = tuple(Replicate() for _ in current_a.placements)
    candidates.append((replicated, replicated))
    for a_placements, v_placements in candidates:
        triples = [_rule(a, v) for a, v in zip(a_placements, v_placements, strict=True)]
        key = repr(triples)
        if key in seen:
            continue
        seen.add(key)
        out = tuple(t[2] for t in triples)
        wanted = [
            spec_with_placements(current_a, tuple(t[0] for t in triples)),
            spec_with_placements(current_v, tuple(t[1] for t in triples)),
        ]
        strategies = [matrix, vector]
        if bias is not None:
            bias_spec = bias.strategies[0].output_spec
            rows = int(current_a.shape[0])
            placements = tuple(_bias_placement(p, tuple(bias_spec.shape), rows) for p in out)
            if any(
                is_shard(have) and reduce_op_of(want)
                for have, want in zip(bias_spec.placements, placements, strict=True)
            ):
                continue  # DTensor cannot redistribute Shard -> Partial
            wanted.insert(0, spec_with_placements(bias_spec, placements))
            strategies.insert(0, bias)
        costs = [
            [redistribute_cost(s.output_spec, w) for s in st.strategies]
            for st, w in zip(strategies, wanted, strict=True)
        ]
        specs.append(
            types.OpSpec(
                output_specs=types.DTensorSpec(current_a.mesh, out),
                input_specs=tuple(wanted),
                redistribute_cost=costs,
            )
        )
    return types.OpStrategy(specs)


def _bias_placement(out: Any, shape: tuple[int, ...], rows: int) -> Any:
    """Where ``addmv``'s bias must be for an output placed ``out`` (on one mesh dim)."""
    from torch.distributed.tensor import Partial, Replicate

    if reduce_op_of(out):
        # Added once in total: one rank holds it, the others zeros (no communication).
        return Partial("sum")
    if is_shard(out) and shape == (rows,):
        return out
    return Replicate()  # replicated output, or a broadcast (size-1 / 0-d) bias


def _mv(op_schema: Any) -> Any:
    return _strategy(op_schema, 0)


def _addmv(op_schema: Any) -> Any:
    return _strategy(op_schema, 1)


def _registrations() -> list[Strategy]:
    return [Strategy("aten.mv.default", _mv), Strategy("aten.addmv.default", _addmv)]


# The tripwire's cases: ``mv``/``addmv`` with row, column, vector and ``Partial`` placements vs single-device.
CASES = [
    Case("A @ v, A rows", lambda a, v: a @ v, lambda: [randn(5, 6), randn(6, seed=1)], ["S0", "R"]),
    Case("A @ v, A cols", lambda a, v: a @ v, lambda: [randn(5, 6), randn(6, seed=1)], ["S1", "R"]),
    Case("mv(A, v), v", torch.mv, lambda: [randn(5, 6), randn(6, seed=1)], ["R", "S0"]),
    Case("mv(P, v)", torch.mv, lambda: [randn(5, 6), randn(6, seed=1)], ["P", "R"]),
    Case(
        "addmv(b, A, v)",
        lambda b, a, v: torch.addmv(b, a, v, beta=0.5, alpha=2.0),
        lambda: [randn(5, seed=2), randn(5, 6), randn(6, seed=1)],
        ["R", "S1", "S0"],
    ),
    Case(
        "addmv(b, A, v)",
        torch.addmv,
        lambda: [randn(5, seed=2), randn(5, 6), randn(6, seed=1)],
        ["S0", "S0", "R"],
    ),
    Case(
        "addmv(b, A, v), b sharded, A and v along k",
        torch.addmv,
        lambda: [randn(5, seed=2), randn(5, 6), randn(6, seed=1)],
        ["S0", "S1", "S0"],
    ),
]


PATCH = Patch(
    name="mv",
    summary="strategies for mv and addmv (torch 2.9, 2.10)",
    ops=("aten.mv.default", "aten.addmv.default"),
    gate=SpecifierSet(">=2.9,<2.11"),
    registrations=_registrations,
    cases=CASES,
    upstream_fix="native strategies from torch 2.11 (measured)",
    communication="none, except a sharded vector against a row-sharded matrix (gathered)",
)

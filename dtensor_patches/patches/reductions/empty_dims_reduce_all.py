"""A reduction given an empty dim list (``dim=[]``, ``dim=()``), which ATen reads as "every
dim", is wrong or raises on a sharded DTensor, on every release 2.9 to 2.15.

Trigger (measured on 2.9.1, 2.11.0, 2.13.0 and 2.15.0, stock and with ``apply_all()``): ``x``
placed ``Shard(0)``, then ``x.sum([], keepdim=True)``, ``x.mean([], keepdim=True)``,
``x.std([], keepdim=True)``, ``vector_norm(x, dim=[], keepdim=True)``: torch's strategies read
the empty list as "no dim reduced" and keep ``Shard(0)`` on a ``[1, 1]`` result, so each rank
holds its own shard's reduction and the DTensor claims one value (silently wrong). Without
``keepdim`` the same calls raise ``IndexError: list index out of range`` in propagation
(``sum``, ``mean``, ``var``, ``var_mean``, ``vector_norm``, ``count_nonzero``). User code
rarely writes ``dim=[]``, but autograd does: the gradient of ``x.amax()``, ``x.amin()``,
``x.max()`` and ``x.min()`` over every dim divides by ``mask.sum([], keepdim=True)`` (the
number of ties), so on a sharded ``x`` it divided by each rank's own count: a tie split across
ranks got a gradient of 1 at each maximum instead of 1/2, and a shard holding no maximum got
``nan``/``inf`` (``0 / 0``) where one device gives 0. That is also why the strategy
validator's ``amax``/``amin``/``norm.inf`` ranks still "crashed" with the patches applied.

Fix (a miss rule, consulted only on a cache miss): a call of one of these reductions whose dim
list is empty, on an input that is not replicated everywhere, runs again with the dims written
out (``[0, ..., ndim - 1]``, the same result in ATen), which torch's strategies reduce
correctly. Other calls keep torch's cached decision and pay nothing; the rewritten call goes
through torch's own path (no communication beyond the reduction's own).
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches.calls import Call
from dtensor_patches.dispatch.miss_rules import ANY_OP, DivertedCall, NativeDecision
from dtensor_patches.patch import MissRule, Patch
from dtensor_patches.reproducers import Case, randn

# op -> (position of its dim list, its keyword): the overloads whose ``dim`` is an ``int[]``
# (or ``int[]?``) that ATen reads as every dim when empty. Not ``logsumexp``: on plain tensors
# ``torch.logsumexp(x, [])`` raises, so a DTensor answer would be one torch does not give.
_DIM_LISTS: dict[str, tuple[int, str]] = {
    "aten.sum.dim_IntList": (1, "dim"),
    "aten.sum.IntList_out": (1, "dim"),
    "aten.mean.dim": (1, "dim"),
    "aten.mean.out": (1, "dim"),
    "aten.nansum.default": (1, "dim"),
    "aten.nansum.out": (1, "dim"),
    "aten.amax.default": (1, "dim"),
    "aten.amax.out": (1, "dim"),
    "aten.amin.default": (1, "dim"),
    "aten.amin.out": (1, "dim"),
    "aten.var.correction": (1, "dim"),
    "aten.var.correction_out": (1, "dim"),
    "aten.std.correction": (1, "dim"),
    "aten.std.correction_out": (1, "dim"),
    "aten.var_mean.correction": (1, "dim"),
    "aten.std_mean.correction": (1, "dim"),
    "aten.linalg_vector_norm.default": (2, "dim"),
    "aten.linalg_vector_norm.out": (2, "dim"),
    "aten.count_nonzero.dim_IntList": (1, "dim"),
}


def _dims_given(name: str, args: Any, kwargs: Any) -> Any:
    index, keyword = _DIM_LISTS[name]
    return args[index] if len(args) > index else kwargs.get(keyword)


def _rule(schema: Any, native: NativeDecision) -> DivertedCall | None:
    name = str(schema.op)
    if name not in _DIM_LISTS or not schema.args_schema:
        return None
    dims = _dims_given(name, schema.args_schema, schema.kwargs_schema)
    if not isinstance(dims, list | tuple) or len(dims) > 0:
        return None  # ``None`` (every dim, said plainly) or real dims: torch reads them right
    spec = schema.args_schema[0]
    placements = getattr(spec, "placements", None)
    if not placements or len(spec.shape) == 0 or all(p.is_replicate() for p in placements):
        return None  # nothing sharded or pending: the local reduction is the whole one
    return _with_every_dim


def _with_every_dim(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The call with its empty dim list replaced by every dim of its input."""
    index, keyword = _DIM_LISTS[str(op_call)]
    every = list(range(args[0].dim()))
    if len(args) > index:
        args = (*args[:index], every, *args[index + 1 :])
    else:
        kwargs = {**kwargs, keyword: every}
    return op_call(*args, **kwargs)


def _concerns(call: Call) -> bool | None:
    """A recorded call keeps its placements, not its dim list: ``False``, since user code
    rarely passes ``dim=[]`` (the gradients that do are recorded as ``sum`` calls like any
    other; the miss rule acts on them whenever they happen)."""
    return False


def _registrations() -> list[MissRule]:
    return [MissRule(ANY_OP, _rule)]


def _grad_of(fn: Any) -> Any:
    """``x -> d fn(x).sum() / dx`` (a fresh leaf, so DTensors and plain tensors alike)."""

    def grad(x: Any) -> Any:
        leaf = x.detach().requires_grad_(True)
        (out,) = torch.autograd.grad(fn(leaf).sum(), leaf)
        return out

    return grad


# The tripwire's cases: empty dim lists on sharded inputs, and the gradients that make them.
# Sizes that leave no rank an empty shard on 2 or 4 ranks: stock torch's extremum of an empty
# shard raises on that rank alone and the others wait (``empty_shard_extrema``).
CASES = [
    Case(
        "x.sum([], keepdim=True) Shard(0)",
        lambda x: x.sum([], keepdim=True),
        lambda: [randn(4, 3)],
        ["S0"],
    ),
    Case("x.mean(dim=()) Shard(1)", lambda x: x.mean(dim=()), lambda: [randn(4, 8)], ["S1"]),
    Case("x.var([]) Shard(0)", lambda x: x.var([]), lambda: [randn(4, 3)], ["S0"]),
    Case(
        "vector_norm(x, dim=[]) Shard(1)",
        lambda x: torch.linalg.vector_norm(x, dim=[]),
        lambda: [randn(3, 4)],
        ["S1"],
    ),
    Case(
        "grad of x.amax(), tie across shards",
        _grad_of(lambda x: x.amax()),
        lambda: [torch.tensor([[3.0, 1.0], [0.5, 2.0], [3.0, 0.0], [1.0, 1.0]])],
        ["S0"],
    ),
    Case("grad of x.amin() Shard(1)", _grad_of(lambda x: x.amin()), lambda: [randn(4, 7)], ["S1"]),
]


PATCH = Patch(
    name="empty_dims_reduce_all",
    summary="a reduction given an empty dim list (every dim, in ATen) reduces every dim of a "
    "sharded input instead of keeping its shards or raising; fixes the gradients of "
    "amax()/amin()/max()/min() over every dim",
    ops=tuple(_DIM_LISTS),
    gate=SpecifierSet(">=2.9"),
    overrides_existing=True,
    registrations=_registrations,
    concerns=_concerns,
    cases=CASES,
    # On 2.11 the amax() gradient also divides by the pending tie count (partial_divisor's).
    requires=("partial_divisor",),
    communication="the reduction's own (a pending or all-reduced result, as for explicit dims)",
)

"""In-place writes on DTensors: ``Partial`` targets, fills, and writes through views.

These in-place writes are wrong or refused by stock DTensor (measured on 2.9.1 to
2.15.0, 2-rank gloo mesh):

1. **An in-place op on a ``Partial`` target.** ``n = torch.linalg.vector_norm(x); n += 2``
   or ``p.clamp_(min=0.5)`` with ``p`` a ``Partial(sum)`` DTensor: on 2.9/2.10 each rank
   applies the op to its own share, so ``n += 2`` adds 2 per rank and ``clamp_`` clamps the
   shares (silently wrong); from 2.12 DTensor refuses ("in-place operations that require
   placement changes are not supported"). ``p.fill_(3)`` on a ``Partial(sum)`` target gives
   ``world * 3`` on every release. ``Partial(max)``/``Partial(min)`` targets: ``neg_`` or
   ``mul_(-1)`` are not linear for a max/min reduction.
2. ``aten.fill_.Tensor`` (``x[:, 0] = 1.0``, ``x.fill_(t)``) has no sharding strategy on any
   release (2.15 routes ``x[:, 0] = 1.0`` differently, but ``x.fill_(t)`` still fails).
3. **An in-place foreach op with a ``Partial`` tensor in its written list** (``torch.
   _foreach_mul_(grads, clip_coef)``, what ``clip_grad_norm_`` runs; ``_foreach_div_``,
   ``_foreach_add_``...): on 2.9 to 2.11 every ``Partial`` target keeps its old value, silently
   (the sequence-parallel gradients of a TP + SP model go unclipped); 2.12 writes them.

Where it acts, and what that costs: one miss rule for every op (``ANY_OP``), consulted
only when a call meets sharding propagation without a cached decision. Calls whose schema shows
none of the conditions below keep torch's decision, which is cached as usual: the common case
(an ordinary ``add_``, ``copy_`` or ``mul_``) stays on torch's fast path and pays nothing per call.

- *In-place op whose target is ``Partial``* (seen in the schema: the target spec's
  placements). Ops linear in the target where torch is right (``mul_``/``div_`` by a number,
  ``neg_``, ``zero_`` on ``Partial(sum/avg)``, from 2.11), and ``copy_`` from a source placed
  exactly like the target, stay with torch. Every other call computes first: the target's
  reduced value (one all-reduce, out of place), the op applied to it, then the new value
  written back as shares of the target's *own* placements (``Partial(sum)``: the value on mesh
  coordinate 0, zeros elsewhere; ``avg``/``max``/``min``: the value everywhere). The target
  keeps its placements and never holds a half-reduced state: a view of a ``Partial`` base
  writes valid shares into the base's memory, so the base stays consistent and nothing is
  doubled. Ops that overwrite every element (``fill_``, ``copy_``, ``zero_``, random fills)
  need no reduction at all. A failed op leaves the target untouched (the write is the last
  step).
- *In-place foreach op with a ``Partial`` target* (2.9 to 2.11, seen in the schema: a
  ``Partial`` spec in the written list): the ``Partial`` targets are computed by the
  out-of-place foreach op on their reduced operands and written back as shares, as above; the
  other targets run torch's own in-place foreach op. Ops linear in the targets
  (``_foreach_mul_``/``_foreach_div_`` by a number or a replicated 0-dim tensor on
  ``Partial(sum/avg)``, ``_foreach_zero_``) scale the shares where they are instead, with no
  communication. From 2.12 torch writes them itself, but refuses those it has no
  placement-keeping strategy for (``_foreach_zero_``, ``_foreach_exp_``: "in-place operations
  that require placement changes"): those take the same path instead of the fallback's gather.
  The list without a ``Partial`` target (every optimizer step on parameters) keeps torch's
  cached decision.
- *In-place op torch refuses as a placement change* (``x.add_(r)`` with ``x`` sharded on a dim
  shorter than the mesh, 2.12+): computed out of place and written into the target in its own
  placements.

Upstream: torch made the ``Partial`` case raise instead of computing wrong values (2.12,
"in-place operations that require placement changes are not supported"); no release
carries writes through redistributed views.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from dtensor_patches._torch.dtensors import (
    dtensor_class,
    dtensor_types,
    has_base,
    local_tensor,
    relabel,
    rewrap,
)
from dtensor_patches._torch.modes import foreach_mul_
from dtensor_patches._torch.schemas import resolve_op, writes_self
from dtensor_patches._torch.tables import has_native_strategy
from dtensor_patches._torch.versions import torch_release
from dtensor_patches.calls import partial_or_sharded_target
from dtensor_patches.dispatch.miss_rules import ANY_OP, DivertedCall, NativeDecision
from dtensor_patches.dispatch.shards import partial_shares
from dtensor_patches.patch import MissRule, Patch, Registration, Strategy
from dtensor_patches.reproducers import Case, randn
from dtensor_patches.strategies import elementwise_strategy, uniform_strategy

__all__ = ["PATCH"]


class _Kind(enum.Enum):
    """How an in-place op treats a ``Partial`` target."""

    REDUCES = "needs the reduced value"  # non-linear or affine
    LINEAR = "linear in the target"  # shares stay valid shares
    OVERWRITES = "overwrites every element"  # old shares irrelevant


# Classified in-place ops; any other in-place op on a Partial target counts as REDUCES, which
# is correct for every op (it only costs the reduction).
_KINDS: dict[str, _Kind] = {
    "aten.zero_.default": _Kind.LINEAR,
    "aten.mul_.Scalar": _Kind.LINEAR,
    "aten.div_.Scalar": _Kind.LINEAR,
    "aten.neg_.default": _Kind.LINEAR,
    "aten.fill_.Scalar": _Kind.OVERWRITES,
    "aten.fill_.Tensor": _Kind.OVERWRITES,
    "aten.copy_.default": _Kind.OVERWRITES,
    "aten.normal_.default": _Kind.OVERWRITES,
    "aten.uniform_.default": _Kind.OVERWRITES,
}

# ``x.mul_(3.0)`` reaches DTensor as ``mul_.Tensor`` with a Python number: linear then.
_LINEAR_WITH_NUMBER = frozenset({"aten.mul_.Tensor", "aten.div_.Tensor"})

# Measured: on 2.9 native div_/neg_ on a Partial target leave it unchanged, on 2.10 they
# raise; only from 2.11 does torch keep Partial(sum/avg) correctly in place.
_NATIVE_LINEAR_INPLACE_ON_PARTIAL = Version("2.11")
_LINEAR_REDUCE_OPS = frozenset({"sum", "avg"})

# What DTensor (2.12+) says when an in-place op's strategies all change the target's placement.
_PLACEMENT_CHANGE_REFUSAL = "in-place operations that require placement changes"


def _follow_self(op_schema: Any) -> Any:
    return elementwise_strategy(op_schema, driver=0)


# Strategies the native path needs where torch has none (measured): ``fill_.Tensor`` and
# ``fill.Tensor`` on every release so far, ``clamp_min_``/``clamp_max_`` up to 2.12.
_STRATEGIES_IF_MISSING: dict[str, Callable[[Any], Any]] = {
    "aten.fill_.Tensor": uniform_strategy,
    "aten.fill.Tensor": uniform_strategy,
    "aten.clamp_min_.default": _follow_self,
    "aten.clamp_max_.default": _follow_self,
}

# Writes through views that DTensor had to redistribute: the ``view_writes`` patch.

# --- the miss rule ------------------------------------------------------------------------


def _is_spec(value: Any) -> bool:
    return isinstance(value, dtensor_types().DTensorSpec)


def _call_kind(name: str, args: Any, placements: Any) -> _Kind:
    """How the in-place op ``name`` called with ``args`` (the schema's or the call's: the
    second one is the same Python number in both) treats a target placed as ``placements``."""
    kind = _KINDS.get(name, _Kind.REDUCES)
    if (
        name in _LINEAR_WITH_NUMBER
        and len(args) > 1
        and isinstance(args[1], (int, float))
        and not isinstance(args[1], bool)
    ):
        kind = _Kind.LINEAR
    if kind is _Kind.LINEAR:
        from torch.distributed.tensor import Partial

        reduce_ops = {str(p.reduce_op) for p in placements if p.is_partial()}
        # A Partial subclass with a reduction of its own (a pending p-norm: reduce_op "sum",
        # but its shares combine as a norm) is not linear in a negative factor.
        own = any(p.is_partial() and type(p) is not Partial for p in placements)
        if (
            own
            or torch_release() < _NATIVE_LINEAR_INPLACE_ON_PARTIAL
            or not (reduce_ops <= _LINEAR_REDUCE_OPS)
        ):
            return _Kind.OVERWRITES if name == "aten.zero_.default" else _Kind.REDUCES
    return kind


def _rule(schema: Any, native: NativeDecision) -> DivertedCall | None:
    op = schema.op
    args = schema.args_schema
    if torch.Tag.inplace_view in op.tags:
        return None  # squeeze_, transpose_: a view, no value (inplace_view_shape's business)
    if writes_self(op) and args and _is_spec(args[0]):
        target = args[0]
        if any(p.is_partial() for p in target.placements):
            kind = _call_kind(str(op), args, target.placements)
            if kind is _Kind.LINEAR:
                return None
            if (
                str(op) == "aten.copy_.default"
                and len(args) > 1
                and _is_spec(args[1])
                and tuple(args[1].placements) == tuple(target.placements)
            ):
                return None  # copies the shares: torch is right, with no communication
            return _write_partial_target
        error = native.error()
        if error is not None:
            if _PLACEMENT_CHANGE_REFUSAL in str(error) and _has_twin(op):
                return _through_out_of_place
            return None
        if _misplaces_target(native, target) and _has_twin(op):
            return _through_out_of_place
        return None
    if writes_self(op) and args and _partial_in_list(args[0]):
        if torch_release() < _FOREACH_PARTIAL_TARGETS_WRITTEN:
            return _write_foreach_targets
        # 2.12+ writes them where it has a strategy, and refuses the others (``_foreach_zero_``,
        # ``_foreach_exp_``, ...) as a placement change, which the fallback would answer by
        # gathering every tensor of the list.
        error = native.error()
        if error is not None and _PLACEMENT_CHANGE_REFUSAL in str(error):
            return _write_foreach_targets
    return None


# --- Partial targets ------------------------------------------------------------------------

# Measured: up to 2.11 an in-place foreach op (``_foreach_mul_``, ``_foreach_div_``,
# ``_foreach_add_``, ...) leaves every ``Partial`` tensor of its written list unchanged (the
# write lands in a redistributed copy); 2.12 writes them.
_FOREACH_PARTIAL_TARGETS_WRITTEN = Version("2.12")


def _partial_in_list(value: Any) -> bool:
    return isinstance(value, list | tuple) and any(
        _is_spec(v) and any(p.is_partial() for p in v.placements) for v in value
    )


def _reduced_all(value: Any) -> Any:
    """:func:`_reduced` of ``value``, or of each item of a list of them."""
    if isinstance(value, list | tuple):
        return [_reduced(v) for v in value]
    return _reduced(value)


def _write_foreach_targets(op_call: Any, args: Any, kwargs: Any) -> None:
    """An in-place foreach op with a ``Partial`` tensor among its written list. The ``Partial``
    targets: the out-of-place foreach op on their reduced operands, each result written into
    its target as shares of the target's own placements (:func:`_shares_of`). The other
    targets (torch writes those right): torch's own in-place foreach op on them alone. The
    ``Partial`` targets' results are computed before any target is written; placements
    unchanged. Cost: one all-reduce per ``Partial`` target (and ``Partial`` operand of it),
    except for ops linear in the targets (``_foreach_mul_``/``_foreach_div_`` by a number or a
    replicated 0-dim tensor on ``Partial(sum/avg)``, ``_foreach_zero_``: what gradient clipping
    and ``zero_grad`` run), which scale the shares where they are and move nothing
    (:func:`_scale_foreach_shares`)."""
    targets = list(args[0])
    count = len(targets)
    pending = [i for i, t in enumerate(targets) if any(p.is_partial() for p in t.placements)]
    rest = [i for i in range(count) if i not in set(pending)]
    factor = _linear_factor(op_call, args, kwargs, [targets[i] for i in pending])
    if factor is not _NOT_LINEAR:
        _scale_foreach_shares(op_call, args, kwargs, pending, rest, factor)
        return

    def pick(value: Any, positions: list[int], reduce: bool) -> Any:
        if isinstance(value, list | tuple) and len(value) == count:
            picked = [value[i] for i in positions]
            return [_reduced(v) for v in picked] if reduce else picked
        return _reduced(value) if reduce else value

    with torch.no_grad():
        results = _out_of_place(op_call)(
            *[pick(a, pending, True) for a in args],
            **{k: pick(v, pending, True) for k, v in kwargs.items()},
        )
        planned = [
            _shares_of(op_call, targets[i], result)
            for i, result in zip(pending, results, strict=True)
        ]
        if rest:
            op_call(
                *[pick(a, rest, False) for a in args],
                **{k: pick(v, rest, False) for k, v in kwargs.items()},
            )
        for i, (new_local, written) in zip(pending, planned, strict=True):
            target = targets[i]
            local_tensor(target).copy_(new_local)
            if written != tuple(target.placements):
                relabel(target, written)


# In-place foreach ops linear in each target: scaling or zeroing every share scales or zeroes
# the pending sum (or mean), so the shares are written where they are, with no reduction.
# ``zero_`` is right for every reduction (all shares zero reduce to zero).
_FOREACH_SCALES = frozenset(
    {
        "aten._foreach_mul_.Scalar",
        "aten._foreach_mul_.ScalarList",
        "aten._foreach_mul_.Tensor",
        "aten._foreach_div_.Scalar",
        "aten._foreach_div_.ScalarList",
        "aten._foreach_div_.Tensor",
    }
)
_FOREACH_ZERO = "aten._foreach_zero_.default"
_NOT_LINEAR = object()


def _linear_factor(op_call: Any, args: Any, kwargs: Any, pending: list[Any]) -> Any:
    """The factor of an in-place foreach op that is linear in every ``Partial`` target of
    ``pending`` (``None`` for ``_foreach_zero_``; the local tensor of a ``Tensor`` factor), or
    :data:`_NOT_LINEAR`. Linear: ``_foreach_zero_`` on any ``Partial``; ``_foreach_mul_``/
    ``_foreach_div_`` by numbers, or by one 0-dim tensor held whole on every rank (a plain
    tensor or an all-``Replicate()`` DTensor: what ``clip_grad_norm_`` scales by), on targets
    whose every ``Partial`` is torch's own ``Partial`` of ``sum`` or ``avg``."""
    from torch.distributed.tensor import Partial

    name = str(op_call)
    if name == _FOREACH_ZERO:
        return None
    if name not in _FOREACH_SCALES or kwargs:
        return _NOT_LINEAR
    for target in pending:
        for p in target.placements:
            if p.is_partial() and (
                type(p) is not Partial or str(p.reduce_op) not in _LINEAR_REDUCE_OPS
            ):
                return _NOT_LINEAR
    factor = args[1] if len(args) > 1 else None
    if name.endswith(".Tensor"):
        if not isinstance(factor, torch.Tensor) or factor.dim() != 0:
            return _NOT_LINEAR
        if isinstance(factor, dtensor_class()):
            if not all(p.is_replicate() for p in factor.placements):
                return _NOT_LINEAR
            return local_tensor(factor)
        return factor
    return factor


def _scale_foreach_shares(
    op_call: Any, args: Any, kwargs: Any, pending: list[int], rest: list[int], factor: Any
) -> None:
    """:func:`_write_foreach_targets` for an op linear in each ``Partial`` target
    (:func:`_linear_factor`): torch's own op on the other targets, then the same op on the
    ``Partial`` targets' local shares. No communication; placements unchanged. A failure of
    torch's op leaves every ``Partial`` target as it was."""
    targets = list(args[0])
    count = len(targets)
    if rest:
        picked = [
            [a[i] for i in rest] if isinstance(a, list | tuple) and len(a) == count else a
            for a in args
        ]
        op_call(*picked, **kwargs)
    shares = [local_tensor(targets[i]) for i in pending]
    with torch.no_grad():
        if factor is None:
            op_call(shares)
        elif isinstance(factor, list | tuple):
            op_call(shares, [factor[i] for i in pending])
        else:
            op_call(shares, factor)


def _shares_of(op_call: Any, target: Any, value: Any) -> tuple[torch.Tensor, tuple[Any, ...]]:
    """The local tensor that makes ``target`` hold ``value`` (a DTensor of its shape) in its own
    placements (``Partial(sum)``: the value on mesh coordinate 0, zeros elsewhere), and those
    placements (a ``Partial`` subclass with its own reduction becomes ``Replicate()``; refused
    for a view, whose base would be left inconsistent)."""
    mesh, placements = target.device_mesh, tuple(target.placements)
    written = _written_placements(op_call, target)
    settled = value.redistribute(mesh, _settled(placements))
    shares = partial_shares(local_tensor(settled), mesh, written)
    return shares.to(local_tensor(target).dtype), written


def _written_placements(op_call: Any, target: Any) -> tuple[Any, ...]:
    """The placements ``target`` holds a written value in: its own, with each ``Partial``
    subclass that has a reduction of its own (``_NormPartial``) as ``Replicate()``.

    Raises:
        RuntimeError: such a target is a view (its base would be left inconsistent).
    """
    from torch.distributed.tensor import Partial, Replicate

    placements = tuple(target.placements)
    own_reduction = [p.is_partial() and type(p) is not Partial for p in placements]
    if any(own_reduction) and has_base(target):
        raise RuntimeError(
            f"{op_call}: in-place write into a view of a DTensor placed {placements}, whose "
            "pending reduction cannot hold arbitrary values as shares; reduce it first "
            "(x = x.redistribute(placements=[Replicate()]) or x.full_tensor())"
        )
    return tuple(
        Replicate() if own else p for p, own in zip(placements, own_reduction, strict=True)
    )


def _settled(placements: Any) -> list[Any]:
    from torch.distributed.tensor import Replicate

    return [Replicate() if p.is_partial() else p for p in placements]


def _reduced(value: Any) -> Any:
    """``value`` with every ``Partial`` mesh dim reduced (a DTensor), else ``value``."""
    if isinstance(value, dtensor_class()) and any(p.is_partial() for p in value.placements):
        return value.redistribute(value.device_mesh, _settled(value.placements))
    return value


def _write_partial_target(op_call: Any, args: Any, kwargs: Any) -> Any:
    """Compute the op on the reduced value of the target, then write the result back as shares
    of the target's own placements. Placements unchanged; nothing written until the end.

    ``Partial`` subclasses with their own reduction (``_NormPartial`` of a vector norm) cannot
    hold an arbitrary value as shares (a norm's shares reduce to a non-negative value): those
    mesh dims become ``Replicate()`` holding the value, which is only safe when nothing else
    aliases the target, so a view of such a target is refused.
    """
    target = args[0]
    mesh, placements = target.device_mesh, tuple(target.placements)
    written = _written_placements(op_call, target)
    kind = _call_kind(str(op_call), args, placements)
    with torch.no_grad():
        if kind is _Kind.OVERWRITES:
            # Every element is overwritten: start from zeros, no reduction needed.
            scratch = dtensor_class().from_local(
                torch.zeros_like(local_tensor(target)),
                mesh,
                _settled(placements),
                run_check=False,
                shape=target.shape,
                stride=target.stride(),
            )
        else:
            plain = rewrap(target)
            scratch = plain.redistribute(mesh, _settled(placements))
        # The other operands' pending sums are reduced too: torch's in-place strategies with a
        # replicated target and Partial operands are not all right (``addmv_(R, P, P)`` adds
        # each rank's ``mat_i @ vec_i``; measured 2.13.0 by tools/validate), and a product of
        # two pending sums is never the sum of the products.
        others = [_reduced(a) for a in args[1:]]
        op_call(scratch, *others, **{k: _reduced(v) for k, v in kwargs.items()})
        new_local = partial_shares(local_tensor(scratch), mesh, written)
        local_tensor(target).copy_(new_local)
        if written != placements:
            relabel(target, written)
    return target


# --- in-place calls torch refuses as a placement change -------------------------------------

# The out-of-place twin of an in-place overload, where the overload names differ.
_OUT_OF_PLACE_NAMES = {
    "aten.pow_.Scalar": "aten.pow.Tensor_Scalar",
    "aten.pow_.Tensor": "aten.pow.Tensor_Tensor",
}
# Random fills have no out-of-place twin with the same arguments.
_NO_TWIN = frozenset({"aten.normal_.default", "aten.uniform_.default"})


def _has_twin(op: Any) -> bool:
    if str(op) in _NO_TWIN:
        return False
    try:
        _out_of_place(op)
    except Exception:  # noqa: BLE001 - no out-of-place overload of that name (resize_, set_)
        return False
    return True


def _misplaces_target(native: NativeDecision, target: Any) -> bool:
    """torch decided an output placement other than the in-place target's own (2.13, 2x2 mesh:
    ``s.addmv_(m, v)`` all ``[Shard(0), Replicate()]`` left a local of another layout)."""
    specs = native.output_specs()
    spec = specs[0] if specs else None
    placements = getattr(spec, "placements", None)
    return placements is not None and tuple(placements) != tuple(target.placements)


def _out_of_place(op_call: Any) -> Any:
    name = str(op_call)
    twin = _OUT_OF_PLACE_NAMES.get(name)
    if twin is None:
        namespace, packet, overload = name.split(".")
        twin = f"{namespace}.{packet.removesuffix('_')}.{overload}"
    return resolve_op(twin)


def _through_out_of_place(op_call: Any, args: Any, kwargs: Any) -> Any:
    """Compute the op out of place, then write it into the target in its own placements.

    The result is checked like ATen checks an in-place result: same shape, castable dtype.
    """
    target = args[0]
    if str(op_call) == "aten.copy_.default":
        # ``copy`` (the twin) has no strategy on some releases; the result is ``src`` itself.
        src = args[1]
        result = src.expand(target.shape) if isinstance(src, dtensor_class()) else src
        if not isinstance(result, dtensor_class()):
            raise RuntimeError(f"{op_call}: expected a DTensor source, got {type(src).__name__}")
    else:
        result = _out_of_place(op_call)(*args, **kwargs)
    if tuple(result.shape) != tuple(target.shape):
        raise RuntimeError(
            f"{op_call}: output with shape {list(target.shape)} doesn't match the broadcast "
            f"shape {list(result.shape)}"
        )
    if not torch.can_cast(result.dtype, target.dtype):
        raise RuntimeError(
            f"{op_call}: result type {result.dtype} can't be cast to the desired output type "
            f"{target.dtype}"
        )
    with torch.no_grad():
        placed = result.detach().redistribute(target.device_mesh, target.placements).to_local()
        local_tensor(target).copy_(placed.to(target.dtype))
    return target


def _registrations() -> list[Registration]:
    registrations: list[Registration] = []
    for name, strategy in _STRATEGIES_IF_MISSING.items():
        # Only where torch has none, so a native strategy is never shadowed.
        if not has_native_strategy(resolve_op(name)):
            registrations.append(Strategy(name, strategy))
    registrations.append(MissRule(ANY_OP, _rule))
    return registrations


# --- reproducer -------------------------------------------------------------------------


def _norm_plus_two(x: torch.Tensor) -> torch.Tensor:
    n = torch.linalg.vector_norm(x)
    n += 2
    return n


def _sum_then_clamp(x: torch.Tensor) -> torch.Tensor:
    return x.sum(0).clamp_(min=0.5)


def _sum_then_fill(x: torch.Tensor) -> torch.Tensor:
    return x.sum(0).fill_(3.0)


def _set_element_of_sum(x: torch.Tensor) -> torch.Tensor:
    # A slice, not ``p[0]``: on 2.9 ``select`` has its own bug (the ``select_spec`` patch),
    # which would make this patch's tripwire depend on another patch.
    p = x.sum(0)
    p[0:1] = 5.0
    return p


def _add_through_view_of_sum(x: torch.Tensor) -> torch.Tensor:
    p = x.sum(0)
    p[:2].add_(1.0)
    return p


def _negate_max(x: torch.Tensor) -> torch.Tensor:
    return x.amax(0).mul_(-1.0)


def _first_column(x: torch.Tensor) -> torch.Tensor:
    x[:, 0] = 1.0
    return x


def _fill_with_tensor(x: torch.Tensor) -> torch.Tensor:
    return x.fill_(torch.tensor(2.5))


def _foreach_scale_of_sum(x: torch.Tensor) -> torch.Tensor:
    # What clip_grad_norm_ does to pending sequence-parallel gradients.
    p = x.sum(0)
    foreach_mul_()([p], 0.5)
    return p


# The tripwire's cases: Partial targets (and views), ``fill_.Tensor``; 7 rows: no empty shard.
CASES = [
    Case("vector_norm(x) += 2", _norm_plus_two, lambda: [randn(5, 6)], ["S0"]),
    Case("x.sum(0).clamp_(min=0.5)", _sum_then_clamp, lambda: [randn(5, 6)], ["S0"]),
    Case("x.sum(0).fill_(3)", _sum_then_fill, lambda: [randn(5, 6)], ["S0"]),
    Case("p = x.sum(0); p[0:1] = 5", _set_element_of_sum, lambda: [randn(5, 6)], ["S0"]),
    Case("p = x.sum(0); p[:2].add_(1)", _add_through_view_of_sum, lambda: [randn(5, 6)], ["S0"]),
    Case("x.amax(0).mul_(-1)", _negate_max, lambda: [randn(7, 6)], ["S0"]),
    Case("x[:, 0] = 1.0", _first_column, lambda: [randn(5, 6)], ["S0"], inplace=True),
    Case("x.fill_(tensor)", _fill_with_tensor, lambda: [randn(5, 6)], ["S1"], inplace=True),
    Case("_foreach_mul_([x.sum(0)], 0.5)", _foreach_scale_of_sum, lambda: [randn(5, 6)], ["S0"]),
]


PATCH = Patch(
    name="inplace_writes",
    summary=(
        "in-place ops on Partial targets (and views of them) write valid shares; in-place "
        "calls refused as a placement change run out of place; fill_.Tensor strategy"
    ),
    ops=(*_KINDS, *_STRATEGIES_IF_MISSING),
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    cases=CASES,
    concerns=partial_or_sharded_target,
    overrides_existing=True,
    communication=(
        "nothing on cached calls (ordinary `add_`, `copy_`, `mul_` stay on torch's fast "
        "path); a `Partial` target: one all-reduce"
    ),
)

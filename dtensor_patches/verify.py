"""``with dtensor_patches.verify():``: find the DTensor op that is silently wrong in a step.

Every DTensor call inside the block (forward and backward, at the top of dispatch) is run
twice: as DTensor runs it, and as the same op on the full plain tensors (every DTensor input
gathered, ``Partial`` inputs reduced). The DTensor result's full value, shape and dtype must
equal the plain one: integers, bools and indices exactly, floating values within
``atol``/``rtol``. In-place and ``out=`` ops are judged by the tensor they wrote, and where
that tensor is a view of another DTensor (its *base*), by the base too: a write that the view
kept and its base lost is a mismatch. A view's value in the reference is its place in its
base's current value (as on one device), so a view that holds a stale copy of its base is
found too (issue 23, item 17). Views are judged by their full value, ``Partial`` results by
their reduced value, multi-output ops output by output; ``aten._local_scalar_dense``
(``.item()``, ``tolist()``, ``int()``, ``float()``) by the Python number. Every DTensor the call touched must also still be self-consistent: its local
shape is the one its spec implies (a strategy that writes into its input's spec breaks that).

Random ops (``dropout``, ``rand_like``…) run unchecked and are counted as such, and so are ops
whose plain reference raises or whose output is uninitialised memory (``empty_like``).

Cost: everything is gathered, every op runs twice, forward stack traces are recorded for
backward ops (autograd anomaly mode). It is for debugging a few steps, never for training;
``benchmarks/verify_cost.py`` measures it.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from dtensor_patches import state
from dtensor_patches._callable_module import call_through
from dtensor_patches._torch import tables as torch_tables
from dtensor_patches._torch.dtensors import (
    base_of,
    dtensor_class,
    full_value,
    local_shape_and_offset,
    local_tensor,
    spec_shape,
)
from dtensor_patches._torch.modes import (
    accumulating_grad,
    current_autograd_node,
    dispatch_mode_class,
)
from dtensor_patches._torch.schemas import (
    argument_names,
    is_view_op,
    tree_leaves,
    tree_map,
    written_positions,
)
from dtensor_patches._torch.versions import view_geometry_is_global
from dtensor_patches.cell_record import capture
from dtensor_patches.cells import cell_key, layout_of, wrong_keys
from dtensor_patches.dispatch.miss_rules import FALLBACK_DECISION, watch_decisions
from dtensor_patches.dispatch.shards import in_layout_of
from dtensor_patches.dispatch.tracked_views import region_in, view_record
from dtensor_patches.errors import LostWriteError
from dtensor_patches.verify_compare import compare as _compare
from dtensor_patches.verify_ranks import PLAIN_DIFFERS, SPEC_DIFFERS, rank_disagreement
from dtensor_patches.verify_report import Mismatch, VerifyError, VerifyReport
from dtensor_patches.verify_sampling import (
    PROCESS_SIGNATURES,
    Signatures,
    fraction_of,
    signature,
)
from dtensor_patches.verify_source import describe as _describe
from dtensor_patches.verify_source import source as _source

__all__ = [
    "PROCESS_SIGNATURES",
    "Mismatch",
    "Signatures",
    "VerifyError",
    "VerifyReport",
    "signature",
    "verify",
]

_UNINITIALISED = ("empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided")
# How AccumulateGrad takes a leaf's first gradient: which of them runs depends on a reference
# count, so ranks may run different ones (a hook keeping the gradient on one rank, garbage
# collected on one rank only). Checked, they would pair one rank's collectives with another
# rank's different ones; they copy a gradient whose computation was checked.
_GRAD_TAKING = ("detach", "clone", "new_empty_strided", "copy_")


def _spec_problem(x: Any) -> str | None:
    """A DTensor whose local shape is not the one its global shape and placements imply."""
    try:
        expected, _ = local_shape_and_offset(x.shape, x.device_mesh, x.placements)
    except Exception as exc:  # noqa: BLE001 - an unreadable spec is the finding itself
        return f"spec unreadable: {type(exc).__name__}: {exc}"
    recorded = spec_shape(x)
    if recorded is not None and recorded != tuple(x.shape):
        return f"spec records global shape {list(recorded)}, the tensor is {list(x.shape)}"
    local = tuple(local_tensor(x).shape)
    if local != expected:
        return f"global shape {list(x.shape)} {tuple(x.placements)} implies local {list(expected)}, local is {list(local)}"
    return None


class _Checker:
    def __init__(
        self,
        atol: float,
        rtol: float,
        raise_on_mismatch: bool,
        fraction: float | None = None,
        signatures: Signatures | None = None,
        on_mismatch: Callable[[Mismatch], None] | None = None,
        keep_calls: bool = False,
    ) -> None:
        self.keep_calls = keep_calls
        self._broken_before: set[int] = set()
        self.atol = atol
        self.rtol = rtol
        self.raise_on_mismatch = raise_on_mismatch
        self.report = VerifyReport()
        # Sampling: None checks every call; else each new signature at this fraction.
        self.fraction = fraction
        self.signatures = signatures if signatures is not None else PROCESS_SIGNATURES
        self.on_mismatch = on_mismatch
        # False lets every call through (a run verification whose steps are over, while a
        # mode entered after it keeps it on the stack).
        self.active = True
        # Views made inside the block: id(view) -> (weakref to it, its view record).
        self._views: dict[
            int, tuple[Any, tuple[Any, Any, tuple[Any, ...], dict[str, Any], int | None]]
        ] = {}

    def _record_of(self, value: Any) -> Any:
        """How the DTensor ``value`` was made from another one, if known: a tracked view's
        record, or the view op this block saw make it."""
        record = view_record(value)
        if record is not None:
            return record
        entry = self._views.get(id(value))
        if entry is not None and entry[0]() is value:
            return entry[1]
        return None

    def _note_view(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> None:
        dtensor = dtensor_class()
        if not (args and isinstance(args[0], dtensor) and is_view_op(func)):
            return
        outs = list(out) if isinstance(out, (list, tuple)) else [out]
        for i, view in enumerate(outs):
            if isinstance(view, dtensor) and view is not args[0]:
                index = i if isinstance(out, (list, tuple)) else None
                record = (args[0], func, tuple(args[1:]), dict(kwargs), index)
                key = id(view)
                # The entry goes with the view (ids are reused once it is gone).
                ref = weakref.ref(view, lambda _, key=key: self._views.pop(key, None))
                self._views[key] = (ref, record)

    def _base_of(self, view: Any) -> tuple[Any, Any] | None:
        """``(base, place)``: the DTensor ``view`` is a view of (its chain followed to the
        first one whose making is unknown) and a function giving ``view``'s place in the plain
        full value of that base; ``None`` when ``view`` is no known view of another DTensor."""
        dtensor = dtensor_class()
        records = []
        node = view
        while (record := self._record_of(node)) is not None:
            records.append(record)
            node = record[0]
        geometry = None
        base = base_of(node) if isinstance(node, torch.Tensor) else None
        if (
            isinstance(base, dtensor)
            and base is not node
            and base.dtype == node.dtype
            and view_geometry_is_global()
        ):
            # From 2.10 a DTensor view reports its global place in its base.
            geometry = (
                tuple(node.shape),
                node.stride(),
                node.storage_offset() - base.storage_offset(),
            )
            node = base
        if not records and geometry is None:
            return None

        def place(full: torch.Tensor) -> torch.Tensor:
            region = full
            if geometry is not None:
                region = region.as_strided(*geometry)
            for record in reversed(records):
                region = region_in(region, record)
            return region

        return node, place

    def _view_reference(self, x: Any) -> tuple[Any, Any, torch.Tensor, torch.Tensor] | None:
        """For a DTensor input that is a view: ``(base, place, base full value, the view's
        value in it)``, computed before the call; ``None`` when it is no view or its place
        cannot be found."""
        found = self._base_of(x)
        if found is None:
            return None
        base, place = found
        full = in_layout_of(base, full_value(base))
        try:
            region = place(full)
        except (RuntimeError, LostWriteError, IndexError):
            return None
        if tuple(region.shape) != tuple(x.shape):
            return None
        return base, place, full, region.clone()

    def _path(self, op: Any, decisions: list[tuple[Any, Any]]) -> tuple[str, str | None]:
        directory = torch_tables.tables()
        for seen, key in decisions:
            if seen is not op:
                continue
            if key == FALLBACK_DECISION:
                return "fallback", None
            owner = state.LEDGER.owner_of(directory, (state.MISS_RULES_TABLE, key))
            if owner is not None:
                return "patched", getattr(owner, "name", repr(owner))
        for table in torch_tables.table_names():
            if table == state.MISS_RULES_TABLE:
                continue
            owner = state.LEDGER.owner_of(directory, (table, op))
            if owner is not None:
                return "patched", getattr(owner, "name", repr(owner))
        return "native", None

    def call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        name = str(func)
        phase = "backward" if current_autograd_node() is not None else "forward"
        self.report.calls[name] += 1
        dtensor = dtensor_class()
        flat_in = [x for x in tree_leaves((args, kwargs)) if isinstance(x, dtensor)]
        inputs = tuple(
            _describe(x)
            for x in tree_leaves((args, kwargs))
            if isinstance(x, (torch.Tensor, dtensor))
        )
        random = torch.Tag.nondeterministic_seeded in func.tags
        reference: tuple[Any, Any] | None = None
        if random:
            self.report.unchecked[f"random: {name}"] += 1
        views: dict[int, tuple[Any, Any, torch.Tensor, torch.Tensor]] = {}
        across = self._across_ranks(name, phase, args, kwargs, flat_in, inputs)
        if not random:
            for x in flat_in:
                if id(x) not in views:
                    found = self._view_reference(x)
                    if found is not None:
                        views[id(x)] = found
            reference = tree_map(
                lambda x: (
                    (views[id(x)][3].clone() if id(x) in views else full_value(x))
                    if isinstance(x, dtensor)
                    else (x.clone() if isinstance(x, torch.Tensor) else x)
                ),
                (args, kwargs),
            )
        layouts = tuple(layout_of(x.placements, x.shape, x.device_mesh.shape) for x in flat_in)
        # An input already inconsistent with its spec was broken by an earlier call (reported
        # there): this call is not blamed for it.
        self._broken_before = (
            {id(x) for x in flat_in if _spec_problem(x) is not None}
            if reference is not None
            else set()
        )
        recorded = (
            capture(name, args, kwargs, *reference)
            if self.keep_calls and reference is not None
            else None
        )
        with watch_decisions() as decisions:
            out = func(*args, **kwargs)
        self._note_view(func, args, kwargs, out)
        path, patch = self._path(func, decisions)
        if path == "patched":
            self.report.patched[patch or "?"] += 1
        elif path == "fallback":
            self.report.fallback[name] += 1
        else:
            self.report.native += 1
        if reference is None:
            return out
        where = f"patched: {patch}" if patch else path
        outputs = tuple(_describe(x) for x in tree_leaves(out))
        problem = across or self._check(func, name, (args, kwargs), out, reference, flat_in, views)
        if problem is not None:
            text, diff = problem
            key = cell_key(name, layouts)
            mismatch = Mismatch(
                name,
                phase,
                where,
                text,
                diff,
                inputs,
                outputs,
                _source(phase),
                cell=key,
                known=key in wrong_keys(),
                call=recorded,
            )
            self.report.mismatches.append(mismatch)
            if self.on_mismatch is not None:
                self.on_mismatch(mismatch)
            if self.raise_on_mismatch:
                raise VerifyError(mismatch)
        return out

    def _across_ranks(
        self,
        name: str,
        phase: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        flat_in: list[Any],
        inputs: tuple[str, ...],
    ) -> tuple[str, None] | None:
        """The ranks' agreement on the inputs (:mod:`dtensor_patches.verify_ranks`): raises
        ``VerifyError`` before anything is gathered when they disagree on a DTensor's global
        spec; the problem text when a plain tensor beside DTensors differs between them."""
        dtensor = dtensor_class()
        plain = [
            x
            for x in tree_leaves((args, kwargs))
            if isinstance(x, torch.Tensor) and not isinstance(x, dtensor)
        ]
        flags, text = rank_disagreement(flat_in, plain)
        if flags & SPEC_DIFFERS:
            mismatch = Mismatch(name, phase, "not run", text, None, inputs, (), _source(phase))
            self.report.mismatches.append(mismatch)
            raise VerifyError(mismatch)
        return (text, None) if flags & PLAIN_DIFFERS else None

    def _check(
        self,
        func: Any,
        name: str,
        called: tuple[tuple[Any, ...], dict[str, Any]],
        out: Any,
        reference: tuple[Any, Any],
        flat_in: list[Any],
        views: dict[int, tuple[Any, Any, torch.Tensor, torch.Tensor]],
    ) -> tuple[str, float | None] | None:
        args, kwargs = called
        dtensor = dtensor_class()
        for i, x in enumerate(flat_in):
            problem = None if id(x) in self._broken_before else _spec_problem(x)
            if problem is not None:
                return f"input {i} spec corrupted: {problem}", None
        for i, x in enumerate(o for o in tree_leaves(out) if isinstance(o, dtensor)):
            problem = _spec_problem(x)
            if problem is not None:
                return f"output {i}: {problem}", None
        full_args, full_kwargs = reference
        try:
            expected = func(*full_args, **full_kwargs)
        except Exception as exc:  # noqa: BLE001 - the op cannot run on plain tensors: unchecked
            self.report.unchecked[f"reference raised {type(exc).__name__}: {name}"] += 1
            return None
        if func.__name__.split(".")[0] in _UNINITIALISED:
            got_leaves = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor)]
            want = [e for e in tree_leaves(expected) if isinstance(e, torch.Tensor)]
            for g, e in zip(got_leaves, want, strict=False):
                if tuple(g.shape) != tuple(e.shape) or g.dtype != e.dtype:
                    return (
                        f"shape/dtype {list(g.shape)} {g.dtype} != single-device {list(e.shape)} {e.dtype}",
                        None,
                    )
            self.report.unchecked[f"uninitialised: {name}"] += 1
            return None
        written = written_positions(func)
        names = argument_names(func)
        written_views: list[tuple[str, Any, Any]] = []
        for i in written:
            if i < len(args):
                got_w, want_w, label = args[i], full_args[i], f"written argument {i}"
            elif names[i] in kwargs:
                got_w, want_w = kwargs[names[i]], full_kwargs[names[i]]
                label = f"written argument {names[i]}="
            else:
                continue
            if isinstance(got_w, list | tuple):
                # The written list of an in-place foreach op (``_foreach_mul_``): it returns
                # nothing, so each written tensor is judged here.
                for j, (item, want_item) in enumerate(zip(got_w, want_w, strict=False)):
                    if isinstance(item, torch.Tensor):
                        problem = _compare(item, want_item, self.atol, self.rtol)
                        if problem is not None:
                            return (f"{label}[{j}]: {problem[0]}", problem[1])
                continue
            if not isinstance(got_w, torch.Tensor):
                continue
            problem = _compare(got_w, want_w, self.atol, self.rtol)
            if problem is not None:
                return (f"{label}: {problem[0]}", problem[1])
            written_views.append((label, got_w, want_w))
        problem = _base_problem(self, written_views, views)
        if problem is not None:
            return problem
        got_leaves = tree_leaves(out)
        want_leaves = tree_leaves(expected)
        if len(got_leaves) != len(want_leaves):
            return f"{len(got_leaves)} outputs != single-device {len(want_leaves)}", None
        for i, (g, e) in enumerate(zip(got_leaves, want_leaves, strict=True)):
            problem = _compare(g, e, self.atol, self.rtol)
            if problem is not None:
                label = f"output {i}: " if len(got_leaves) > 1 else ""
                return label + problem[0], problem[1]
        return None


def _base_problem(
    checker: _Checker,
    written: list[tuple[str, Any, Any]],
    views: dict[int, tuple[Any, Any, torch.Tensor, torch.Tensor]],
) -> tuple[str, float | None] | None:
    """Each written tensor ``(label, DTensor, single-device value)`` that is a view: its base
    must now hold the base's value before the call with the places of every written view of
    it replaced by their single-device values (two views of one base written by one call both
    land: ``aminmax(y, 0, out=(x[0], x[1]))``)."""
    expected: dict[int, tuple[Any, torch.Tensor, list[str]]] = {}
    for label, tensor, value in written:
        if id(tensor) not in views or not isinstance(value, torch.Tensor):
            continue
        base, place, before, _ = views[id(tensor)]
        entry = expected.setdefault(id(base), (base, before.clone(), []))
        place(entry[1]).copy_(value)
        entry[2].append(label)
    for base, want, labels in expected.values():
        problem = _compare(base, want, checker.atol, checker.rtol)
        if problem is not None:
            return (
                f"{', '.join(labels)} (a view): its base {list(base.shape)} "
                f"{tuple(base.placements)}: {problem[0]}",
                problem[1],
            )
    return None


@functools.cache
def _mode_class() -> type:
    base = dispatch_mode_class()

    class VerifyMode(base):  # type: ignore[misc, valid-type]
        """Runs every DTensor call through a :class:`_Checker`; other calls pass through."""

        def __init__(self, checker: _Checker) -> None:
            super().__init__()
            self.checker = checker

        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
        ) -> Any:
            kwargs = kwargs or {}
            dtensor = dtensor_class()
            # ``types`` names the tensor subclasses among the arguments: empty for the plain
            # local ops DTensor itself runs, which are most calls this mode sees.
            if not any(issubclass(t, dtensor) for t in types) or not any(
                isinstance(x, dtensor) for x in tree_leaves((args, kwargs))
            ):
                return func(*args, **kwargs)
            checker = self.checker
            if not checker.active:
                return func(*args, **kwargs)
            if func.__name__.split(".")[0] in _GRAD_TAKING and accumulating_grad():
                checker.report.calls[str(func)] += 1
                checker.report.unchecked[f"gradient taken by AccumulateGrad: {func}"] += 1
                return func(*args, **kwargs)
            if checker.fraction is not None:
                key = signature(func, args, kwargs)
                if not checker.signatures.decide(key, checker.fraction):
                    checker.report.skipped += 1
                    return func(*args, **kwargs)
                checker.report.signatures += 1
            return checker.call(func, args, kwargs)

    return VerifyMode


@contextmanager
def verify(
    *,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    raise_on_mismatch: bool = True,
    trace_backward: bool | None = None,
    sample: bool | float = False,
    signatures: Signatures | None = None,
    keep_calls: bool = False,
) -> Iterator[VerifyReport]:
    """Check every DTensor op that runs inside the block against the same op on full tensors.

    Run it collectively (every rank enters the block and runs the same calls): inputs are
    gathered with collectives. The full mode (the default) checks every call: for a few steps
    of debugging. ``sample=True`` checks each distinct call signature (op overload, and each
    argument's placements, mesh, shape, stride and dtype, non-tensor arguments; floats by kind)
    once and lets later calls with it through unchecked, across blocks that share
    ``signatures``: wrap every training step in it and the first step pays, the later ones
    cost little more than the mode's dispatch (``benchmarks/verify_cost.py``).

    Args:
        atol, rtol: tolerance for floating results (``torch.allclose``); integer, bool and
            index results must match exactly.
        raise_on_mismatch: raise :class:`VerifyError` at the first mismatch (inside the call,
            so the traceback points at it); ``False`` collects every mismatch in the report.
        trace_backward: record forward stack traces (autograd anomaly mode, NaN checks off)
            so that a mismatch in a backward op names the forward line that caused it.
            Default: on in the full mode, off when sampling (it costs on every forward op,
            checked or not).
        sample: ``False`` checks every call; ``True`` each new signature once; a float in
            ``(0, 1]`` only that fraction of the new signatures (chosen from a hash of the
            signature, the same on every rank), for a long run.
        signatures: where sampling remembers the signatures it decided on; default
            :data:`PROCESS_SIGNATURES` (one per process). Give a fresh :class:`Signatures` to
            check everything again.
        keep_calls: record each mismatching call's arguments (full values, layouts) in
            :attr:`Mismatch.call`, to replay it (``dtensor_patches.cell_replay``); costs a
            copy of every checked call's arguments.

    Yields:
        A :class:`VerifyReport`, filled while the block runs.

    Raises:
        VerifyError: a DTensor call's result differs (``raise_on_mismatch=True``).
        PatchError: an internal this tool needs moved in this torch release.
        ValueError: ``sample`` is a number outside ``(0, 1]``.

    Example::

        with dtensor_patches.verify(atol=1e-5) as report:
            loss = model(batch).sum()
            loss.backward()
        print(report)
    """
    fraction = fraction_of(sample)
    if trace_backward is None:
        trace_backward = fraction is None
    checker = _Checker(atol, rtol, raise_on_mismatch, fraction, signatures, keep_calls=keep_calls)
    mode = _mode_class()(checker)
    anomaly = (
        torch.autograd.set_detect_anomaly(True, check_nan=False) if trace_backward else _nothing()
    )
    with anomaly, mode:
        yield checker.report


@contextmanager
def _nothing() -> Iterator[None]:
    yield


call_through(__name__, verify)

"""``scan()``: which DTensor ops a training step uses, and how each torch release 2.9 to 2.15
would run them.

::

    with dtensor_patches.scan() as found:
        train_step(batch)
    print(found.report())            # table per release, fits 100 columns
    found.report().to_dict()         # the same for machines

While the block runs, a dispatch mode records every distinct ``(op, input placements)`` the
step calls on DTensors (the top-level calls DTensor's dispatch sees, forward and backward; not
the local ops DTensor runs underneath). The prediction for each release comes from the data
file shipped with the package (``dtensor_patches/data/releases.json``), which the matrix tool
(``python -m tools.matrix`` in the repository) generates from each release's own DTensor registry and
each patch's measured stock result. Per release it says which recorded ops have no strategy,
which patch covers each, which are known to give wrong results (or fail) there, and which
would fall back.

What it cannot predict, and says so: a step may call other ops on another release (other
decompositions, other model code paths); an op torch decomposes (CompositeImplicitAutograd)
runs as the ops of its decomposition there, which the scan does not see (from 2.11 DTensor
also propagates placements through an op's ``torch._decomp`` entry: the data file counts those
ops as decomposed too); and a patch's bug
that depends on more than the placements (a negative ``dim``, a dtype, ties) is reported as
"may", not as certain.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from dtensor_patches._callable_module import call_through
from dtensor_patches.calls import Call, needs_sharded_inputs
from dtensor_patches.cells import cell_key, family_patch_name, layout_of, wrong_cells
from dtensor_patches.errors import first_line

__all__ = ["Call", "Finding", "ReleaseVerdict", "Scan", "ScanReport", "release_data", "scan"]

DATA_PACKAGE = "dtensor_patches.data"
DATA_FILE = "releases.json"


def _placement_code(placement: Any) -> str:
    if placement.is_replicate():
        return "R"
    if placement.is_partial():
        return f"P({getattr(placement, 'reduce_op', 'sum')})"
    if placement.is_shard():
        return f"S({placement.dim})"
    return str(placement)


def _describe(
    value: Any, dtensor: type, out: list[str], uneven: list[bool], layouts: list[str]
) -> None:
    import torch

    if isinstance(value, dtensor):
        placements = tuple(value.placements)
        out.append("".join(_placement_code(p) for p in placements))
        mesh = value.device_mesh
        layouts.append(layout_of(placements, value.shape, mesh.shape))
        for mesh_dim, p in enumerate(placements):
            if p.is_shard() and value.shape[p.dim] % mesh.size(mesh_dim):
                uneven[0] = True
    elif isinstance(value, torch.Tensor):
        out.append("tensor")
    elif isinstance(value, (list, tuple)):
        for item in value:
            _describe(item, dtensor, out, uneven, layouts)


class Scan:
    """What a :func:`scan` block recorded: :attr:`calls` by ``(op, inputs)``, in first-use
    order, each with its outcome on this release; :attr:`error` (the exception that ended the
    block, if any, as text); :attr:`patched` (patches or the fallback were applied while it
    ran, so an op that ran may owe it to them)."""

    def __init__(self) -> None:
        import torch

        self.torch = torch.__version__
        self.calls: dict[tuple[str, tuple[str, ...]], Call] = {}
        self.error: str | None = None
        self.patched = False
        self._lock = threading.Lock()

    def record(self, op: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Call | None:
        """Record one call (called by the dispatch mode; ignores calls without a DTensor).

        Returns:
            The call's :class:`Call` (its outcome is added with :meth:`observe`), or ``None``.
        """
        from torch.distributed.tensor import DTensor

        inputs: list[str] = []
        uneven = [False]
        layouts: list[str] = []
        _describe(list(args) + list(kwargs.values()), DTensor, inputs, uneven, layouts)
        if not any(i != "tensor" for i in inputs):
            return None
        key = (str(op), tuple(inputs))
        cell = cell_key(key[0], layouts)
        with self._lock:
            call = self.calls.get(key)
            if call is None:
                call = self.calls[key] = Call(key[0], key[1])
            call.count += 1
            call.uneven = call.uneven or uneven[0]
            if cell not in call.cells:
                call.cells.append(cell)
        return call

    def observe(self, call: Call, *, gathered: bool = False, raised: str = "") -> None:
        """Add one call's outcome on this release: it ran, was computed on gathered inputs,
        or raised (``raised``: the error's first line)."""
        with self._lock:
            if raised:
                call.raised = call.raised or raised
            elif gathered:
                call.gathered += 1
            else:
                call.ran += 1

    def merge(self, other: Scan | Mapping[str, Any]) -> None:
        """Add another rank's record (a :class:`Scan` or its :meth:`to_dict`)."""
        data = other.to_dict() if isinstance(other, Scan) else other
        for item in data["calls"]:
            key = (item["op"], tuple(item["inputs"]))
            call = self.calls.setdefault(key, Call(*key))
            call.count = max(call.count, item["count"])
            call.uneven = call.uneven or item["uneven"]
            call.ran = max(call.ran, item.get("ran", 0))
            call.gathered = max(call.gathered, item.get("gathered", 0))
            call.raised = call.raised or item.get("raised", "")
            call.cells.extend(c for c in item.get("cells", ()) if c not in call.cells)
        self.error = self.error or data.get("error")
        self.patched = self.patched or bool(data.get("patched", False))

    @property
    def ops(self) -> list[str]:
        """The distinct ops, in first-use order."""
        return list(dict.fromkeys(op for op, _ in self.calls))

    def to_dict(self) -> dict[str, Any]:
        return {
            "torch": self.torch,
            "calls": [c.to_dict() for c in self.calls.values()],
            "error": self.error,
            "patched": self.patched,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Scan:
        found = cls()
        found.torch = data.get("torch", found.torch)
        found.merge(data)
        return found

    def report(self, releases: Iterable[str] | None = None) -> ScanReport:
        """The prediction for each release in the data file (or only ``releases``)."""
        return predict(self, releases)


@contextlib.contextmanager
def scan() -> Iterator[Scan]:
    """Record every distinct ``(op, input placements)`` used on DTensors inside the block.

    Opt-in and for one step: a dispatch mode puts Python on every op call while the block
    runs (the step is slower, its results are unchanged). Calls on other threads are not
    seen (dispatch modes are per thread; autograd's backward on CPU runs on the caller's).
    An exception in the block is recorded in :attr:`Scan.error` and raised again.

    Yields:
        The :class:`Scan`, filled as the block runs.

    Raises:
        PatchError: the dispatch-mode API moved in this torch.
    """
    from dtensor_patches import registry
    from dtensor_patches._torch.modes import dispatch_mode_class
    from dtensor_patches.dispatch.fallback import mode as fallback_mode
    from dtensor_patches.dispatch.fallback_report import gathered_on_this_thread

    found = Scan()
    found.patched = fallback_mode() != "off" or any(p.is_applied for p in registry.all_patches())
    mode_class = dispatch_mode_class()

    class _Recorder(mode_class):  # type: ignore[misc, valid-type]
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            call = found.record(func, args, kwargs)
            if call is None:
                return func(*args, **kwargs)
            before = gathered_on_this_thread()
            try:
                result = func(*args, **kwargs)
            except Exception as exc:
                found.observe(call, raised=first_line(exc))
                raise
            found.observe(call, gathered=gathered_on_this_thread() != before)
            return result

    try:
        with _Recorder():
            yield found
    except BaseException as exc:
        found.error = first_line(exc)
        raise


# --- The release data and the prediction -------------------------------------------------


@functools.cache
def release_data() -> dict[str, Any]:
    """The shipped data file (made by the repository's ``tools/matrix.py``):
    ``{"releases": {"2.9.1": …}}``.

    Raises:
        FileNotFoundError: the package was installed without its data file.
    """
    text = resources.files(DATA_PACKAGE).joinpath(DATA_FILE).read_text()
    return json.loads(text)


def _stock_kind(stock: str | None) -> str | None:
    """``None`` (correct), ``"fails"`` (raised) or ``"wrong"`` (silently wrong), as the
    matrix classifies a reproducer's stock result."""
    if stock is None:
        return None
    return "fails" if "Error" in stock else "wrong"


def _trigger(patch: str, call: Call) -> bool | None:
    """Whether ``call`` is the case ``patch`` fixes: the patch's own ``concerns`` predicate
    (``True``/``False`` where the recorded placements decide it, ``None`` where they cannot);
    a patch the data file names but this registry does not have gets the default."""
    from dtensor_patches import registry

    try:
        concerns = registry.get(patch).concerns
    except KeyError:
        concerns = needs_sharded_inputs
    return concerns(call)


@dataclass(frozen=True)
class Finding:
    """What one release does with one recorded call.

    ``kind``: ``"missing"`` (no strategy or handler; see ``patches``/``fallback``),
    ``"decomposes"`` (no strategy, DTensor decomposes the op there, by its
    CompositeImplicitAutograd kernel or, from 2.11, its ``torch._decomp`` entry; stock torch
    may still refuse a part, which ``apply_all()``'s fallback takes), ``"wrong"``/``"fails"``
    (a patch's reproducer measured this release's stock torch wrong or raising on this case;
    ``certain`` is ``False`` when the placements cannot tell whether the call is that case),
    ``"absent"`` (no such op there).
    ``patches``: the patches that cover it there (``apply_all()``); ``fallback``: no patch does
    and the call fallback (``dtensor_patches.fallback``) would have to take it.
    """

    call: Call
    kind: str
    patches: tuple[str, ...] = ()
    certain: bool = True
    detail: str = ""

    @property
    def fallback(self) -> bool:
        return self.kind == "missing" and not self.patches

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.call.op,
            "inputs": list(self.call.inputs),
            "kind": self.kind,
            "certain": self.certain,
            "patches": list(self.patches),
            "fallback": self.fallback,
            "detail": self.detail,
        }


@dataclass
class ReleaseVerdict:
    """Every finding for one release, and the two answers: does the step run on stock torch,
    and does it run (and is it right, as far as measured) with ``apply_all()``."""

    release: str
    torch: str
    findings: list[Finding] = field(default_factory=list)

    def of_kind(self, *kinds: str) -> list[Finding]:
        return [f for f in self.findings if f.kind in kinds]

    @property
    def missing(self) -> list[Finding]:
        return self.of_kind("missing")

    @property
    def fallback(self) -> list[Finding]:
        return [f for f in self.findings if f.fallback]

    @property
    def patches_needed(self) -> list[str]:
        """The patches this step needs on this release (in registry order)."""
        needed = {p for f in self.findings for p in f.patches}
        from dtensor_patches import registry

        return [p.name for p in registry.all_patches() if p.name in needed]

    def stock(self) -> str:
        if self.missing or any(f.certain for f in self.of_kind("fails")):
            return "fails"
        if any(f.certain for f in self.of_kind("wrong")):
            return "wrong"
        if self.of_kind("wrong", "fails", "decomposes", "absent"):
            return "check"
        return "runs"

    def patched(self) -> str:
        """With ``apply_all()``: ``"runs"`` where every finding is covered by a patch, taken by
        the fallback (an op without strategy or patch; the default ``"warn"`` mode runs it) or
        decomposed by torch (its parts that DTensor refuses go to the fallback too);
        ``"wrong"``/``"fails"`` where a measured bug has no patch in its gate there;
        ``"check"`` where such a bug may be the case or the op is absent from the release."""
        unfixed = [f for f in self.of_kind("wrong", "fails") if not f.patches]
        if any(f.certain for f in unfixed):
            return "fails" if any(f.kind == "fails" and f.certain for f in unfixed) else "wrong"
        if unfixed or self.of_kind("absent"):
            return "check"
        return "runs"

    def to_dict(self) -> dict[str, Any]:
        return {
            "release": self.release,
            "torch": self.torch,
            "stock": self.stock(),
            "with_apply_all": self.patched(),
            "patches_needed": self.patches_needed,
            "missing": [f.to_dict() for f in self.missing],
            "fallback": [f.to_dict() for f in self.fallback],
            "wrong": [f.to_dict() for f in self.of_kind("wrong")],
            "fails": [f.to_dict() for f in self.of_kind("fails")],
            "decomposes": [f.to_dict() for f in self.of_kind("decomposes")],
            "absent": [f.to_dict() for f in self.of_kind("absent")],
        }


def _covering(op: str, facts: Mapping[str, Any]) -> tuple[str, ...]:
    return tuple(
        name for name, p in facts["patches"].items() if p["in_gate"] and op in p["installs"]
    )


def verdict_for(found: Scan, release: str, facts: Mapping[str, Any]) -> ReleaseVerdict:
    """The findings of one release (``facts``: its entry in the data file).

    An op with neither a strategy nor a decomposition there is ``"missing"`` (a patch or the
    fallback takes it). An op DTensor runs, by its strategy or by decomposing it, is then
    checked against each patch's measured stock result for that op: a decomposed op can be
    silently wrong too (``mse_loss(reduction="mean")`` of uneven shards on 2.11 and later).
    On the release the scan was recorded on, what each call did decides instead of the
    registry facts where it can (:func:`_ran_on_stock`): a decomposition that worked, or one
    that torch refused after all.
    """
    has = set(facts["strategies"]) | set(facts["single_dim"]) | set(facts["handlers"])
    decomposes, absent = set(facts["decomposes"]), set(facts["absent"])
    from dtensor_patches._torch.versions import release_of

    here = release_of(found.torch) == release_of(facts["torch"])
    out = ReleaseVerdict(release, facts["torch"])
    for call in found.calls.values():
        if call.op in absent:
            out.findings.append(Finding(call, "absent"))
            continue
        runs = call.op in has
        decomposed = not runs and call.op in decomposes
        seen = _ran_on_stock(call, found, facts) if here else None
        if seen is not None:
            runs, decomposed = seen, False
        if not runs and not decomposed:
            out.findings.append(Finding(call, "missing", _covering(call.op, facts)))
            continue
        measured = _measured_bugs(call, facts) + _wrong_cells(call, facts)
        if decomposed and not measured:
            out.findings.append(Finding(call, "decomposes", _covering(call.op, facts)))
        out.findings.extend(measured)
    return out


def _ran_on_stock(call: Call, found: Scan, facts: Mapping[str, Any]) -> bool | None:
    """Whether stock torch runs ``call`` (no strategy missing), from what the recorded calls
    did: ``False`` when one raised torch's missing-strategy error, or was computed on gathered
    inputs with no patch of the op installed (the fallback took a refusal); ``True`` when a
    stock scan (no patches, no fallback) saw them all run; ``None`` when it cannot be told (in
    a patched scan an op that ran may owe it to a patch of the ops it decomposes into)."""
    if "does not have a sharding strategy" in call.raised:
        return False
    if call.gathered and not _covering(call.op, facts):
        return False
    if call.ran and not call.gathered and not call.raised and not found.patched:
        return True
    return None


def _measured_bugs(call: Call, facts: Mapping[str, Any]) -> list[Finding]:
    """The ``"wrong"``/``"fails"`` findings of ``call``: each patch whose reproducer measured
    this release's stock torch wrong or raising on one of the patch's ops, where the patch's
    ``concerns`` predicate does not rule the call out."""
    found = []
    for name, p in facts["patches"].items():
        kind = _stock_kind(p["stock"])
        if kind is None or call.op not in p["ops"]:
            continue
        if "does not have a sharding strategy" in p["stock"]:
            continue  # a missing strategy: the registry facts decide per op
        hit = _trigger(name, call)
        if hit is False:
            continue
        fix = (name,) if p["in_gate"] else ()
        found.append(Finding(call, kind, fix, certain=bool(hit), detail=p["stock"]))
    return found


def _wrong_cells(call: Call, facts: Mapping[str, Any]) -> list[Finding]:
    """The ``"wrong"`` findings of ``call`` from the strategy validator's table
    (``data/wrong_cells.json``): a cell the call was that stock torch of this release gets
    wrong; certain, since the cell is the op and its inputs' layouts exactly."""
    from dtensor_patches._torch.versions import release_of

    by_key = {c.key: c for c in wrong_cells(release_of(facts["torch"]))}
    found = []
    for key in call.cells:
        cell = by_key.get(key)
        if cell is None:
            continue
        if cell.routed:
            fix: tuple[str, ...] = (family_patch_name(cell.family),)
        else:
            # Measured fixed by the hand-written patches: those in gate there that touch the
            # op may be the one (a "may" finding); with none to name, nothing is reported.
            fix = tuple(
                name
                for name, p in facts["patches"].items()
                if p["in_gate"] and (call.op in p["ops"] or call.op in p["installs"])
            )
            if not fix:
                continue
        how = "" if cell.routed else "; fixed by the library's hand-written patches"
        detail = f"{key}: {cell.problem} (measured by tools/validate{how})"
        found.append(Finding(call, "wrong", fix, certain=cell.routed, detail=detail))
    return found


@dataclass
class ScanReport:
    """The prediction for every release: :attr:`verdicts` in release order."""

    scan: Scan
    verdicts: list[ReleaseVerdict]

    def verdicts_for(self, *releases: str) -> list[ReleaseVerdict]:
        """The verdicts of ``releases``, in that order.

        Raises:
            KeyError: a release not in this report.
        """
        by_release = {v.release: v for v in self.verdicts}
        return [by_release[r] for r in releases]

    def to_dict(self) -> dict[str, Any]:
        return {
            "recorded_on": self.scan.torch,
            "error": self.scan.error,
            "calls": [c.to_dict() for c in self.scan.calls.values()],
            "releases": {v.release: v.to_dict() for v in self.verdicts},
        }

    def table(self, width: int = 100) -> str:
        from dtensor_patches.scan_table import render

        return render(self, width)

    def __str__(self) -> str:
        return self.table()


def predict(found: Scan, releases: Iterable[str] | None = None) -> ScanReport:
    """:class:`ScanReport` of ``found`` for ``releases`` (default: every release in the file).

    Raises:
        KeyError: a release the data file has no entry for (the message lists those it has).
    """
    data = release_data()["releases"]
    wanted = list(data) if releases is None else list(releases)
    unknown = [r for r in wanted if r not in data]
    if unknown:
        raise KeyError(f"no scan data for torch {unknown}; the data file has {list(data)}")
    return ScanReport(found, [verdict_for(found, r, data[r]) for r in wanted])


# --- Running a user's step: ``dtensor-patches scan MODULE:FUNCTION`` ------------------------


def resolve_target(target: str) -> Any:
    """``"pkg.module:function"`` or ``"path/to/file.py:function"`` -> the function.

    A file's directory is put on ``sys.path`` and the file imported under its stem, so that
    spawned ranks can import it by name too.

    Raises:
        ValueError: ``target`` has no ``:FUNCTION`` part, or the module has no such function.
        ImportError: the module cannot be imported.
    """
    import importlib
    import sys
    from pathlib import Path

    module_name, sep, function = target.rpartition(":")
    if not sep or not module_name or not function:
        raise ValueError(f"scan target must be MODULE:FUNCTION or FILE.py:FUNCTION, got {target!r}")
    if module_name.endswith(".py"):
        path = Path(module_name).resolve()
        if not path.is_file():
            raise ValueError(f"scan target {target!r}: no file {path}")
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        module_name = path.stem
    module = importlib.import_module(module_name)
    fn = getattr(module, function, None)
    if not callable(fn):
        raise ValueError(f"scan target {target!r}: {module_name} has no function {function!r}")
    return fn


def _scan_on_rank(target: str, apply_patches: bool) -> dict[str, Any]:
    from dtensor_patches.registry import apply_all

    fn = resolve_target(target)
    if apply_patches:
        apply_all()
    found = Scan()
    try:
        with scan() as found:
            fn()
    except Exception:  # noqa: BLE001 - recorded in found.error and reported by the caller
        pass
    return found.to_dict()


def scan_function(target: str, *, world_size: int = 2, apply_patches: bool = False) -> Scan:
    """Run ``target`` (see :func:`resolve_target`, called without arguments) under
    :func:`scan` on every rank and return the union of what the ranks recorded.

    Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) it runs in this process's group (created
    with gloo if there is none yet); otherwise on ``world_size`` spawned CPU gloo ranks. The
    function builds its own mesh. ``apply_patches`` calls ``apply_all()`` first, so a step
    gets past this release's gaps and the rest of it is recorded too.

    Raises:
        ValueError, ImportError: the target cannot be resolved (see :func:`resolve_target`).
        RankError: a rank died outside the step.
    """
    import os

    resolve_target(target)  # fail here, before spawning ranks, on a bad target
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        mine = _scan_on_rank(target, apply_patches)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        results = everyone
    else:
        from dtensor_patches.testing import RankPool

        with RankPool(world_size) as pool:
            results = pool.run(_scan_on_rank, target, apply_patches)
    found = Scan.from_dict(results[0])
    for other in results[1:]:
        found.merge(other)
    return found


call_through(__name__, scan)

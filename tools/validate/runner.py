"""Per rank: run op_db samples through every placement pattern and variant under
``dtensor_patches.verify``; collect the cells it finds wrong."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import random
import time
import warnings
from collections.abc import Callable
from typing import Any

from tools.sweep.catalog import ATOL, RTOL, categorize
from tools.sweep.runner import _compare, _first_line, _map, _op_db, _tensors
from tools.validate.layouts import PATTERNS, make_dtensor, mesh_ndim, placements_for


@dataclasses.dataclass
class Options:
    """What one validation runs (sent to every rank)."""

    patterns: tuple[str, ...] = PATTERNS
    variants: tuple[str, ...] = ("function", "inplace", "out")
    backward: bool = True
    max_samples: int = 3
    max_candidates: int = 24
    apply_patches: bool = False
    without_routing: bool = False
    mesh_shape: tuple[int, ...] = ()
    """The mesh the samples run on; ``()``: a 1-D mesh over every rank. A 2-D shape takes
    patterns with one part per mesh dim (:data:`~tools.validate.layouts.PATTERNS_2D`)."""


STOCK_KEEPS: tuple[str, ...] = ("empty_shard_padding",)
"""Patches a stock run still applies: fixes of DTensor's collectives, not of any op's
strategy, without which the validator's own gathers hang (2.9 pads a shard empty along
another dim with an ``F.pad`` that raises on those ranks only: every op's ``[Shard(1),
Shard(0)]`` sample of a ``[5, 1]`` tensor hung). Each has its own tripwire; the cells say what
op strategies get wrong. Outside their gates they change nothing."""


def family_of(aten_op: str, opinfo_name: str) -> str:
    """The op family a cell is reported under: its aten packet's sweep category, else its
    OpInfo's."""
    packet = aten_op.split(".")[1] if aten_op.count(".") >= 2 else aten_op
    if packet.startswith("_foreach_"):
        # An in-place foreach op writes a list of tensors; an out-of-place one is its op's.
        if packet.endswith("_"):
            return "indexing and in-place writes"
        packet = packet[len("_foreach_") :]
    family = categorize(packet.rstrip("_"))
    if family == categorize("__none__"):
        family = categorize(opinfo_name)
    return family


def _samples(op: Any, options: Options) -> list[Any]:
    import torch

    for dtype in (torch.float32, torch.int64, torch.bool):
        if dtype in op.supported_dtypes("cpu"):
            break
    else:
        return []
    grad = options.backward and op.supports_autograd and dtype.is_floating_point
    torch.manual_seed(0)
    random.seed(0)
    if op.name.startswith("_foreach_"):
        # Three tensors per list (sizes 3, 2, 1: uneven and empty shards on 2 ranks), not the
        # generator's twenty: the same layouts, a cell key of readable length.
        samples = op.sample_inputs("cpu", dtype, requires_grad=grad, num_input_tensors=[3])
    else:
        samples = op.sample_inputs("cpu", dtype, requires_grad=grad)
    return list(itertools.islice(samples, options.max_candidates))


def _fingerprint(sample: Any) -> str:
    """What a sample is, for comparing ranks: its tensors' shapes and dtypes and its other
    arguments."""
    import torch

    def text(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return f"T{tuple(value.shape)}{value.dtype}"
        if isinstance(value, (list, tuple)):
            return "[" + ",".join(text(v) for v in value) + "]"
        if isinstance(value, dict):
            return "{" + ",".join(f"{k}:{text(v)}" for k, v in sorted(value.items())) + "}"
        return repr(value)

    return text([sample.input, list(sample.args), dict(sample.kwargs)])


def _aligned(samples: list[Any], world: int) -> list[Any]:
    """The samples in the same order on every rank: some generators order them differently
    per process (an order from a set, Python's hash seed: ``meshgrid``'s samples alternate
    ``indexing="xy"`` and ``"ij"`` in an order each rank picks). Rank 0's order, each rank
    taking its own sample of the same fingerprint; one that a rank lacks is left out."""
    import torch.distributed as dist

    mine = [_fingerprint(sample) for sample in samples]
    prints: list[Any] = [None] * world
    dist.all_gather_object(prints, mine)
    from collections import Counter

    # Decided from the gathered fingerprints only, so every rank decides alike.
    counts = [Counter(rank_prints) for rank_prints in prints]
    taken: Counter[str] = Counter()
    left = list(range(len(samples)))
    out = []
    for fingerprint in prints[0]:
        if taken[fingerprint] >= min(c[fingerprint] for c in counts):
            continue  # a rank lacks it (or has fewer of it)
        taken[fingerprint] += 1
        index = next(i for i in left if mine[i] == fingerprint)
        left.remove(index)
        out.append(samples[index])
    return out


def _usable(sample: Any) -> bool:
    return not sample.kwargs.get("dropout_p", 0)


_LOW_PRECISION = ("float16", "bfloat16")

OUT_OF_SCOPE = ("fft.",)
"""OpInfos not validated: the FFTs compute on complex intermediates (conjugate views), which
the validator's real-valued samples do not aim at and the recorded calls cannot hold."""


def _call(variant: str, op: Any) -> Callable[..., Any] | None:
    if variant == "inplace":
        return op.inplace_variant
    if variant == "out":
        # Foreach OpInfos claim out= support, but torch's foreach functions take no out=.
        return op.op if op.supports_out and not op.name.startswith("_foreach_") else None
    return op.op


def _float_outputs(out: Any) -> list[Any]:
    return [t for t in _tensors(out) if t.is_floating_point() and t.requires_grad]


def _seed(outputs: list[Any]) -> Any:
    """The scalar whose backward is checked: each output summed in float64, so a half or
    bfloat16 output's sum over shards is not compared with rounding in it."""
    import torch

    return sum(o.to(torch.float64).sum() for o in outputs)


def _mesh(options: Options) -> Any:
    from dtensor_patches.testing import grid_mesh, world_mesh

    return grid_mesh(options.mesh_shape) if options.mesh_shape else world_mesh()


def _out_layout(layout: str) -> str:
    """The layout of a DTensor ``out=``: the first tensor's, a pending part replicated (an
    ``out=`` holds a result, never shares of one)."""
    return "/".join("R" if part.startswith("P.") else part for part in layout.split("/"))


def _one(
    op: Any,
    fn: Callable[..., Any],
    sample: Any,
    pattern: str,
    variant: str,
    backward: bool,
    mesh: Any,
) -> dict[str, Any]:
    """Run one (sample, pattern, variant) on ``mesh``; the cells found wrong and the
    outcome."""
    import torch

    from dtensor_patches import verify

    parts = (sample.input, tuple(sample.args), dict(sample.kwargs))
    tensors = list(_tensors(parts))
    if variant != "out" and not tensors:
        return {"outcome": "skipped"}
    placements = iter(placements_for(pattern, tensors))
    grad = backward and variant == "function" and any(t.requires_grad for t in tensors)
    plain = _map(copy.deepcopy(_map(parts, lambda t: t.detach())), lambda t: t.clone())
    if grad:
        plain = _map(plain, lambda t: t.requires_grad_(t.is_floating_point()))
    try:
        with torch.no_grad() if not grad else torch.enable_grad():
            expected = fn(plain[0], *plain[1], **plain[2])
        if variant == "inplace":
            expected = plain[0]
        plain_outputs = _float_outputs(expected) if grad else []
        if grad and plain_outputs:
            _seed(plain_outputs).backward()
    except Exception as exc:  # noqa: BLE001 - no single-device reference: nothing to judge
        return {"outcome": "skipped", "error": f"reference: {_first_line(exc)}"}
    try:
        dist_parts = _map(parts, lambda t: make_dtensor(t, next(placements), mesh, grad))
    except Exception as exc:  # noqa: BLE001 - inputs torch cannot distribute test no op
        return {"outcome": "skipped", "error": f"distribute_tensor: {_first_line(exc)}"}
    kwargs = dict(dist_parts[2])
    if variant == "out":
        if not isinstance(expected, torch.Tensor) or expected.dim() == 0:
            return {"outcome": "skipped"}
        first = _out_layout(placements_for(pattern, [expected])[0])
        try:
            kwargs["out"] = make_dtensor(torch.zeros_like(expected), first, mesh, False)
        except Exception as exc:  # noqa: BLE001 - an out gloo cannot hold (uint64) tests no op
            return {"outcome": "skipped", "error": f"distribute_tensor: {_first_line(exc)}"}
    cells: dict[str, dict[str, Any]] = {}
    outcome = "ok"
    error = ""
    report = None
    try:
        with (
            warnings.catch_warnings(),
            verify(
                raise_on_mismatch=False, trace_backward=False, keep_calls=True, atol=ATOL, rtol=RTOL
            ) as report,
        ):
            warnings.simplefilter("ignore")
            actual = fn(dist_parts[0], *dist_parts[1], **kwargs)
            if variant == "inplace":
                actual = dist_parts[0]
            elif variant == "out":
                actual = kwargs["out"]
            outputs = _float_outputs(actual) if grad else []
            if outputs:
                _seed(outputs).backward()
        problem = _compare(actual, expected)
        if grad and problem is None:
            for got, want in zip(_tensors(dist_parts), _tensors(plain), strict=True):
                if want.grad is not None:
                    problem = _compare(got.grad, want.grad, "grad")
                    if problem:
                        break
    except Exception as exc:  # noqa: BLE001 - a refusal is the fallback's business, not a cell
        outcome, error = "raises", f"{type(exc).__name__}: {_first_line(exc)}"
        problem = None
    for index, mismatch in enumerate(getattr(report, "mismatches", [])):
        if not mismatch.cell:
            # The ranks disagreed on an input's spec before the call could run: the call
            # that made that input is the wrong one, and it was not seen alone here.
            problem = problem or f"{mismatch.op}: {mismatch.problem[:200]}"
            continue
        if index and "disagree" in mismatch.problem:
            continue  # a consequence of the first mismatch, not a cell of its own
        if "values differ" in mismatch.problem and any(
            low in text for text in mismatch.inputs + mismatch.outputs for low in _LOW_PRECISION
        ):
            continue  # a half-precision sum over shards rounds in another order: not a bug
        cells.setdefault(
            mismatch.cell,
            {
                "key": mismatch.cell,
                "op": mismatch.op,
                "phase": mismatch.phase,
                "problem": mismatch.problem[:300],
                "call": mismatch.call,
            },
        )
    if cells:
        outcome = "wrong"
    elif problem:
        # Wrong at the end but no single call was: a composition no op-level check sees (a
        # pending reduction lost between calls, a gradient accumulated twice).
        outcome = "wrong-unattributed"
        error = problem
    return {"outcome": outcome, "error": error, "cells": list(cells.values())}


def validate_ops(keys: list[str], options: Options) -> list[dict[str, Any]]:
    """Per-rank entry point: one record per OpInfo in ``keys`` (every rank returns the same,
    the union of what each rank found)."""
    import torch
    import torch.distributed as dist

    import dtensor_patches

    if options.apply_patches:
        from dtensor_patches.registry import all_patches

        routing = [p.name for p in all_patches() if p.name.startswith("wrong_cells_")]
        dtensor_patches.apply_all(exclude=routing if options.without_routing else ())
    else:
        dtensor_patches.apply_all(only=STOCK_KEEPS)
    torch.set_num_threads(1)
    table = _op_db(foreach=True)
    world = dist.get_world_size()
    mesh = _mesh(options)
    wrong_ndim = [p for p in options.patterns if mesh_ndim(p) != mesh.ndim]
    if wrong_ndim:
        raise ValueError(f"patterns {wrong_ndim} do not lay out over a {mesh.ndim}-D mesh")
    records = []
    for key in keys:
        op = table[key]
        start = time.perf_counter()
        if key.startswith(OUT_OF_SCOPE):
            records.append({"opinfo": key, "outcomes": {}, "cells": [], "unattributed": []})
            continue
        record: dict[str, Any] = {"opinfo": key, "outcomes": {}, "cells": {}, "unattributed": []}
        try:
            samples = [s for s in _samples(op, options) if _usable(s)]
        except Exception as exc:  # noqa: BLE001 - a broken sample generator tests nothing
            samples = []
            record["error"] = f"sample_inputs: {_first_line(exc)}"
        samples = _aligned(samples, world)
        for variant in options.variants:
            fn = _call(variant, op)
            if fn is None:
                continue
            for pattern in options.patterns:
                seen: set[tuple[str, ...]] = set()
                used = 0
                for index, sample in enumerate(samples):
                    if used >= options.max_samples:
                        break
                    tensors = list(_tensors((sample.input, sample.args, sample.kwargs)))
                    shape = placements_for(pattern, tensors)
                    if shape in seen and pattern != "R":
                        continue  # the same layout as a pattern already run on this sample
                    seen.add(shape)
                    result = _one(op, fn, sample, pattern, variant, options.backward, mesh)
                    gathered: list[Any] = [None] * world
                    dist.all_gather_object(gathered, result)
                    if all(r["outcome"] == "skipped" for r in gathered):
                        continue
                    used += 1
                    for r in gathered:
                        record["outcomes"][r["outcome"]] = (
                            record["outcomes"].get(r["outcome"], 0) + 1
                        )
                        found_by = f"{key}[{index}] {variant} {pattern}"
                        for cell in r.get("cells", []):
                            entry = record["cells"].setdefault(
                                cell["key"],
                                {
                                    **cell,
                                    "family": family_of(cell["op"], op.name),
                                    "found_by": f"{found_by} {cell['phase']}",
                                },
                            )
                            if entry.get("call") is None and cell.get("call") is not None:
                                entry["call"] = cell["call"]
                        if r["outcome"] == "wrong-unattributed":
                            record["unattributed"].append(f"{found_by}: {r['error']}")
        record["cells"] = list(record["cells"].values())
        record["unattributed"] = sorted(set(record["unattributed"]))
        record["seconds"] = round(time.perf_counter() - start, 2)
        records.append(record)
    return records

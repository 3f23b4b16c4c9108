"""Sweep torch's op database through DTensor and find the ops that fail on this release.

``python -m dtensor_patches.sweep`` enumerates
``torch.testing._internal.common_methods_invocations.op_db`` (shipped in the torch wheel; it
needs the ``expecttest`` package), and for every OpInfo runs a few of its CPU sample inputs with
every tensor argument turned into a DTensor on a 1-D CPU gloo mesh over all ranks, once per
placement (``Shard(0)``, ``Shard(-1)``, ``Replicate()``, and ``Partial()`` with ``--partial``).
The ``full_tensor()`` of each output is compared with the plain single-device result of the same
sample. Each (op, variant, placement) is classified as:

- ``ok``: every sample ran and matched;
- ``no-strategy``: ``NotImplementedError ... does not have a sharding strategy registered``;
- ``raises``: any other exception (type and first line of the message are recorded);
- ``wrong``: an output's shape, dtype or values differ from the single-device result;
- ``timeout``: the ranks did not finish the op within ``--op-timeout`` (a hang, usually ranks
  that took different collective paths); the ranks are restarted and the sweep goes on;
- ``crash``: a rank process died (gloo aborts the process on a collective size mismatch) or the
  sweep failed outside a sample; the ranks are restarted and the sweep goes on;
- ``skipped``: no sample fits the placement (every sample has a 0-d tensor, or a tensor whose
  sharded dim is smaller than the world size), the single-device reference itself fails, or
  ``distribute_tensor`` cannot make the inputs DTensors (2.9: zero-size tensors).

Sample eligibility: a sample is used for a placement only if it has no dropout (a non-zero
``dropout_p`` keyword), every tensor argument is at least 1-d and, for ``Shard(d)``, has size
``>= world_size`` on dim ``d``; the first ``--max-samples`` eligible samples are used. Integer
and bool tensors stay ``Replicate()`` under ``Partial()``. Samples are drawn with the same seed
on every rank, so every rank sees the same data.

After each sample the ranks exchange their outcomes (``all_gather_object``) and record the
worst; if they disagree the row says so (``rank_mismatch``). Random ops, ops with
nondeterministic or uninitialised outputs, and sparse/CUDA-only ops are skipped (see
:data:`SKIP`). The sweep touches no private DTensor API: it uses only the public
``torch.distributed.tensor`` names (``op_db`` itself lives in ``torch.testing._internal``).

Known artifacts of the method (read failures with them in mind): every tensor argument gets the
placement, including tensors that are really sizes or indices (``tensor_split``'s indices,
``repeat_interleave``'s repeats), which then fail for that reason; ``full_tensor()`` of int16
outputs fails on gloo (``Invalid scalar type``), so ``short`` fails when sharded; ops whose
samples are skipped by the rules above are not tested for that placement at all.

Typical use::

    python -m dtensor_patches.sweep --markdown docs/sweep.md --json docs/sweep.json
    python -m dtensor_patches.sweep --ops argmax,logsumexp --apply-patches
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import fnmatch
import itertools
import json
import logging
import math
import random
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

log = logging.getLogger(__name__)

__all__ = [
    "CATEGORIES",
    "SKIP",
    "Options",
    "Row",
    "categorize",
    "list_ops",
    "main",
    "render_markdown",
    "run_sweep",
    "sweep_ops",
    "write_json",
]

#: Outcomes, least to most severe; the worst over samples and ranks is recorded.
SEVERITY = {
    "skipped": 0,
    "ok": 1,
    "no-strategy": 2,
    "raises": 3,
    "wrong": 4,
    "timeout": 5,
    "crash": 6,
}

#: Ops never run, and why: ``fnmatch`` patterns on the OpInfo name or its ``name.variant`` key.
SKIP: dict[str, str] = {
    # random: no single-device reference to compare with
    "bernoulli": "random",
    "multinomial": "random",
    "normal*": "random",
    "uniform": "random",
    "cauchy": "random",
    "exponential": "random",
    "geometric": "random",
    "log_normal": "random",
    "rand*": "random",
    "randint*": "random",
    "randn*": "random",
    "nn.functional.dropout*": "random",
    "nn.functional.alpha_dropout": "random",
    "nn.functional.feature_alpha_dropout*": "random",
    "nn.functional.rrelu": "random",
    "nn.functional.gumbel_softmax": "random",
    "nn.functional.fractional_max_pool*": "random",
    "svd_lowrank": "random",
    "pca_lowrank": "random",
    # uninitialised memory
    "empty*": "uninitialised output",
    "new_empty*": "uninitialised output",
    "nn.functional.multi_head_attention_forward": "dropout inside; huge samples",
    # not dense CPU tensors
    "to_sparse": "sparse output",
    "sparse.*": "sparse",
    "jiterator_*": "CUDA only",
    "torch._scaled_mm": "CUDA only",
    "_segment_reduce*": "sparse-style lengths",
    # no tensor to distribute / not a tensor op
    "item": "returns a Python scalar; 0-d input",
    "arange": "factory: no tensor input",
    "linspace*": "factory: no tensor input",
    "logspace*": "factory: no tensor input",
    "full": "factory: no tensor input",
    "ones": "factory: no tensor input",
    "zeros": "factory: no tensor input",
    "eye": "factory: no tensor input",
    "scalar_tensor": "factory: no tensor input",
    "signal.windows.*": "factory: no tensor input",
    "tril_indices": "factory: no tensor input",
    "triu_indices": "factory: no tensor input",
    "nn.functional.pad.circular": "slow",
}

#: OpInfo name ``fnmatch`` pattern -> category, for the markdown report (first match wins).
CATEGORIES: dict[str, str] = {}


def _cat(category: str, *names: str) -> None:
    for name in names:
        CATEGORIES[name] = category


_cat(
    "reductions",
    "sum",
    "nansum",
    "mean",
    "nanmean",
    "prod",
    "amax",
    "amin",
    "max",
    "min",
    "aminmax",
    "argmax",
    "argmin",
    "std",
    "std_mean",
    "var",
    "var_mean",
    "logsumexp",
    "norm",
    "linalg.norm",
    "linalg.vector_norm",
    "linalg.matrix_norm",
    "all",
    "any",
    "count_nonzero",
    "dist",
    "renorm",
    "special.logsumexp",
    "_softmax_backward_data",
    "nn.functional.normalize",
)
_cat(
    "scans",
    "cumsum",
    "cumprod",
    "cummax",
    "cummin",
    "logcumsumexp",
    "cumulative_trapezoid",
    "diff",
    "trapezoid",
    "trapz",
)
_cat(
    "sorting/searching",
    "sort",
    "argsort",
    "msort",
    "topk",
    "kthvalue",
    "median",
    "nanmedian",
    "quantile",
    "nanquantile",
    "mode",
    "searchsorted",
    "bucketize",
    "isin",
    "histc",
    "histogram*",
    "unique*",
    "bincount",
)
_cat(
    "indexing and in-place writes",
    "index_*",
    "scatter*",
    "gather",
    "take*",
    "put",
    "__getitem__",
    "__setitem__",
    "fill",
    "fill_",
    "zero_",
    "copy_",
    "select_scatter",
    "slice_scatter",
    "diagonal_scatter",
    "as_strided_scatter",
    "index_put",
    "_unsafe_index*",
    "embedding*",
    "nn.functional.embedding*",
    "narrow_copy",
    "resize_",
    "resize_as_",
    "tril",
    "triu",
)
_cat(
    "masking",
    "masked_fill",
    "masked_scatter",
    "masked_select",
    "masked.*",
    "where",
    "nonzero*",
    "argwhere",
    "isnan",
    "isinf",
    "nan_to_num",
)
_cat(
    "losses",
    "nn.functional.*loss*",
    "nn.functional.cross_entropy",
    "nn.functional.nll_loss",
    "nn.functional.binary_cross_entropy*",
    "nn.functional.kl_div",
    "nn.functional.ctc_loss",
)
_cat("attention", "nn.functional.scaled_dot_product_attention", "*attention*")
_cat(
    "shape ops",
    "flip*",
    "fliplr",
    "flipud",
    "roll",
    "rot90",
    "unfold*",
    "unbind*",
    "split*",
    "chunk",
    "tensor_split",
    "hsplit",
    "vsplit",
    "dsplit",
    "stack",
    "hstack",
    "vstack",
    "dstack",
    "column_stack",
    "row_stack",
    "cat",
    "concat",
    "concatenate",
    "reshape*",
    "view*",
    "flatten",
    "unflatten",
    "squeeze*",
    "unsqueeze",
    "permute",
    "transpose",
    "swapaxes",
    "swapdims",
    "movedim",
    "moveaxis",
    "t",
    "mT",
    "mH",
    "T",
    "H",
    "expand*",
    "broadcast_*",
    "repeat*",
    "tile",
    "narrow",
    "select",
    "slice",
    "diagonal",
    "diag*",
    "as_strided*",
    "alias_copy",
    "atleast_*",
    "ravel",
    "contiguous",
    "clone",
    "pad",
    "nn.functional.pad*",
    "kron",
    "meshgrid*",
    "tril_indices",
    "triu_indices",
    "block_diag",
    "cartesian_prod",
    "combinations",
    "nn.functional.pixel_*",
    "nn.functional.channel_shuffle",
    "native_channel_shuffle",
)
_cat("data-dependent output shape", "nonzero*", "masked_select", "unique*", "bincount", "argwhere")

DEFAULT_CATEGORY = "other"
CATEGORY_ORDER = (
    "reductions",
    "scans",
    "sorting/searching",
    "indexing and in-place writes",
    "masking",
    "losses",
    "attention",
    "shape ops",
    "data-dependent output shape",
    DEFAULT_CATEGORY,
)

PLACEMENTS = ("Shard(0)", "Shard(-1)", "Replicate()")
_ATEN_RE = re.compile(r"aten\.[A-Za-z0-9_]+\.[A-Za-z0-9_]+")
_NO_STRATEGY = "does not have a sharding strategy registered"
RTOL = 1e-4
ATOL = 1e-5


def _match(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern)


def skip_reason(name: str, variant: str = "") -> str | None:
    """Why the op ``name`` (OpInfo ``variant_test_name`` ``variant``) is not swept, or None."""
    full = f"{name}.{variant}" if variant else name
    for pattern, reason in SKIP.items():
        if _match(full, pattern) or _match(name, pattern):
            return reason
    return None


def categorize(name: str) -> str:
    """The report category of an op name; data-dependent-shape ops win over their family."""
    if any(_match(name, p) for p, c in CATEGORIES.items() if c == "data-dependent output shape"):
        return "data-dependent output shape"
    for pattern, category in CATEGORIES.items():
        if _match(name, pattern):
            return category
    return DEFAULT_CATEGORY


@dataclasses.dataclass
class Options:
    """What one sweep runs (sent to every rank)."""

    placements: tuple[str, ...] = PLACEMENTS
    max_samples: int = 3
    max_candidates: int = 40
    apply_patches: bool = False
    inplace: bool = False
    fallback: str = "off"  # the fallback mode with --apply-patches (off: patches only)


@dataclasses.dataclass
class Row:
    """The result of one (op, variant, placement)."""

    op: str
    variant: str
    placement: str
    outcome: str
    samples: int = 0
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    error_type: str = ""
    error: str = ""
    aten_op: str = ""
    rank_mismatch: bool = False
    seconds: float = 0.0
    name: str = ""


# --------------------------------------------------------------------------------------------
# Per-rank side
# --------------------------------------------------------------------------------------------


def _op_key(op: Any) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def _op_db() -> dict[str, Any]:
    from torch.testing._internal.common_methods_invocations import op_db

    return {_op_key(op): op for op in op_db}


def list_ops(
    ops: Sequence[str] | None = None, match: str | None = None
) -> list[tuple[str, str, str | None]]:
    """``(key, name, skip reason or None)`` of every OpInfo selected by ``ops`` / ``match``.

    ``ops`` selects by OpInfo name or by ``name.variant`` key; ``match`` by substring of the key.
    """
    out = []
    wanted = set(ops or ())
    for key, op in _op_db().items():
        if wanted and key not in wanted and op.name not in wanted:
            continue
        if match and match not in key:
            continue
        out.append((key, op.name, skip_reason(op.name, op.variant_test_name)))
    return out


_MESH: Any = None


def _mesh() -> Any:
    global _MESH
    if _MESH is None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        _MESH = init_device_mesh("cpu", (dist.get_world_size(),))
    return _MESH


def _tensors(obj: Any) -> Iterable[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _map(obj: Any, fn: Callable[[Any], Any]) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple (torch.return_types)
        return type(obj)(*(_map(x, fn) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    return obj


def _sample_parts(sample: Any) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    return sample.input, tuple(sample.args), dict(sample.kwargs)


def _eligible(sample: Any, placement: str, world: int) -> bool:
    import torch

    parts = _sample_parts(sample)
    if parts[2].get("dropout_p", 0):
        return False  # random: no single-device reference (e.g. sdpa with dropout_p > 0)
    tensors = list(_tensors(parts))
    if not tensors:
        return False
    for t in tensors:
        if t.dim() == 0 or t.layout != torch.strided:
            return False
        if placement.startswith("Shard"):
            dim = 0 if placement == "Shard(0)" else t.dim() - 1
            if t.shape[dim] < world:
                return False
    return True


def _to_dtensor(t: Any, placement: str) -> Any:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = _mesh()
    t = t.detach().clone()
    if placement == "Partial()":
        if t.is_floating_point() or t.is_complex():
            return DTensor.from_local(t / mesh.size(), mesh, [Partial()], run_check=False)
        return distribute_tensor(t, mesh, [Replicate()])
    if placement == "Replicate()":
        return distribute_tensor(t, mesh, [Replicate()])
    dim = 0 if placement == "Shard(0)" else t.dim() - 1
    return distribute_tensor(t, mesh, [Shard(dim)])


def _partial_reference(t: Any, world: int) -> Any:
    """The value a ``Partial()`` DTensor built from ``t / world`` on every rank stands for."""
    if t.is_floating_point() or t.is_complex():
        total = t / world
        for _ in range(world - 1):
            total = total + t / world
        return total
    return t


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""


def _classify_exception(exc: BaseException) -> dict[str, str]:
    text = str(exc)
    match = _ATEN_RE.search(text)
    outcome = (
        "no-strategy" if isinstance(exc, NotImplementedError) and _NO_STRATEGY in text else "raises"
    )
    return {
        "outcome": outcome,
        "error_type": type(exc).__name__,
        "error": _first_line(exc),
        "aten_op": match.group(0) if match else "",
    }


def _compare(actual: Any, expected: Any, path: str = "out") -> str | None:
    """None if ``actual`` (DTensors gathered) matches ``expected``, else what differs."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return f"{path}: expected a tensor, got {type(actual).__name__}"
        if isinstance(actual, DTensor):
            actual = actual.full_tensor()
        if actual.shape != expected.shape:
            return f"{path}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        if actual.dtype != expected.dtype:
            return f"{path}: dtype {actual.dtype} != {expected.dtype}"
        if expected.is_floating_point() or expected.is_complex():
            if not torch.allclose(actual, expected, rtol=RTOL, atol=ATOL, equal_nan=True):
                diff = (actual - expected).abs()
                diff = diff[~torch.isnan(diff)]
                worst = diff.max().item() if diff.numel() else float("nan")
                return f"{path}: values differ (max abs diff {worst:.3g})"
            return None
        if not torch.equal(actual, expected):
            return f"{path}: values differ"
        return None
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            return f"{path}: expected a sequence of {len(expected)}, got {type(actual).__name__}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            problem = _compare(a, e, f"{path}[{i}]")
            if problem:
                return problem
        return None
    if isinstance(actual, torch.Tensor):
        return f"{path}: expected {type(expected).__name__}, got a tensor"
    try:
        same = actual == expected or (
            isinstance(expected, float) and math.isnan(expected) and math.isnan(actual)
        )
    except Exception as exc:  # noqa: BLE001 - an uncomparable output is the recorded result
        return f"{path}: cannot compare ({type(exc).__name__})"
    return None if same else f"{path}: {actual!r} != {expected!r}"


def _callable(op: Any, variant: str) -> Callable[..., Any] | None:
    if variant == "inplace":
        return op.inplace_variant
    return op.op


def _skipped(stage: str, exc: BaseException) -> dict[str, str]:
    """The record of a sample that tests no op: ``stage`` (the reference, or making the
    DTensor inputs) raised ``exc``."""
    return {
        "outcome": "skipped",
        "error_type": type(exc).__name__,
        "error": f"{stage}: {_first_line(exc)}",
        "aten_op": "",
    }


def _run_sample(
    fn: Callable[..., Any], sample: Any, placement: str, inplace: bool
) -> dict[str, str]:
    """Run one sample as plain tensors and as DTensors; return the outcome record."""
    import torch

    world = _mesh().size()
    inp, args, kwargs = _sample_parts(sample)
    ref_parts = copy.deepcopy((inp, args, kwargs))
    if placement == "Partial()":
        ref_parts = _map(ref_parts, lambda t: _partial_reference(t, world))
    try:
        with torch.no_grad():
            expected = fn(ref_parts[0], *ref_parts[1], **ref_parts[2])
    except Exception as exc:  # noqa: BLE001 - a failing reference makes the sample unusable
        return _skipped("reference", exc)
    if inplace:
        expected = ref_parts[0]
    try:
        d_inp, d_args, d_kwargs = _map((inp, args, kwargs), lambda t: _to_dtensor(t, placement))
    except Exception as exc:  # noqa: BLE001 - inputs torch cannot distribute test no op
        # torch 2.9's distribute_tensor refuses zero-size tensors (``negative padding``): the
        # op is never called, so the sample says nothing about it.
        return _skipped("distribute_tensor", exc)
    try:
        with torch.no_grad():
            actual = fn(d_inp, *d_args, **d_kwargs)
        if inplace:
            actual = d_inp
        problem = _compare(actual, expected)
    except Exception as exc:  # noqa: BLE001 - the exception is the recorded result
        return _classify_exception(exc)
    if problem:
        return {"outcome": "wrong", "error_type": "", "error": problem, "aten_op": ""}
    return {"outcome": "ok", "error_type": "", "error": "", "aten_op": ""}


def _samples(op: Any, options: Options) -> tuple[list[Any], str]:
    import torch

    for dtype in (torch.float32, torch.int64, torch.bool):
        if dtype in op.supported_dtypes("cpu"):
            break
    else:
        return [], ""
    torch.manual_seed(0)
    random.seed(0)
    gen = op.sample_inputs("cpu", dtype, requires_grad=False)
    return list(itertools.islice(gen, options.max_candidates)), str(dtype).replace("torch.", "")


def _sweep_one(key: str, op: Any, options: Options) -> list[dict[str, Any]]:
    import torch.distributed as dist

    world = dist.get_world_size()
    variants = [""] + (["inplace"] if options.inplace and op.inplace_variant is not None else [])
    rows = []
    try:
        samples, dtype = _samples(op, options)
        sample_error = ""
    except Exception as exc:  # noqa: BLE001 - a broken sample generator is the recorded result
        samples, dtype, sample_error = (
            [],
            "",
            f"sample_inputs: {type(exc).__name__}: {_first_line(exc)}",
        )
    # Every rank must take the same path: agree on the candidate list length first.
    lengths = [None] * world
    dist.all_gather_object(lengths, len(samples))
    if len(set(lengths)) != 1:
        samples = samples[: min(lengths)]
    for variant in variants:
        fn = _callable(op, variant)
        for placement in options.placements:
            start = time.perf_counter()
            row = Row(key, variant or "function", placement, "skipped", name=op.name)
            worst: dict[str, str] | None = None
            used = 0
            for sample in samples:
                if used >= options.max_samples:
                    break
                if not _eligible(sample, placement, world):
                    continue
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    record = _run_sample(fn, sample, placement, inplace=variant == "inplace")
                gathered: list[Any] = [None] * world
                dist.all_gather_object(gathered, record)
                record = max(gathered, key=lambda r: SEVERITY[r["outcome"]])
                if len({r["outcome"] for r in gathered}) > 1:
                    row.rank_mismatch = True
                if record["outcome"] == "skipped":
                    row.error = row.error or record["error"]
                    continue
                used += 1
                row.counts[record["outcome"]] = row.counts.get(record["outcome"], 0) + 1
                if worst is None or SEVERITY[record["outcome"]] > SEVERITY[worst["outcome"]]:
                    worst = record
            row.samples = used
            if worst is not None:
                row.outcome = worst["outcome"]
                row.error_type = worst["error_type"]
                row.error = worst["error"]
                row.aten_op = worst["aten_op"]
            elif sample_error:
                row.error = sample_error
            elif not samples:
                row.error = row.error or f"no samples ({dtype or 'no float32/int64/bool support'})"
            else:
                row.error = row.error or "no eligible sample"
            row.seconds = round(time.perf_counter() - start, 3)
            rows.append(dataclasses.asdict(row))
    return rows


def apply_patches_report(fallback: str = "off") -> str:
    """Per-rank: call :func:`dtensor_patches.apply_all` and return its report as text."""
    import dtensor_patches

    return str(dtensor_patches.apply_all(fallback=fallback))


def sweep_ops(keys: Sequence[str], options: Options) -> list[dict[str, Any]]:
    """Per-rank entry point: sweep the OpInfos ``keys`` on every rank of the default group.

    Run it on every rank at once (e.g. ``RankPool.run(sweep_ops, keys, options)``); every rank
    returns the same rows (as dicts), outcomes being the worst over ranks.
    """
    import torch

    if options.apply_patches:
        import dtensor_patches

        dtensor_patches.apply_all(fallback=options.fallback)
    torch.set_num_threads(1)
    table = _op_db()
    rows: list[dict[str, Any]] = []
    for key in keys:
        op = table[key]
        log.debug("sweeping %s", key)
        rows.extend(_sweep_one(key, op, options))
    return rows


# --------------------------------------------------------------------------------------------
# Driver and reports
# --------------------------------------------------------------------------------------------


def _whole_op_rows(
    key: str, name: str, placements: Any, outcome: str, **fields: Any
) -> list[dict[str, Any]]:
    """One row per placement for an op whose whole sweep ended in ``outcome`` (timeout, crash)."""
    return [
        dataclasses.asdict(Row(key, "function", p, outcome, name=name, **fields))
        for p in placements
    ]


def run_sweep(
    *,
    world_size: int = 2,
    ops: Sequence[str] | None = None,
    match: str | None = None,
    options: Options | None = None,
    op_timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run the sweep on a fresh :class:`~dtensor_patches.testing.RankPool`; return the report.

    Each op is one call into the ranks; if an op does not finish within ``op_timeout`` seconds
    it is recorded as ``timeout`` and the ranks are restarted.
    """
    import torch

    from dtensor_patches.testing import RankPool

    options = options or Options()
    start = time.perf_counter()
    selected = list_ops(ops, match)
    rows: list[dict[str, Any]] = []
    skipped = [{"op": key, "reason": reason} for key, _, reason in selected if reason]
    todo = [key for key, _, reason in selected if not reason]
    names = {key: name for key, name, _ in selected}
    log.info("sweeping %d ops (%d skipped) on %d ranks", len(todo), len(skipped), world_size)
    pool: RankPool | None = None
    patch_report = ""
    try:
        if options.apply_patches:
            pool = RankPool(world_size, env=env, timeout=op_timeout)
            patch_report = pool.run(apply_patches_report, options.fallback)[0]
            log.info("%s", patch_report)
        for n, key in enumerate(todo, 1):
            if pool is None:
                pool = RankPool(world_size, env=env, timeout=op_timeout)
            t0 = time.perf_counter()
            try:
                rows.extend(pool.run(sweep_ops, [key], options)[0])
            except TimeoutError:
                log.warning("%s: timed out after %.0f s; restarting the ranks", key, op_timeout)
                pool.close()
                pool = None
                rows.extend(
                    _whole_op_rows(
                        key,
                        names[key],
                        options.placements,
                        "timeout",
                        error=f"no answer in {op_timeout:.0f} s",
                    )
                )
            except Exception as exc:  # noqa: BLE001 - a crashed rank is the op's recorded result
                log.warning("%s: ranks failed: %s", key, _first_line(exc))
                pool.close()
                pool = None
                rows.extend(
                    _whole_op_rows(
                        key,
                        names[key],
                        options.placements,
                        "crash",
                        error_type=type(exc).__name__,
                        error="a rank process died or failed outside a sample (e.g. gloo "
                        "aborted on a collective mismatch between ranks); see the log: "
                        + _first_line(exc),
                    )
                )
            log.info("[%d/%d] %s (%.1f s)", n, len(todo), key, time.perf_counter() - t0)
    finally:
        if pool is not None:
            pool.close()
    return {
        "torch": torch.__version__,
        "world_size": world_size,
        "options": dataclasses.asdict(options),
        "seconds": round(time.perf_counter() - start, 1),
        "ops_swept": len(todo),
        "patches": patch_report,
        "rows": rows,
        "skipped_ops": skipped,
    }


def _failing(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["outcome"] not in ("ok", "skipped")]


def write_json(report: dict[str, Any], path: str) -> None:
    """Write ``report`` (from :func:`run_sweep`) as indented JSON."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1, sort_keys=False)
        fh.write("\n")


def _row_category(row: dict[str, Any]) -> str:
    return categorize(row.get("name") or row["op"])


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(report: dict[str, Any], baseline: dict[str, Any] | None = None) -> str:
    """Markdown: a summary, then the failing (op, variant, placement) rows by category.

    With ``baseline`` (an earlier report), a section lists the rows whose outcome changed.
    """
    rows = report["rows"]
    failing = _failing(rows)
    by_outcome: dict[str, int] = {}
    for r in rows:
        by_outcome[r["outcome"]] = by_outcome.get(r["outcome"], 0) + 1
    failing_ops = sorted({r["op"] for r in failing})
    opts = report["options"]
    lines = [
        f"# DTensor op-database sweep: torch {report['torch']}"
        + (" with `apply_all()`" if opts.get("apply_patches") else " (stock)")
        + (
            f" and the fallback ({opts['fallback']})"
            if opts.get("apply_patches") and opts.get("fallback", "off") != "off"
            else ""
        ),
        "",
        "Generated by `python -m dtensor_patches.sweep`; every tensor argument of up to "
        f"{opts['max_samples']} CPU sample input(s) per OpInfo is a DTensor on a 1-D "
        f"{report['world_size']}-rank gloo mesh with each placement "
        f"({', '.join(f'`{p}`' for p in opts['placements'])}); `full_tensor()` of each output "
        "is compared with the single-device result.",
        "",
        f"- ops swept: {report['ops_swept']} (skipped by the skip list: "
        f"{len(report['skipped_ops'])}); runtime {report['seconds']:.0f} s",
        *(
            ["- patches applied on every rank:", "", "```", report["patches"], "```", ""]
            if report.get("patches")
            else []
        ),
        "- rows (op, variant, placement): "
        + ", ".join(f"{k} {v}" for k, v in sorted(by_outcome.items())),
        f"- failing ops: {len(failing_ops)}",
        "",
    ]
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in failing:
        groups.setdefault(_row_category(r), []).append(r)
    for category in CATEGORY_ORDER:
        items = groups.get(category)
        if not items:
            continue
        ops = sorted({r["op"] for r in items})
        lines += [f"## {category} ({len(ops)} ops)", ""]
        lines += [
            "| op | variant | placement | outcome | aten op | error |",
            "|---|---|---|---|---|---|",
        ]
        for r in sorted(items, key=lambda r: (r["op"], r["variant"], r["placement"])):
            error = f"{r['error_type']}: {r['error']}" if r["error_type"] else r["error"]
            mismatch = " (ranks disagree)" if r.get("rank_mismatch") else ""
            lines.append(
                f"| `{r['op']}` | {r['variant']} | `{r['placement']}` | {r['outcome']}{mismatch} "
                f"| {r['aten_op'] and '`' + r['aten_op'] + '`'} | {_cell(error[:160])} |"
            )
        lines.append("")
    if baseline:
        lines += _baseline_section(report, baseline)
    skipped_rows = [r for r in rows if r["outcome"] == "skipped"]
    lines += [
        "## Not swept",
        "",
        "By the skip list: "
        + ", ".join(f"`{s['op']}` ({s['reason']})" for s in report["skipped_ops"]),
        "",
        f"No usable sample for the placement ({len(skipped_rows)} rows): "
        + ", ".join(sorted({f"`{r['op']}`" for r in skipped_rows})),
        "",
    ]
    return "\n".join(lines)


def _baseline_section(report: dict[str, Any], baseline: dict[str, Any]) -> list[str]:
    """Markdown lines: rows whose outcome differs from the ``baseline`` report."""
    before = {(r["op"], r["variant"], r["placement"]): r for r in baseline["rows"]}
    changed = []
    for r in report["rows"]:
        old = before.get((r["op"], r["variant"], r["placement"]))
        if old is not None and old["outcome"] != r["outcome"]:
            changed.append((r, old))
    base_patched = " with `apply_all()`" if baseline["options"].get("apply_patches") else ""
    lines = [
        f"## Changed from the baseline (torch {baseline['torch']}{base_patched})",
        "",
    ]
    if not changed:
        return [*lines, "No (op, variant, placement) changed outcome.", ""]
    grouped: dict[tuple[str, str, str, str], list[str]] = {}
    for r, old in changed:
        key = (r["op"], r["variant"], old["outcome"], r["outcome"])
        grouped.setdefault(key, []).append(r["placement"])
    lines += ["| op | variant | placements | baseline | now |", "|---|---|---|---|---|"]
    for (op, variant, was, now), placements in sorted(grouped.items()):
        cells = ", ".join(f"`{p}`" for p in placements)
        lines.append(f"| `{op}` | {variant} | {cells} | {was} | {now} |")
    return [*lines, ""]


def _print_summary(report: dict[str, Any], out: Any = None) -> None:
    out = out or sys.stdout
    failing = _failing(report["rows"])
    headers = ("op", "variant", "placement", "outcome", "error")
    cells = [
        (
            r["op"],
            r["variant"],
            r["placement"],
            r["outcome"],
            (f"{r['error_type']}: " if r["error_type"] else "") + r["error"][:100],
        )
        for r in failing
    ]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip(), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for c in cells:
        print("  ".join(x.ljust(w) for x, w in zip(c, widths, strict=True)).rstrip(), file=out)
    print(
        f"# torch {report['torch']}: {len({r['op'] for r in failing})} failing ops, "
        f"{len(failing)} failing rows of {len(report['rows'])}, {report['seconds']:.0f} s",
        file=out,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m dtensor_patches.sweep [options]``."""
    parser = argparse.ArgumentParser(
        prog="python -m dtensor_patches.sweep",
        description="Run torch's op database through DTensor and report the ops that fail.",
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--ops", help="comma-separated OpInfo names or name.variant keys")
    parser.add_argument("--match", help="only OpInfos whose key contains this substring")
    parser.add_argument("--max-samples", type=int, default=3, help="samples per op and placement")
    parser.add_argument("--partial", action="store_true", help="also sweep Partial() inputs")
    parser.add_argument("--inplace", action="store_true", help="also sweep in-place variants")
    parser.add_argument(
        "--apply-patches",
        action="store_true",
        help="call dtensor_patches.apply_all() on each rank first",
    )
    parser.add_argument(
        "--fallback",
        choices=("off", "warn", "error"),
        default="off",
        help="with --apply-patches: the fallback mode (default off: the patches alone)",
    )
    parser.add_argument(
        "--op-timeout",
        type=float,
        default=120.0,
        help="seconds one op may take before it is recorded as timeout",
    )
    parser.add_argument(
        "--placements",
        help="comma-separated subset of Shard(0),Shard(-1),Replicate(),Partial() "
        "(default: the first three, plus Partial() with --partial)",
    )
    parser.add_argument(
        "--baseline",
        metavar="JSON",
        help="an earlier --json report: the markdown lists the rows whose outcome changed",
    )
    parser.add_argument(
        "--render",
        metavar="JSON",
        help="sweep nothing: load this earlier --json report and print/write it",
    )
    parser.add_argument("--json", metavar="PATH", help="write the full report as JSON")
    parser.add_argument("--markdown", metavar="PATH", help="write the report as markdown")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(message)s",
    )
    placements = PLACEMENTS + (("Partial()",) if args.partial else ())
    if args.placements:
        placements = tuple(p.strip() for p in args.placements.split(",") if p.strip())
        unknown = set(placements) - {*PLACEMENTS, "Partial()"}
        if unknown:
            parser.error(f"unknown placements: {sorted(unknown)}")
    options = Options(
        placements=placements,
        max_samples=args.max_samples,
        apply_patches=args.apply_patches,
        inplace=args.inplace,
        fallback=args.fallback,
    )
    ops = [o.strip() for o in args.ops.split(",") if o.strip()] if args.ops else None
    if args.render:
        with open(args.render, encoding="utf-8") as fh:
            report = json.load(fh)
    else:
        report = run_sweep(
            world_size=args.world_size,
            ops=ops,
            match=args.match,
            options=options,
            op_timeout=args.op_timeout,
        )
    baseline = None
    if args.baseline:
        with open(args.baseline, encoding="utf-8") as fh:
            baseline = json.load(fh)
    _print_summary(report)
    if args.json:
        write_json(report, args.json)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as fh:
            fh.write(render_markdown(report, baseline))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Running op_db samples through DTensor on every rank, and classifying each outcome."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import math
import random
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tools.sweep.catalog import (
    _ATEN_RE,
    _NO_STRATEGY,
    ATOL,
    PLACEMENTS,
    RTOL,
    SEVERITY,
    skip_reason,
)

log = logging.getLogger(__name__)


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


def _op_db(foreach: bool = False) -> dict[str, Any]:
    """op_db's OpInfos by key; with ``foreach``, also torch's foreach OpInfos (kept in lists of
    their own, outside op_db: ``_foreach_mul``, ``_foreach_norm``, ...)."""
    from torch.testing._internal import common_methods_invocations as cmi

    infos = list(cmi.op_db)
    if foreach:
        for name in (
            "foreach_unary_op_db",
            "foreach_binary_op_db",
            "foreach_pointwise_op_db",
            "foreach_reduce_op_db",
            "foreach_other_op_db",
        ):
            infos.extend(getattr(cmi, name, ()))
    return {_op_key(op): op for op in infos}


def list_ops(
    ops: Sequence[str] | None = None, match: str | None = None, foreach: bool = False
) -> list[tuple[str, str, str | None]]:
    """``(key, name, skip reason or None)`` of every OpInfo selected by ``ops`` / ``match``
    (with ``foreach``: torch's foreach OpInfos too, see :func:`_op_db`).

    ``ops`` selects by OpInfo name or by ``name.variant`` key; ``match`` by substring of the key.
    """
    out = []
    wanted = set(ops or ())
    for key, op in _op_db(foreach).items():
        if wanted and key not in wanted and op.name not in wanted:
            continue
        if match and match not in key:
            continue
        out.append((key, op.name, skip_reason(op.name, op.variant_test_name)))
    return out


def _mesh() -> Any:
    from dtensor_patches.testing import world_mesh

    return world_mesh()


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

    from dtensor_patches.testing import STARTUP_TIMEOUT, RankPool

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
            pool = RankPool(
                world_size, env=env, timeout=op_timeout, startup_timeout=STARTUP_TIMEOUT
            )
            patch_report = pool.run(apply_patches_report, options.fallback)[0]
            log.info("%s", patch_report)
        for n, key in enumerate(todo, 1):
            if pool is None:
                pool = RankPool(
                    world_size, env=env, timeout=op_timeout, startup_timeout=STARTUP_TIMEOUT
                )
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

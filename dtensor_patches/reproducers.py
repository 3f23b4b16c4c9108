"""Reproducers: run a trigger on DTensors and compare it with the same call on plain tensors.

A patch's reproducer runs collectively on every rank of a mesh and returns ``None`` when the
DTensor result equals the single-device one, else a one-line description of what is wrong. Most
patches list :class:`Case` objects (``Patch.cases``) and let :func:`run_cases` judge them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dtensor_patches.errors import first_line

__all__ = [
    "Case",
    "compare",
    "failure_of",
    "loss_and_grad",
    "parse_placement",
    "randn",
    "randn_nan_last",
    "run_case",
    "run_cases",
    "to_dtensor",
]


def failure_of(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """Run ``fn``; return ``(result, None)`` or ``(None, "ExcType: message")``.

    A reproducer must classify every way DTensor can fail (missing strategy, failed
    propagation, redistribution errors, assertion failures inside torch), so this catches
    broadly on purpose and returns the error as the reproducer's verdict; it never swallows it.
    """
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - the error message *is* the reproducer's result
        return None, first_line(exc)


def compare(
    got: torch.Tensor, expected: torch.Tensor, *, what: str, atol: float = 1e-5
) -> str | None:
    """``None`` when ``got`` equals ``expected`` (shape, dtype and values), else what differs."""
    if got.shape != expected.shape:
        return f"{what}: shape {tuple(got.shape)} != single-device {tuple(expected.shape)}"
    if got.dtype != expected.dtype:
        return f"{what}: dtype {got.dtype} != single-device {expected.dtype}"
    if expected.is_floating_point():
        ok = torch.allclose(got, expected, atol=atol, rtol=1e-5, equal_nan=True)
    else:
        ok = torch.equal(got, expected)
    if not ok:
        return f"{what}: values differ from the single-device result"
    return None


def parse_placement(text: str) -> Any:
    """``"S0"``/``"S(0)"`` -> ``Shard(0)``, ``"R"`` -> ``Replicate()``, ``"P"`` -> ``Partial()``."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    compact = text.replace("(", "").replace(")", "").strip()
    if compact == "R":
        return Replicate()
    if compact == "P":
        return Partial()
    if compact.startswith("S"):
        return Shard(int(compact[1:]))
    raise ValueError(f"unknown placement {text!r}: use S<d>, R or P")


def to_dtensor(t: torch.Tensor, mesh: Any, placement: str) -> Any:
    """``t`` as a DTensor placed ``placement`` (``"S0"``, ``"R"``, ``"P"``): a ``Partial`` one
    holds different shares on every rank (rank r: ``t * (r + 1) / sum(1..n)``)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial, distribute_tensor

    p = parse_placement(placement)
    if isinstance(p, Partial):
        # Rank r holds t * (r + 1) / sum(1..n): the shares sum to t and differ per rank.
        n = mesh.size()
        share = t * (dist.get_rank() + 1) * 2 / (n * (n + 1))
        return DTensor.from_local(share, mesh, [p], run_check=False)
    return distribute_tensor(t, mesh, [p])


def _outputs(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return list(value)
    return [value]


@dataclass(frozen=True)
class Case:
    """One trigger: ``fn(*inputs)`` on DTensors placed as ``placements`` vs on plain tensors.

    ``inputs`` builds the plain inputs (deterministic); ``placements`` has one entry per input
    (``"S0"``, ``"R"``, ``"P"``…) or ``None`` for an input passed as a plain tensor/scalar.
    ``inplace``: ``fn`` mutates its first input; the first input is compared afterwards.
    """

    label: str
    fn: Callable[..., Any]
    inputs: Callable[[], Sequence[Any]]
    placements: Sequence[str | None]
    inplace: bool = False


def run_case(mesh: Any, case: Case) -> str | None:
    """``None`` when the DTensor run equals the single-device run, else what went wrong."""
    plain = [x.clone() if isinstance(x, torch.Tensor) else x for x in case.inputs()]
    dist_inputs = [
        to_dtensor(x, mesh, p) if p is not None else x
        for x, p in zip(case.inputs(), case.placements, strict=True)
    ]
    expected = case.fn(*plain)
    got, error = failure_of(lambda: case.fn(*dist_inputs))
    if error is not None:
        return f"{case.label}: {error}"
    if case.inplace:
        expected, got = plain[0], dist_inputs[0]
    expected_list, got_list = _outputs(expected), _outputs(got)
    if len(expected_list) != len(got_list):
        return f"{case.label}: {len(got_list)} outputs != {len(expected_list)}"
    for i, (e, g) in enumerate(zip(expected_list, got_list, strict=True)):
        if isinstance(e, torch.Tensor):
            if hasattr(g, "full_tensor") and tuple(g.shape) != tuple(e.shape):
                # The DTensor's own shape is what later ops see, whatever its shards hold.
                return (
                    f"{case.label}: output {i}: the DTensor reports shape {tuple(g.shape)}, "
                    f"the single-device result has {tuple(e.shape)}"
                )
            full, error = failure_of(
                lambda g=g: g.full_tensor() if hasattr(g, "full_tensor") else g
            )
            if error is not None:
                return f"{case.label}: output {i}: {error}"
            mismatch = compare(full, e, what=f"{case.label} output {i}")
            if mismatch is not None:
                return mismatch
        elif e != g:
            return f"{case.label}: output {i} {g!r} != {e!r}"
    return None


def run_cases(mesh: Any, cases: Sequence[Case]) -> str | None:
    """The first failing case's description, or ``None`` when every case is correct."""
    for case in cases:
        problem = run_case(mesh, case)
        if problem is not None:
            return problem
    return None


def loss_and_grad(loss: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    """``loss(x, *rest)`` -> ``(value, d value.sum() / d x)``: a case that checks both."""

    def run(x: torch.Tensor, *rest: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.detach().requires_grad_()
        value = loss(x, *rest)
        (grad,) = torch.autograd.grad(value.sum(), [x])
        return value.detach(), grad

    return run


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    """Deterministic float32 normal samples, identical on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def randn_nan_last(*shape: int, seed: int = 0) -> torch.Tensor:
    """:func:`randn` with a NaN as its last element: on the last rank's part of any
    ``Shard(d)``, so that only one rank's check can find it (NaN/inf guards)."""
    x = randn(*shape, seed=seed)
    x.view(-1)[-1] = float("nan")
    return x

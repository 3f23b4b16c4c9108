"""What :func:`dtensor_patches.verify` reports: each mismatch, and the counts of the calls it saw."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Mismatch", "VerifyError", "VerifyReport"]


@dataclass(frozen=True)
class Mismatch:
    """One DTensor call whose result differs from the same op on full plain tensors.

    Attributes:
        op: the op and overload, e.g. ``"aten._local_scalar_dense.default"``.
        phase: ``"forward"`` or ``"backward"``.
        path: how DTensor ran it: ``"native"``, ``"patched: <patch>"`` or ``"fallback"``.
        problem: what differs (shape, dtype, values, spec), with the numbers.
        max_diff: the largest absolute difference of the values, when they are comparable.
        inputs: per DTensor input, ``"shape placements"``; plain arguments as ``repr``.
        outputs: the same for the outputs.
        source: the user's line that made the call, ``"file:line in fn: code"`` (for a
            backward op: the forward line that recorded it, when known).
        cell: the op and its DTensor inputs' layouts, ``"aten.squeeze.dim(S0~)"``
            (:func:`dtensor_patches.cells.cell_key`).
        known: the cell is in this release's table of cells stock torch gets wrong
            (``data/wrong_cells.json``): ``apply_all()`` routes it to the fallback's
            computation (patch ``wrong_strategy_cells``).
        call: the recorded call (``verify(keep_calls=True)``), else ``None``.
    """

    op: str
    phase: str
    path: str
    problem: str
    max_diff: float | None
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    source: str
    cell: str = ""
    known: bool = False
    call: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        diff = "" if self.max_diff is None else f" (largest difference {self.max_diff:.3g})"
        known = (
            "\n  known: stock torch gets this cell wrong on this release; apply_all() routes it"
            if self.known
            else ""
        )
        return (
            f"{self.op} ({self.phase}, {self.path}): {self.problem}{diff}{known}\n"
            f"  at {self.source}\n"
            f"  inputs:  {'; '.join(self.inputs)}\n"
            f"  outputs: {'; '.join(self.outputs)}"
        )


class VerifyError(AssertionError):
    """A DTensor call gave a different result than the single-device computation."""

    def __init__(self, mismatch: Mismatch) -> None:
        super().__init__(f"DTensor result differs from the single-device result:\n{mismatch}")
        self.mismatch = mismatch


@dataclass
class VerifyReport:
    """What :func:`verify` saw: every mismatch, and a count of the DTensor calls by path.

    Attributes:
        mismatches: in the order found.
        calls: DTensor calls seen, by op name.
        native: calls DTensor ran with torch's own strategy or handler.
        patched: calls a patch ran (a strategy, handler or miss rule of that patch), by patch.
        fallback: calls the call fallback (issue 10) ran, by op.
        unchecked: calls not compared, by reason (``"random: aten.native_dropout.default"``).
        signatures: distinct call signatures checked in this block (sampling modes; in the
            full mode every call is checked and this stays 0).
        skipped: calls let through unchecked because their signature was seen before, in this
            block or an earlier one sharing the same :class:`Signatures`, or was not sampled.
            They are not counted in ``calls``.
    """

    mismatches: list[Mismatch] = field(default_factory=list)
    calls: Counter[str] = field(default_factory=Counter)
    native: int = 0
    patched: Counter[str] = field(default_factory=Counter)
    fallback: Counter[str] = field(default_factory=Counter)
    unchecked: Counter[str] = field(default_factory=Counter)
    signatures: int = 0
    skipped: int = 0

    @property
    def clean(self) -> bool:
        """No mismatch was found."""
        return not self.mismatches

    @property
    def checked(self) -> int:
        return sum(self.calls.values()) - sum(self.unchecked.values())

    def __str__(self) -> str:
        total = sum(self.calls.values())
        lines = [
            f"dtensor_patches.verify: {total} DTensor calls ({len(self.calls)} ops), "
            f"{self.checked} checked, {len(self.mismatches)} mismatch(es)",
            f"  native {self.native}, patched {sum(self.patched.values())}"
            + (
                f" ({', '.join(f'{k} {v}' for k, v in self.patched.most_common())})"
                if self.patched
                else ""
            )
            + f", fallback {sum(self.fallback.values())}",
        ]
        if self.signatures or self.skipped:
            lines.append(
                f"  sampled: {self.signatures} signature(s) checked, "
                f"{self.skipped} call(s) with a seen or unsampled signature let through"
            )
        if self.unchecked:
            lines.append(
                "  unchecked: " + ", ".join(f"{k} x{v}" for k, v in self.unchecked.most_common())
            )
        lines += [str(m) for m in self.mismatches]
        return "\n".join(lines)

"""Replaying a recorded call (:mod:`dtensor_patches.cell_record`) under
:func:`dtensor_patches.verify`: a wrong cell's tripwire (issue 19)."""

from __future__ import annotations

from typing import Any

from dtensor_patches._torch.schemas import resolve_op
from dtensor_patches.cell_record import decode
from dtensor_patches.rank_texts import gather_texts
from dtensor_patches.verify import verify

__all__ = ["replay"]


def replay(
    call: dict[str, Any], mesh: Any, *, atol: float = 1e-5, rtol: float = 1e-4
) -> str | None:
    """Run the recorded call collectively on ``mesh`` (every rank, in the default process
    group) under :func:`dtensor_patches.verify`; what differs from the single device on any
    rank (the same answer on every rank), or ``None``.

    Raises:
        ValueError: the record's mesh shape is not ``mesh``'s, or the record is malformed.
        PatchError: the op does not exist in this torch.
    """
    if list(call["mesh"]) != list(mesh.shape):
        raise ValueError(
            f"the call was recorded on a mesh of shape {call['mesh']}, not {list(mesh.shape)}"
        )
    op = resolve_op(call["op"])
    args = [decode(a, mesh) for a in call["args"]]
    kwargs = {k: decode(v, mesh) for k, v in call["kwargs"].items()}
    problem: str | None = None
    try:
        with verify(raise_on_mismatch=False, trace_backward=False, atol=atol, rtol=rtol) as report:
            op(*args, **kwargs)
        found = [m for m in report.mismatches if m.op == call["op"]]
        problem = found[0].problem if found else None
    except Exception as exc:  # noqa: BLE001 - a call that raises is not the single-device result
        problem = (
            f"raises {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        )
    # A spec that disagrees with its local shard may be seen on one rank only: every rank
    # must answer alike, or callers that stop at the first answer would part ways.
    return next((p for p in gather_texts(problem) if p is not None), None)

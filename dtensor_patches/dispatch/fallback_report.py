"""What the gather engine ran: one record per (op, input placements), counted and logged.

Every call computed on gathered inputs is counted here with the bytes it gathered onto this
rank, whether the fallback took it or a patch that gathers by nature (``as_strided``,
``conv_layouts``) ran it; the first one of each kind is logged
(``logging.getLogger("dtensor_patches.fallback")``) and so is the 100th, as a hot-loop note.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

__all__ = [
    "HOT_LOOP_CALLS",
    "FallbackRecord",
    "count",
    "fallback_report",
    "gathered_on_this_thread",
    "reset_report",
]

log = logging.getLogger("dtensor_patches.fallback")

HOT_LOOP_CALLS = 100
"""After this many fallbacks of one (op, placements), the log says so once."""


@dataclass
class FallbackRecord:
    """One kind of fallback: ``op`` called with DTensor inputs placed as ``placements``.

    ``calls``: how often; ``bytes``: bytes gathered onto this rank over all calls (the data
    each rank received to hold full inputs; 0 for inputs that were already replicated);
    ``peak``: the most bytes one of these calls gathered onto this rank.
    """

    op: str
    placements: str
    calls: int = 0
    bytes: int = 0
    reason: str = ""
    peak: int = 0


# The counters of this process: a report, not a setting (dtensor_patches.state holds those).
_LOCK = threading.Lock()
_RECORDS: dict[tuple[str, str], FallbackRecord] = {}
_THIS_THREAD = threading.local()  # gathered calls made by each thread, for scan()'s recorder


def count(op: object, placements: str, moved: int, reason: str) -> None:
    """Count one gathered call of ``op`` on ``placements`` that moved ``moved`` bytes here."""
    key = (str(op), placements)
    _THIS_THREAD.calls = getattr(_THIS_THREAD, "calls", 0) + 1
    with _LOCK:
        record = _RECORDS.get(key)
        first = record is None
        if record is None:
            record = _RECORDS[key] = FallbackRecord(str(op), placements, reason=reason)
        record.calls += 1
        record.bytes += moved
        record.peak = max(record.peak, moved)
        calls = record.calls
    if first:
        log.warning(
            "dtensor_patches fallback: %s on %s runs on gathered inputs (%d bytes moved to "
            "this rank); torch refused it: %s",
            op,
            placements,
            moved,
            reason,
        )
    elif calls == HOT_LOOP_CALLS:
        log.warning(
            "dtensor_patches fallback: %s on %s fell back %d times (in a loop?); see "
            "dtensor_patches.fallback_report() for the bytes moved, and a patch or another "
            "placement to avoid it",
            op,
            placements,
            calls,
        )


def fallback_report() -> list[FallbackRecord]:
    """The fallbacks so far in this process, most bytes first: op, input placements, calls,
    bytes gathered onto this rank (copies; the counters keep running)."""
    with _LOCK:
        rows = [FallbackRecord(**vars(r)) for r in _RECORDS.values()]
    return sorted(rows, key=lambda r: (-r.bytes, -r.calls, r.op))


def gathered_on_this_thread() -> int:
    """How many calls this thread has computed on gathered inputs so far (never reset):
    ``scan()`` compares it around a call to see that the call was gathered."""
    return int(getattr(_THIS_THREAD, "calls", 0))


def reset_report() -> None:
    """Forget the counted fallbacks (the log then says each kind once more)."""
    with _LOCK:
        _RECORDS.clear()

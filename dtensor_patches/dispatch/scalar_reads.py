"""Reading a pending (``Partial``) DTensor scalar as a Python number: ``loss.item()``,
``float(loss)``, ``int(count)``, ``bool(flag)`` (``aten._local_scalar_dense``).

The number needs every rank's share, so the read communicates. Done on the mesh's own process
groups, a read made on some ranks only (``if rank == 0: print(loss.item())``, the most common
logging line) pairs with whatever collective the other ranks make next: rank 0 logs a wrong
number, the other rank's next all-reduce returns a wrong sum, and both then hang (issue 23,
item 6). So a read here never touches the user's groups:

- it runs on a **side group** per set of ranks (gloo, on the host, where the number goes
  anyway), made on the first read over those ranks and used by nothing else, so a read on
  one rank only waits there and leaves every other collective of the program right;
- every read first compares a **fingerprint** across the ranks of that group: the line of
  user code that reads, and the tensor's shape, dtype, placements and mesh. Two different
  reads that met on the side group (a rank-local read on rank 0, then a read on every rank)
  therefore raise :class:`~dtensor_patches.errors.RankLocalReadError` on every rank in it,
  instead of mixing two values;
- a read the other ranks never make raises the same error after
  ``DTENSOR_PATCHES_RANK_CHECK_TIMEOUT`` seconds (default 300; the side group's timeout).

The fallback makes the same check before its collectives (:func:`check_same_call`): a call it
runs on some ranks only raises :class:`~dtensor_patches.errors.RankLocalCallError` instead of
pairing its gathers with the other ranks' collectives.

After that error the ranks disagree on which reads happened: the program should stop (the
message says how to write the read so that every rank makes it).

Cost of a read: a host copy of the local share (the ``.item()`` sync torch makes anyway) and one
all-gather of two 8-byte numbers per rank per ``Partial`` mesh dim, on the host; the first read
over a set of ranks also makes its side group (a gloo rendezvous among those ranks only).
Nothing is added to any other call. Placements other than ``Partial`` of ``sum``, ``avg``,
``max``, ``min``, ``product`` and torch's norm partial (``_NormPartial``), and complex dtypes,
keep the plain reduction on the mesh's group.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import os
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtensor_patches._torch.dtensors import local_tensor
from dtensor_patches.errors import RankLocalCallError, RankLocalReadError, first_line

__all__ = [
    "RANK_CHECK_TIMEOUT_ENV",
    "check_same_call",
    "gather_if_same_call",
    "mesh_ranks",
    "read_partial_scalar",
    "side_group",
]

RANK_CHECK_TIMEOUT_ENV = "DTENSOR_PATCHES_RANK_CHECK_TIMEOUT"
"""Seconds a read of a ``Partial`` scalar, or the fallback's same-call check, waits for the
other ranks (default 300)."""

_DEFAULT_TIMEOUT_S = 300.0
_FINGERPRINT_BITS = 52  # exact in a float64
_SKIPPED_DIRS = (str(Path(torch.__file__).parent), str(Path(__file__).resolve().parents[1]))

_LOCK = threading.Lock()
# ranks -> (the default group it was made under, the side group); remade after a new world.
_SIDE_GROUPS: dict[tuple[int, ...], tuple[Any, Any]] = {}


def _timeout_s() -> float:
    raw = os.environ.get(RANK_CHECK_TIMEOUT_ENV, "").strip()
    if not raw:
        return _DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{RANK_CHECK_TIMEOUT_ENV}={raw!r}: a number of seconds > 0 is expected")
    return value


def side_group(ranks: tuple[int, ...]) -> Any:
    """The side process group of ``ranks`` (global ranks, sorted as the mesh group has them),
    made on first use by these ranks only (``use_local_synchronization``).

    Raises:
        RuntimeError: the other ranks did not make it within the read timeout (torch's error).
    """
    world = dist.group.WORLD
    with _LOCK:
        entry = _SIDE_GROUPS.get(ranks)
        if entry is not None and entry[0] is world:
            return entry[1]
        group = dist.new_group(
            list(ranks),
            backend="gloo",
            timeout=timedelta(seconds=_timeout_s()),
            use_local_synchronization=True,
        )
        _SIDE_GROUPS[ranks] = (world, group)
        return group


def _forget(ranks: tuple[int, ...]) -> None:
    with _LOCK:
        _SIDE_GROUPS.pop(ranks, None)


def _call_site() -> str:
    """``file:line`` of the innermost frame outside torch and this package: the user's read."""
    frame = inspect.currentframe()
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_SKIPPED_DIRS):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def _fingerprint(parts: list[str]) -> int:
    """A 52-bit hash of ``parts``, the same in every process (exact in a float64)."""
    digest = hashlib.blake2b("|".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << _FINGERPRINT_BITS) - 1)


def _gathered_if_same(
    ranks: tuple[int, ...],
    mine: torch.Tensor,
    site: str,
    *,
    what: str,
    noun: str,
    advice: str,
    error: type[RankLocalCallError],
) -> list[torch.Tensor]:
    """Every rank's ``mine`` (element 0: the fingerprint) gathered on the side group of
    ``ranks``, once every fingerprint is found equal.

    Raises:
        RankLocalCallError (``error``): the other ranks made no such ``noun`` within the
            timeout, or another one (the fingerprints differ); the side group is forgotten.
    """
    gathered = [torch.empty_like(mine) for _ in ranks]
    try:
        dist.all_gather(gathered, mine, group=side_group(ranks))
    except RuntimeError as exc:
        _forget(ranks)
        raise error(
            f"{site}: {what} needs every rank of {list(ranks)}, and they did not all make this "
            f"{noun} within {_timeout_s():g} s ({RANK_CHECK_TIMEOUT_ENV}) ({first_line(exc)}). "
            f"{advice}",
            site=site,
        ) from exc
    if len({int(t[0].item()) for t in gathered}) > 1:
        _forget(ranks)
        raise error(
            f"{site}: ranks {list(ranks)} met in different {noun}s ({what}; another line, op, "
            f"shape, dtype or placement on some of them): a {noun} was made on some ranks only "
            f"before this one. {advice}",
            site=site,
        )
    return gathered


_READ_ADVICE = (
    "Is it made on some ranks only (`if rank == 0: print(loss.item())`)? Read it on every rank "
    "(`value = loss.item()`, then print on one), or read this rank's share with "
    "`loss.to_local().item()`. The ranks now disagree on which reads happened: stop the program."
)
_CALL_ADVICE = (
    "A DTensor op the fallback runs gathers its inputs on every rank of the mesh, so every "
    "rank must make it (not only `if rank == 0:`). The ranks now disagree on which calls "
    "happened: stop the program."
)


def _combine(placement: Any, shares: list[float]) -> float:
    norm = getattr(placement, "norm_type", None)
    if norm is not None:
        p = float(norm)
        if p == math.inf:
            return max(shares)
        if p == -math.inf:
            return min(shares)
        if p == 0:
            return sum(shares)
        return sum(abs(s) ** p for s in shares) ** (1.0 / p)
    op = placement.reduce_op
    if op == "sum":
        return sum(shares)
    if op == "avg":
        return sum(shares) / len(shares)
    if op == "max":
        return max(shares)
    if op == "min":
        return min(shares)
    return math.prod(shares)


def _supported(placement: Any, dtype: torch.dtype) -> bool:
    if dtype.is_complex or not placement.is_partial():
        return False
    if getattr(placement, "norm_type", None) is not None:
        return True
    return getattr(placement, "reduce_op", None) in ("sum", "avg", "max", "min", "product")


def _reduce_on_side_group(
    share: float, placement: Any, ranks: tuple[int, ...], fingerprint: int, site: str, exact: bool
) -> float:
    """One read's reduction over ``ranks``: the fingerprints checked, then the shares combined
    (``exact``: integers, gathered as int64)."""
    dtype = torch.int64 if exact else torch.float64
    mine = torch.tensor([fingerprint, share], dtype=dtype)
    gathered = _gathered_if_same(
        ranks,
        mine,
        site,
        what="reading a Partial DTensor as a number",
        noun="read",
        advice=_READ_ADVICE,
        error=RankLocalReadError,
    )
    shares = [t[1].item() for t in gathered]
    return _combine(placement, shares)


def read_partial_scalar(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``aten._local_scalar_dense`` of a one-element DTensor with ``Partial`` placements:
    its Python number, reduced over each ``Partial`` mesh dim on that dim's side group.

    Shapes: any shape of one element (0-dim losses, ``[1]``). Dtypes: floating (combined in
    float64, then rounded to the dtype), integer and bool (combined exactly in int64);
    complex and other placements take the plain path (``redistribute`` to ``Replicate()`` on
    the mesh's own groups).

    Raises:
        RankLocalReadError: some ranks of a ``Partial`` mesh dim made another read, or none
            within ``DTENSOR_PATCHES_RANK_CHECK_TIMEOUT`` seconds (see the module doc).
    """
    (value,) = args
    placements = tuple(value.placements)
    partial = [(d, p) for d, p in enumerate(placements) if p.is_partial()]
    if not all(_supported(p, value.dtype) for _, p in partial):
        from torch.distributed.tensor import Replicate

        with torch.no_grad():
            wanted = [Replicate() if p.is_partial() else p for p in placements]
            reduced = value.detach().redistribute(value.device_mesh, wanted)
        return op_call(reduced, **kwargs)
    site = _call_site()
    mesh = value.device_mesh
    fingerprint = _fingerprint(
        [site, str(tuple(value.shape)), str(value.dtype), repr(placements), str(mesh.mesh.tolist())]
    )
    local = local_tensor(value).detach().to("cpu")
    exact = not local.dtype.is_floating_point
    share: float = local.item()
    for mesh_dim, placement in partial:
        group = mesh.get_group(mesh_dim)
        ranks = tuple(dist.get_process_group_ranks(group))
        if len(ranks) > 1:
            share = _reduce_on_side_group(share, placement, ranks, fingerprint, site, exact)
    return op_call(torch.tensor(share, dtype=local.dtype))


def check_same_call(op: Any, leaves: list[Any]) -> None:
    """Before the fallback's collectives: check on the side group of the mesh's ranks that
    every rank makes this call (the calling line, the op, and each DTensor input's shape,
    dtype and placements), so that a call on some ranks only never pairs its gathers with
    another collective of the other ranks (issue 23, item 6).

    Cost: one all-gather of one 8-byte number per rank on the host, on the fallback's path
    only (a call that gathers its inputs anyway).

    Raises:
        RankLocalCallError: another rank made another call, or none within
            ``DTENSOR_PATCHES_RANK_CHECK_TIMEOUT`` seconds; nothing was gathered.
    """
    mesh = leaves[0].device_mesh
    ranks = mesh_ranks(mesh)
    if len(ranks) < 2 or not dist.is_initialized():
        return
    parts = [str(op), str(mesh.mesh.tolist())]
    parts += [f"{tuple(x.shape)}{x.dtype}{tuple(x.placements)}" for x in leaves]
    gather_if_same_call(ranks, parts, [], what=f"{op} on gathered inputs", advice=_CALL_ADVICE)


def mesh_ranks(mesh: Any) -> tuple[int, ...]:
    """Every global rank of ``mesh``, sorted (the ranks of its side group)."""
    return tuple(sorted(int(r) for r in mesh.mesh.flatten().tolist()))


def gather_if_same_call(
    ranks: tuple[int, ...], parts: list[str], values: list[int], *, what: str, advice: str
) -> list[list[int]]:
    """Every rank's ``values`` (int64) gathered on the side group of ``ranks``, once every rank
    is found making the same call (the calling line and ``parts``, fingerprinted). Collective
    over ``ranks``, on the host; nothing else of the program is touched.

    Raises:
        RankLocalCallError: another rank made another call, or none within
            ``DTENSOR_PATCHES_RANK_CHECK_TIMEOUT`` seconds.
    """
    site = _call_site()
    mine = torch.tensor([_fingerprint([site, *parts]), *values], dtype=torch.int64)
    gathered = _gathered_if_same(
        ranks, mine, site, what=what, noun="call", advice=advice, error=RankLocalCallError
    )
    return [[int(v) for v in t[1:].tolist()] for t in gathered]

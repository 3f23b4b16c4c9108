"""Ranks with different Python hash seeds make different sharding decisions for one op, so its
result is wrong (2.11 to 2.15 measured: ``torch.vdot`` on 2.14 and 2.15).

``Partial``'s hash is ``1 + hash(reduce_op)``: a string hash, which Python salts per process
(``PYTHONHASHSEED``; unset, as under ``torchrun``, every rank draws its own). Torch iterates sets
of placements when it derives a strategy for an op without one from the op's decomposition
(2.11+, ``DecompShardingStrategy``: the candidate input placements are a set) and when it
searches for the cheapest strategy (2.14+: the neighbours of a placement come from sets). Where
two strategies cost the same, the first one in set order wins, and the order follows the seed.
``torch.vdot(a, b)`` of two vectors pending on a mesh dim (``[Shard(0), Partial()]`` on a 2-D
mesh, or ``Partial()`` on a 1-D one) must reduce one operand before multiplying; a rank seeded
7 reduces ``a``, a rank seeded 0 reduces ``b`` (2.14.1, 2.15.0), and the shares each rank then
multiplies do not add up to the product: a wrong value, no error, no hang (the collectives have
the same shapes). ``_MaskPartial`` (the vocab-parallel embedding's pending output) hashes the
address of its mask buffer too, which differs between processes whatever the seed.

Fix: ``Partial.__hash__`` (and ``_MaskPartial.__hash__``) hash the reduce op's name through
CRC-32 instead of Python's salted string hash, so every rank iterates a set of placements in
one order and every decision that follows that order is the same on every rank. Equal
placements still hash equal (the hash reads a subset of what ``__eq__`` compares). Cost: none
measurable: one dict lookup in place of the string hash, only where a ``Partial`` is hashed (a
propagation cache key is hashed once per spec); no op's dispatch changes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from collections.abc import Callable
from typing import Any

from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.dtensors import mask_partial_owner
from dtensor_patches.patch import Patch, WrappedFunction

PARTIAL = "torch.distributed.tensor.placement_types:Partial"

_NAME_HASHES: dict[str, int] = {}


def _name_hash(name: str) -> int:
    """A hash of ``name`` that is the same in every process (CRC-32, not Python's salted one)."""
    try:
        return _NAME_HASHES[name]
    except KeyError:
        value = _NAME_HASHES[name] = zlib.crc32(name.encode())
        return value


def _partial_hash(_torch_hash: Callable[[Any], int]) -> Callable[[Any], int]:
    names = _NAME_HASHES

    def __hash__(self: Any) -> int:
        # A dict lookup (the name's own hash is cached on the string), as cheap as torch's.
        try:
            return 1 + names[self.reduce_op]
        except KeyError:
            return 1 + _name_hash(self.reduce_op)

    __hash__.seed_independent = True  # type: ignore[attr-defined]
    return __hash__


def _mask_partial_hash(_torch_hash: Callable[[Any], int]) -> Callable[[Any], int]:
    def __hash__(self: Any) -> int:
        # Torch's also hashes id(mask_buffer); __eq__ compares the buffer by identity, so
        # leaving it out keeps equal placements hashing equal.
        offset_shape = self.offset_shape
        return 1 + hash(
            (
                _name_hash(self.reduce_op),
                None if offset_shape is None else tuple(offset_shape),
                self.offset_dim,
            )
        )

    __hash__.seed_independent = True  # type: ignore[attr-defined]
    return __hash__


def _registrations() -> list[WrappedFunction]:
    return [
        WrappedFunction("__hash__", _partial_hash, PARTIAL),
        WrappedFunction("__hash__", _mask_partial_hash, mask_partial_owner()),
    ]


# Two hash seeds whose processes order torch's sets of placements differently on stock torch
# (2.14.1 and 2.15.0 measured: a process seeded 7 reduces the other vdot operand than one
# seeded 0).
SEEDS = (0, 7)

_CHILD = """
import json, sys
if sys.argv[1] == "1":
    import dtensor_patches
    dtensor_patches.apply_all(only=["ranks_decide_alike"], fallback="off")
from torch.distributed.tensor import Partial, Replicate, Shard
partials = [Partial(op) for op in ("sum", "avg", "max", "min")]
placements = [Replicate(), Shard(0), Shard(1), *partials]
print(json.dumps({"order": [repr(p) for p in set(placements)], "hashes": [hash(p) for p in partials]}))
"""


def _children_answers(patched: bool) -> list[dict[str, Any]]:
    """What the :data:`_CHILD` interpreters, one per seed of :data:`SEEDS`, print (run side by
    side).

    Raises:
        RuntimeError: an interpreter failed or gave no answer.
    """
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, "1" if patched else "0"],
            env=dict(os.environ, PYTHONHASHSEED=str(seed), PYTHONPATH=os.pathsep.join(sys.path)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in SEEDS
    ]
    answers = []
    for seed, proc in zip(SEEDS, procs, strict=True):
        out, err = proc.communicate(timeout=300)
        if proc.returncode != 0 or not out.strip():
            tail = (err.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"an interpreter with PYTHONHASHSEED={seed} failed: {tail}")
        answers.append(json.loads(out.strip().splitlines()[-1]))
    return answers


def reproduce(mesh: Any) -> str | None:
    """Two interpreters with the hash seeds of :data:`SEEDS` (as two ranks under ``torchrun``
    may draw) hash four ``Partial`` placements and list a set of placements: the same in both,
    or the decisions that follow set order can differ between ranks. Rank 0 runs them (with
    this patch applied in them where it is applied here) and tells the others, so every rank
    returns the same (and raises the same where an interpreter failed)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Partial

    verdict: list[tuple[str, str] | None] = [None]
    if dist.get_rank() == 0:
        patched = bool(getattr(Partial.__hash__, "seed_independent", False))
        try:
            first, second = _children_answers(patched)
        except (RuntimeError, OSError, subprocess.TimeoutExpired, ValueError) as exc:
            verdict[0] = ("error", str(exc))
        else:
            if first != second:
                what = "hashes" if first["hashes"] != second["hashes"] else "set order"
                verdict[0] = (
                    "bug",
                    f"Partial placements differ in {what} between interpreters seeded "
                    f"{SEEDS[0]} and {SEEDS[1]}: {first['order']} vs {second['order']}",
                )
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is None:
        return None
    kind, message = verdict[0]
    if kind == "error":
        raise RuntimeError(message)
    return message


PATCH = Patch(
    name="ranks_decide_alike",
    summary="Partial placements hash alike on every rank, so ranks with different hash seeds "
    "make one sharding decision (vdot wrong on 2.14/2.15)",
    ops=("aten.vdot.default",),
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    reproduce=reproduce,
    upstream_fix="none yet (2.15.0 measured): Partial.__hash__ is 1 + hash(reduce_op)",
    communication="none",
)

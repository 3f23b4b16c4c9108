"""How ``verify(sample=...)`` chooses the calls it checks: a call's signature, the signatures
already decided (shared across blocks), and the fraction of new ones checked, decided alike on
every rank."""

from __future__ import annotations

import threading
import zlib
from collections.abc import Hashable
from typing import Any

import torch

from dtensor_patches._torch.dtensors import dtensor_class

__all__ = ["PROCESS_SIGNATURES", "Signatures", "fraction_of", "signature"]


def _key(value: Any, dtensor: type) -> Hashable:
    """The part of a call's signature that one argument contributes: a DTensor's class, mesh,
    placements, shape, stride and dtype; a plain tensor's shape and dtype; containers
    element-wise; ints, bools, strings, dtypes and devices by value; floats by kind (no
    sharding decision depends on a float's value, and a learning rate that changes every step
    would make every step new)."""
    if isinstance(value, dtensor):
        return (
            type(value).__name__,
            value.device_mesh,
            tuple(value.placements),
            tuple(value.shape),
            value.stride(),
            value.dtype,
        )
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(_key(v, dtensor) for v in value))
    if isinstance(value, float):
        return "float"
    if (
        isinstance(value, (bool, int, str, torch.dtype, torch.device, torch.layout))
        or value is None
    ):
        return value
    if isinstance(value, torch.memory_format):
        return str(value)
    return type(value).__name__


def signature(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    """The signature :func:`verify` samples by: the op overload and the key of every argument
    (see :func:`_key`); equal on every rank for the same SPMD call."""
    dtensor = dtensor_class()
    return (
        func,
        tuple(_key(a, dtensor) for a in args),
        tuple((k, _key(v, dtensor)) for k, v in kwargs.items()),
    )


def _sampled(key: Hashable, fraction: float) -> bool:
    """Whether a new signature is checked at ``fraction``: decided from a hash of its text,
    so every rank decides alike (Python's ``hash`` of a string differs between processes)."""
    if fraction >= 1.0:
        return True
    return zlib.crc32(repr(key).encode()) / 2**32 < fraction


class Signatures:
    """The call signatures that :func:`verify` sampling modes have decided on, shared by the
    blocks given the same instance (by default one per process), so that a training loop's
    first step checks its calls and later steps let them through.

    ``len()`` is the number of signatures decided; :meth:`clear` forgets them.
    """

    def __init__(self) -> None:
        self._decided: dict[Hashable, bool] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._decided)

    def clear(self) -> None:
        """Forget every signature: the next block checks all of them again."""
        with self._lock:
            self._decided.clear()

    def decide(self, key: Hashable, fraction: float) -> bool:
        """``True`` when a call with signature ``key`` is to be checked now: the first time it
        is seen, if sampled at ``fraction``; ``False`` afterwards."""
        if key in self._decided:
            return False
        with self._lock:
            if key in self._decided:
                return False
            self._decided[key] = _sampled(key, fraction)
            return self._decided[key]


PROCESS_SIGNATURES = Signatures()
"""The :class:`Signatures` that ``verify(sample=...)`` uses unless given its own."""


def fraction_of(sample: bool | float) -> float | None:
    """``sample`` as the fraction of new signatures to check, or ``None`` for every call."""
    if sample is False:
        return None
    if sample is True:
        return 1.0
    if not isinstance(sample, (int, float)) or not 0.0 < float(sample) <= 1.0:
        raise ValueError(
            f"verify(sample=...) takes True, False or a fraction in (0, 1]; got {sample!r}"
        )
    return float(sample)

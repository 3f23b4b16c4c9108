"""The one way to reach a private torch internal: import it, or raise ``PatchError`` naming it."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

from dtensor_patches.errors import PatchError

__all__ = ["ABSENT", "attribute", "internal", "module", "moved"]

ABSENT: Any = object()
"""What ``getattr(obj, name, ABSENT)`` returns when ``obj`` has no ``name``."""


def moved(dotted: str, what: str = "") -> PatchError:
    """The error for an internal this torch release does not have (``dotted`` names it)."""
    detail = f": {what}" if what else ""
    return PatchError(
        f"torch {torch.__version__} has no {dotted}{detail}: this private torch API moved; "
        "dtensor_patches._torch needs updating for this release",
        internal=dotted,
    )


def module(name: str) -> ModuleType:
    """``importlib.import_module(name)``.

    Raises:
        PatchError: the module does not exist in this release.
    """
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise moved(name) from exc


def attribute(obj: Any, name: str, dotted: str) -> Any:
    """``getattr(obj, name)``, ``dotted`` naming it in the error.

    Raises:
        PatchError: ``obj`` has no ``name``.
    """
    value = getattr(obj, name, ABSENT)
    if value is ABSENT:
        raise moved(dotted)
    return value


def internal(module_name: str, name: str) -> Any:
    """``module_name.name``, imported on demand.

    Raises:
        PatchError: the module or the name does not exist in this release.
    """
    return attribute(module(module_name), name, f"{module_name}.{name}")

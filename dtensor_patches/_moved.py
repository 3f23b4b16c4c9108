"""Names the redesign moved, kept importable from their old modules until the next release.

An old module (``dtensor_patches.compat``, ``.fallback``, ``.mixed``, ``.handlers``,
``.status``) holds only a module ``__getattr__`` made by :func:`forward`: the first access of a
moved name imports it from its new home and warns (``DeprecationWarning``); a name that has no
new home raises ``AttributeError`` saying so.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["forward"]


def forward(old: str, moved: Mapping[str, str], gone: str = "") -> Callable[[str], Any]:
    """A module ``__getattr__`` for the old module ``old``: ``moved`` maps each old name to its
    new home, ``"package.module:name"``; ``gone`` says where the rest went."""

    def __getattr__(name: str) -> Any:
        target = moved.get(name)
        if target is None:
            if name.startswith("__"):
                raise AttributeError(name)
            raise AttributeError(
                f"{old}.{name} is gone (the redesign moved it)" + (f": {gone}" if gone else "")
            )
        module_name, _, attr = target.partition(":")
        warnings.warn(
            f"{old}.{name} moved to {module_name}.{attr}; the old name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(module_name), attr)

    return __getattr__

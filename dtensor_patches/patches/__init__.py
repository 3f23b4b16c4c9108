"""The built-in patches, in application order. Each module holds one patch: its strategy,
gate, reproducer and upstream references together."""

from __future__ import annotations

from dtensor_patches.patch import Patch
from dtensor_patches.patches import alias

BUILTIN_PATCHES: tuple[Patch, ...] = (alias.PATCH,)

__all__ = ["BUILTIN_PATCHES"]

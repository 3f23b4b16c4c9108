"""Version-gated fixes for PyTorch DTensor gaps.

Call :func:`apply_all` once, before building the model::

    import dtensor_patches
    report = dtensor_patches.apply_all()
    print(report)

Every patch knows the torch releases it is for, its upstream issue/PR, and how to reproduce
its bug; ``dtensor-patches check`` (or ``pytest --dtensor-patches-check``) fails as soon as the
installed torch no longer has a bug a patch is gated for.
"""

from __future__ import annotations

from dtensor_patches.errors import LostWriteError, PatchError
from dtensor_patches.fallback import FALLBACK_ENV, FallbackRecord, fallback_report
from dtensor_patches.mixed import gathered_locally
from dtensor_patches.patch import Handler, Patch, Strategy
from dtensor_patches.registry import (
    DISABLE_ENV,
    all_patches,
    apply_all,
    get,
    patched,
    plan,
    revert_all,
)
from dtensor_patches.report import Outcome, Report, Status

__version__ = "0.1.0"

__all__ = [
    "DISABLE_ENV",
    "FALLBACK_ENV",
    "FallbackRecord",
    "Handler",
    "LostWriteError",
    "Outcome",
    "Patch",
    "PatchError",
    "Report",
    "Status",
    "Strategy",
    "__version__",
    "all_patches",
    "apply_all",
    "fallback_report",
    "gathered_locally",
    "get",
    "patched",
    "plan",
    "revert_all",
]

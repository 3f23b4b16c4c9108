"""Version-gated fixes for PyTorch DTensor gaps.

Call :func:`apply_all` once, before building the model::

    import dtensor_patches
    report = dtensor_patches.apply_all()
    print(report)

Every patch knows the torch releases it is for, its upstream issue/PR, and how to reproduce
its bug; ``dtensor-patches check`` (or ``pytest --dtensor-patches-check``) fails as soon as the
installed torch no longer has a bug a patch is gated for.

The public names are imported on first use: ``import dtensor_patches`` alone does not import
torch, so the CLI's ``--help`` and the pytest plugin (loaded by every pytest run) stay fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dtensor_patches.errors import LostWriteError, MixedTensorError, PatchError

if TYPE_CHECKING:
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
    from dtensor_patches.scan import scan
    from dtensor_patches.status import PatchState, RegistryStatus, status
    from dtensor_patches.verify import Mismatch, VerifyError, VerifyReport, verify

__version__ = "0.1.0"

# name -> module that defines it; importing those modules imports torch.
_LAZY = {
    "Handler": "dtensor_patches.patch",
    "Patch": "dtensor_patches.patch",
    "Strategy": "dtensor_patches.patch",
    "DISABLE_ENV": "dtensor_patches.registry",
    "all_patches": "dtensor_patches.registry",
    "apply_all": "dtensor_patches.registry",
    "get": "dtensor_patches.registry",
    "patched": "dtensor_patches.registry",
    "plan": "dtensor_patches.registry",
    "revert_all": "dtensor_patches.registry",
    "Outcome": "dtensor_patches.report",
    "Report": "dtensor_patches.report",
    "Status": "dtensor_patches.report",
    "scan": "dtensor_patches.scan",
    "FALLBACK_ENV": "dtensor_patches.fallback",
    "FallbackRecord": "dtensor_patches.fallback",
    "fallback_report": "dtensor_patches.fallback",
    "gathered_locally": "dtensor_patches.mixed",
    "PatchState": "dtensor_patches.status",
    "RegistryStatus": "dtensor_patches.status",
    "status": "dtensor_patches.status",
    "Mismatch": "dtensor_patches.verify",
    "VerifyError": "dtensor_patches.verify",
    "VerifyReport": "dtensor_patches.verify",
    "verify": "dtensor_patches.verify",
}

__all__ = [
    "DISABLE_ENV",
    "FALLBACK_ENV",
    "FallbackRecord",
    "Handler",
    "LostWriteError",
    "Mismatch",
    "MixedTensorError",
    "Outcome",
    "Patch",
    "PatchError",
    "PatchState",
    "RegistryStatus",
    "Report",
    "Status",
    "Strategy",
    "VerifyError",
    "VerifyReport",
    "__version__",
    "all_patches",
    "apply_all",
    "fallback_report",
    "gathered_locally",
    "get",
    "patched",
    "plan",
    "revert_all",
    "scan",
    "status",
    "verify",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dtensor_patches' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

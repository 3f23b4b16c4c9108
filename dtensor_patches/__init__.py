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

from dtensor_patches.errors import (
    FallbackBudgetError,
    LostWriteError,
    MixedTensorError,
    PatchError,
    RankLocalCallError,
    RankLocalReadError,
)

if TYPE_CHECKING:
    from dtensor_patches.dispatch.fallback import FALLBACK_ENV
    from dtensor_patches.dispatch.fallback_budget import (
        fallback_budget,
        fallback_peak,
        set_fallback_budget,
    )
    from dtensor_patches.dispatch.fallback_report import FallbackRecord, fallback_report
    from dtensor_patches.dispatch.mixed import gathered_locally
    from dtensor_patches.norms import clip_grad_norm_, grad_norm
    from dtensor_patches.patch import (
        Handler,
        LossParallelHandler,
        MissRule,
        Patch,
        Strategy,
        TrackViews,
        WrappedFunction,
    )
    from dtensor_patches.registry import (
        DISABLE_ENV,
        all_patches,
        apply_all,
        get,
        patched,
        plan,
        revert_all,
    )
    from dtensor_patches.registry_health import PatchHealth, RegistryHealth, health
    from dtensor_patches.report import Outcome, Report, Status
    from dtensor_patches.scan import scan
    from dtensor_patches.verify import Mismatch, VerifyError, VerifyReport, verify

__version__ = "0.1.0"

# name -> module that defines it; importing those modules imports torch.
_LAZY = {
    "Handler": "dtensor_patches.patch",
    "LossParallelHandler": "dtensor_patches.patch",
    "MissRule": "dtensor_patches.patch",
    "Patch": "dtensor_patches.patch",
    "Strategy": "dtensor_patches.patch",
    "TrackViews": "dtensor_patches.patch",
    "WrappedFunction": "dtensor_patches.patch",
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
    "FALLBACK_ENV": "dtensor_patches.dispatch.fallback",
    "FallbackRecord": "dtensor_patches.dispatch.fallback_report",
    "fallback_report": "dtensor_patches.dispatch.fallback_report",
    "fallback_budget": "dtensor_patches.dispatch.fallback_budget",
    "fallback_peak": "dtensor_patches.dispatch.fallback_budget",
    "set_fallback_budget": "dtensor_patches.dispatch.fallback_budget",
    "gathered_locally": "dtensor_patches.dispatch.mixed",
    "grad_norm": "dtensor_patches.norms",
    "clip_grad_norm_": "dtensor_patches.norms",
    "PatchHealth": "dtensor_patches.registry_health",
    "RegistryHealth": "dtensor_patches.registry_health",
    "health": "dtensor_patches.registry_health",
    "Mismatch": "dtensor_patches.verify",
    "VerifyError": "dtensor_patches.verify",
    "VerifyReport": "dtensor_patches.verify",
    "verify": "dtensor_patches.verify",
}

# Former names -> their new ones (module:name); they warn until the next release.
_DEPRECATED = {
    "status": "dtensor_patches.registry_health:health",
    "RegistryStatus": "dtensor_patches.registry_health:RegistryHealth",
    "PatchState": "dtensor_patches.registry_health:PatchHealth",
}

__all__ = [
    "DISABLE_ENV",
    "FALLBACK_ENV",
    "FallbackBudgetError",
    "FallbackRecord",
    "Handler",
    "LossParallelHandler",
    "LostWriteError",
    "Mismatch",
    "MissRule",
    "MixedTensorError",
    "Outcome",
    "Patch",
    "PatchError",
    "PatchHealth",
    "RankLocalCallError",
    "RankLocalReadError",
    "RegistryHealth",
    "Report",
    "Status",
    "Strategy",
    "TrackViews",
    "VerifyError",
    "VerifyReport",
    "WrappedFunction",
    "__version__",
    "all_patches",
    "apply_all",
    "clip_grad_norm_",
    "fallback_budget",
    "fallback_peak",
    "fallback_report",
    "gathered_locally",
    "get",
    "grad_norm",
    "health",
    "patched",
    "plan",
    "revert_all",
    "scan",
    "set_fallback_budget",
    "verify",
]


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        import warnings

        new_module, _, new_name = _DEPRECATED[name].partition(":")
        warnings.warn(
            f"dtensor_patches.{name} is now dtensor_patches.{new_name}; the old name goes in "
            "the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(new_module), new_name)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dtensor_patches' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

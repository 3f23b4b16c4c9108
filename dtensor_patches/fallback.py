"""The former home of the fallback: now ``dtensor_patches.dispatch.fallback`` (modes, install),
``.gather`` (the engine) and ``.fallback_report``.

Moved by the redesign; the old names import with a ``DeprecationWarning`` until the next release."""

from dtensor_patches._moved import forward

__getattr__ = forward(
    "dtensor_patches.fallback",
    {
        "FALLBACK_ENV": "dtensor_patches.dispatch.fallback:FALLBACK_ENV",
        "MODES": "dtensor_patches.dispatch.fallback:MODES",
        "FallbackRecord": "dtensor_patches.dispatch.fallback_report:FallbackRecord",
        "HOT_LOOP_CALLS": "dtensor_patches.dispatch.fallback_report:HOT_LOOP_CALLS",
        "disabled": "dtensor_patches.dispatch.fallback:disabled",
        "fallback_report": "dtensor_patches.dispatch.fallback_report:fallback_report",
        "install": "dtensor_patches.dispatch.fallback:install",
        "mode": "dtensor_patches.dispatch.fallback:mode",
        "reset_report": "dtensor_patches.dispatch.fallback_report:reset_report",
        "resolve_mode": "dtensor_patches.dispatch.fallback:resolve_mode",
        "run_fallback": "dtensor_patches.dispatch.fallback:run_fallback",
        "run_gathered": "dtensor_patches.dispatch.gather:run_gathered",
        "uninstall": "dtensor_patches.dispatch.fallback:uninstall",
    },
    "see dtensor_patches.dispatch.fallback",
)

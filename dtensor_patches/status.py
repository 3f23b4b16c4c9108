"""The 0.1.0 name of the registry health check: now ``dtensor_patches.health``.

Moved in 0.2.0; the old names import with a ``DeprecationWarning`` for one release."""

from dtensor_patches._moved import forward

__getattr__ = forward(
    "dtensor_patches.status",
    {
        "status": "dtensor_patches.health:health",
        "RegistryStatus": "dtensor_patches.health:RegistryHealth",
        "PatchState": "dtensor_patches.health:PatchHealth",
    },
    "see dtensor_patches.health",
)

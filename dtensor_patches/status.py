"""The former name of the registry health check: now ``dtensor_patches.health()``
(``dtensor_patches.registry_health``).

Moved by the redesign; the old names import with a ``DeprecationWarning`` until the next release."""

from dtensor_patches._moved import forward

__getattr__ = forward(
    "dtensor_patches.status",
    {
        "status": "dtensor_patches.registry_health:health",
        "RegistryStatus": "dtensor_patches.registry_health:RegistryHealth",
        "PatchState": "dtensor_patches.registry_health:PatchHealth",
    },
    "see dtensor_patches.registry_health",
)

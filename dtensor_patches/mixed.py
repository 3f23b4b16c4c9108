"""The former home of the mixed-kind fixes: now ``dtensor_patches.dispatch.mixed``.

Moved by the redesign; the old names import with a ``DeprecationWarning`` until the next release."""

from dtensor_patches._moved import forward

__getattr__ = forward(
    "dtensor_patches.mixed",
    {
        "ambiguity_error": "dtensor_patches.dispatch.mixed:ambiguity_error",
        "clip_grads_with_norm": "dtensor_patches.dispatch.mixed:clip_grads_with_norm",
        "gathered_locally": "dtensor_patches.dispatch.mixed:gathered_locally",
        "total_norm": "dtensor_patches.dispatch.mixed:total_norm",
    },
    "the grouping and norm wrappers are registrations of the fallback (dtensor_patches.dispatch.mixed.registrations)",
)

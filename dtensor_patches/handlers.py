"""The former helper library of custom handlers: now ``dtensor_patches.dispatch.gather`` (the gather
engine) and ``dtensor_patches.dispatch.shards``.

Moved by the redesign; the old names import with a ``DeprecationWarning`` until the next release."""

from dtensor_patches._moved import forward

__getattr__ = forward(
    "dtensor_patches.handlers",
    {
        "contiguous_stride": "dtensor_patches.dispatch.shards:contiguous_stride",
        "full_tensor": "dtensor_patches._torch.dtensors:full_tensor",
        "inplace_through_full": "dtensor_patches.dispatch.gather:inplace_through_full",
        "partial_shares": "dtensor_patches.dispatch.shards:partial_shares",
        "replicated_result": "dtensor_patches.dispatch.gather:replicated_result",
        "shard_of": "dtensor_patches.dispatch.shards:shard_of",
    },
    "the loss handlers are part of the losses patches (dtensor_patches.patches.losses)",
)

"""PPO value (critic) worker on PyTorch DTensor with FSDP2 + tensor and sequence parallelism.

Modules, one job each:

- :mod:`ppo_value.config`     typed configuration (:class:`ValueConfig`).
- :mod:`ppo_value.alignment`  the ``V(s_t)`` right shift and the loss wrapper that applies it.
- :mod:`ppo_value.losses`     clipped value loss with global token normalisation.
- :mod:`ppo_value.gae`        generalised advantage estimation and masked whitening.
- :mod:`ppo_value.metrics`    globally reduced statistics (explained variance, value stats).
- :mod:`ppo_value.model`      ``transformers`` backbone plus a float32 scalar value head.
- :mod:`ppo_value.parallel`   the (dp, tp) mesh, the TP + SP plan, FSDP2 sharding, SP padding.
- :mod:`ppo_value.packing`    sequence packing: rows, block-diagonal causal masks, unpacking.
- :mod:`ppo_value.batching`   fixed-size and token-budget micro-batch plans, equal across dp.
- :mod:`ppo_value.activation_checkpointing` recompute each decoder layer in backward.
- :mod:`ppo_value.grad_norm`  gradient norm and clipping in one collective over the mesh.
- :mod:`ppo_value.numa`       pin GPU workers to their GPU's NUMA node.
- :mod:`ppo_value.checkpoint` atomic sharded checkpoints (DCP) and Hugging Face export.
- :mod:`ppo_value.worker`     :class:`ValueWorker`: ``get_values``, ``train``, checkpoints, hooks.
- :mod:`ppo_value.ray_group`  the worker as a Ray actor and a group of them.
- :mod:`ppo_value.task`       an in-process verifiable arithmetic task and tokenizer (demo data).
- :mod:`ppo_value.gates`      the metric gates of a training run (loss, EV, grad norm, EV rise).
- :mod:`ppo_value.demo`       ``python -m ppo_value.demo``: train the critic end to end.

Heavy modules (torch.distributed, transformers, ray) are imported lazily by their users.
"""

import warnings

with warnings.catch_warnings():
    # Without NumPy (it comes with the ppo extra), torch warns at import time that it could not
    # initialise it; nothing imported here converts to NumPy, so the warning is noise.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    from ppo_value.alignment import RightShiftLossWrapper, right_shift_values
    from ppo_value.config import ValueConfig
    from ppo_value.gae import compute_gae, masked_whiten
    from ppo_value.losses import clipped_value_loss

__all__ = [
    "RightShiftLossWrapper",
    "ValueConfig",
    "clipped_value_loss",
    "compute_gae",
    "masked_whiten",
    "right_shift_values",
]

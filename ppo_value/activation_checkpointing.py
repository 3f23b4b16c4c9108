"""Activation checkpointing per decoder layer.

Each decoder layer's forward runs under ``torch.utils.checkpoint.checkpoint`` (non-reentrant):
only the layer inputs are kept for backward and the layer is recomputed there, trading one more
forward per layer for the activation memory of all but one layer.

The layer's ``forward`` is replaced on the instance instead of wrapping the module, so parameter
names and state-dict keys stay those of ``transformers`` (checkpoints and ``export_hf`` are
unchanged). FSDP2's hooks sit on the module call, outside the checkpointed region (as with
torchtitan's wrapper applied before ``fully_shard``); the tensor-parallel hooks of the layer's
submodules run again in the recomputation, issuing the same collectives in the same order on
every rank. Gradients equal those without checkpointing (the model has no dropout).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["enable_activation_checkpointing"]

_MARK = "_ppo_value_checkpointed"


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # inference: nothing to save, nothing to recompute
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def enable_activation_checkpointing(layers: nn.ModuleList | list[nn.Module]) -> int:
    """Checkpoint every module of ``layers`` (e.g. ``model.model.layers``) in place.

    Idempotent: a layer already checkpointed is left alone. Call it before or after TP/FSDP2.

    Returns:
        The number of layers newly checkpointed.
    """
    count = 0
    for layer in layers:
        if getattr(layer, _MARK, False):
            continue
        layer.forward = functools.partial(_checkpointed, layer.forward)  # type: ignore[method-assign]
        setattr(layer, _MARK, True)
        count += 1
    return count

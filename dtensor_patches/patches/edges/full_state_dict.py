"""``Module.load_state_dict`` of a full, plain state dict into a model whose parameters are
DTensors (FSDP2, TP, both): refused on every release. The same for an optimizer's state.

Loading a full checkpoint into a sharded model is what every RL stack does at start-up (HF
weights into an FSDP2 actor, the reference policy, the critic's initial weights). Each rank
holds the whole plain tensor; ``Module._load_from_state_dict`` calls ``param.copy_(input)``
and DTensor refuses a plain source (``got mixed torch.Tensor and DTensor``), which
``load_state_dict`` reports as an error per parameter after loading the plain ones: a
half-loaded model. torch's own route is ``set_model_state_dict(..., full_state_dict=True)``.

Fix: ``torch.nn.Module.load_state_dict`` is wrapped. Before torch loads anything, every plain
tensor whose target is a DTensor parameter or buffer is checked against the target's global
shape, and becomes that DTensor's layout of the given value: this rank's shard, cut locally
with ``distribute_tensor(..., src_data_rank=None)`` (no communication; the value is taken to
be the same on every rank, as a full checkpoint is). Then torch's ``load_state_dict`` runs as
always (``strict``, ``assign``, missing and unexpected keys, hooks). A shape that differs
raises torch's ``RuntimeError`` text (``size mismatch for <key>``) before any tensor is
written, and a target placed ``Partial`` raises ``ValueError``: nothing is half-loaded.

Optimizers: ``Optimizer.load_state_dict`` of a full (or this rank's own) plain optimizer state
keeps the plain tensors (``exp_avg`` of a DTensor parameter), and the next ``step`` fails with
``got mixed torch.Tensor and DTensor``. torch's per-value policy
(``Optimizer._process_value_according_to_param_policy``, which casts each loaded value like its
parameter) is wrapped: a value of the parameter's global shape becomes this rank's part of it,
laid out like the parameter; one of its local shape is this rank's shard. ``step`` is left as
torch keeps it. torch builds the whole new state before it sets any, so a failure changes
nothing.

Cost: a look at the module's parameters and buffers per ``load_state_dict`` call given plain
tensors; where some are DTensors, one walk of ``state_dict(keep_vars=True)``; the copies
torch would make anyway.
"""

from __future__ import annotations

import copy
import itertools
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches.patch import Patch, WrappedFunction
from dtensor_patches.reproducers import compare, randn

OPS = ("aten.copy_.default",)


def shards_of_full_values(
    module: torch.nn.Module, state_dict: Mapping[str, Any]
) -> Mapping[str, Any]:
    """``state_dict`` with each plain tensor whose target in ``module`` is a DTensor replaced
    by a DTensor of that target's mesh and placements holding this rank's part of the value
    (dtype and device as given; ``copy_`` converts them as usual). ``state_dict`` itself is
    returned when there is nothing to convert.

    Raises:
        RuntimeError: a value's shape differs from its DTensor target's global shape (every
            such key is named, as ``load_state_dict`` names them).
        ValueError: a target's placements include ``Partial``.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    plain = [
        key
        for key, value in state_dict.items()
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
    ]
    if not plain or not any(
        isinstance(t, DTensor) for t in itertools.chain(module.parameters(), module.buffers())
    ):
        return state_dict
    targets = module.state_dict(keep_vars=True)
    wanted = [key for key in plain if isinstance(targets.get(key), DTensor)]
    if not wanted:
        return state_dict
    mismatches = [
        f"size mismatch for {key}: copying a param with shape {state_dict[key].shape} from "
        f"checkpoint, the shape in current model is {targets[key].shape}."
        for key in wanted
        if state_dict[key].shape != targets[key].shape
    ]
    if mismatches:
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(module).__name__}:\n\t"
            + "\n\t".join(mismatches)
            + "\n(nothing was loaded)"
        )
    for key in wanted:
        if any(p.is_partial() for p in targets[key].placements):
            raise ValueError(
                f"load_state_dict: {key} is a DTensor placed {tuple(targets[key].placements)}; "
                "a full value cannot be split into pending partial sums. Load it as "
                "Replicate() and redistribute"
            )
    # A shallow copy keeps the class and the attributes torch reads back (the per-module
    # version ``_metadata`` of an OrderedDict from ``state_dict()``).
    out: Any = copy.copy(state_dict) if isinstance(state_dict, dict) else OrderedDict(state_dict)
    for key in wanted:
        target = targets[key]
        out[key] = distribute_tensor(
            state_dict[key].detach(), target.device_mesh, target.placements, src_data_rank=None
        )
    return out


def _loading_shards(load: Callable[..., Any]) -> Callable[..., Any]:
    def load_state_dict(
        self: torch.nn.Module, state_dict: Mapping[str, Any], *args: Any, **kwargs: Any
    ) -> Any:
        """torch's ``Module.load_state_dict``, with plain full values for DTensor targets cut
        to this rank's shard first."""
        return load(self, shards_of_full_values(self, state_dict), *args, **kwargs)

    load_state_dict.__wrapped__ = load  # type: ignore[attr-defined]
    return load_state_dict


def optimizer_value_for(param: Any, value: Any) -> Any:
    """An optimizer state value (already cast by torch's policy) for a DTensor ``param``: a
    plain tensor of ``param``'s global shape becomes a DTensor laid out like ``param`` holding
    this rank's part of it (a full optimizer checkpoint); one of ``param``'s local shape (and
    not its global one) is this rank's own shard (a per-rank checkpoint) and is wrapped as it
    is. Anything else is returned unchanged, as torch would keep it.

    Raises:
        ValueError: ``param`` is placed ``Partial``.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor):
        return value
    if isinstance(value, DTensor):
        return value
    if any(p.is_partial() for p in param.placements):
        raise ValueError(
            f"optimizer load_state_dict: a parameter placed {tuple(param.placements)}; a plain "
            "state value cannot be split into pending partial sums"
        )
    if value.shape == param.shape:
        return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
    if value.shape == param.to_local().shape:
        return DTensor.from_local(
            value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
    return value


def _optimizer_values(process: Callable[..., Any]) -> Callable[..., Any]:
    def process_value(
        param: Any, value: Any, param_id: int, param_groups: Any, key: Any = None
    ) -> Any:
        """torch's policy for one loaded optimizer state value, then its DTensor layout."""
        out = process(param, value, param_id, param_groups, key)
        return out if key == "step" else optimizer_value_for(param, out)

    return staticmethod(process_value)  # type: ignore[return-value]


def _registrations() -> list[WrappedFunction]:
    return [
        WrappedFunction("load_state_dict", _loading_shards),
        WrappedFunction("_process_value_according_to_param_policy", _optimizer_values),
    ]


def reproduce(mesh: Any) -> str | None:
    """A ``ColwiseParallel`` ``Linear(4, 6)`` loads a full plain state dict: every rank's
    parameters against the given values."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    full = {"weight": randn(6, 4), "bias": randn(6, seed=1)}
    model = torch.nn.Linear(4, 6)
    parallelize_module(model, mesh, ColwiseParallel())

    def load() -> tuple[torch.Tensor, torch.Tensor]:
        model.load_state_dict(full)
        return model.weight.full_tensor(), model.bias.full_tensor()

    try:
        got = load()
    except RuntimeError as exc:  # torch lists each parameter's error on the lines after the first
        detail = " ".join(str(exc).split())
        return f"load_state_dict of plain tensors into TP parameters: {detail[:240]}"
    return compare(got[0], full["weight"], what="loaded weight") or compare(
        got[1], full["bias"], what="loaded bias"
    )


PATCH = Patch(
    name="full_state_dict",
    summary="Module.load_state_dict of full plain tensors into DTensor parameters and buffers",
    ops=OPS,
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    reproduce=reproduce,
    overrides_existing=True,
    communication="none (each rank cuts its shard from the full value it holds)",
)

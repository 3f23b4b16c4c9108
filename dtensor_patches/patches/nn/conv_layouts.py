"""Convolutions on DTensors in the layouts torch's convolution handler was not written for.

Trigger: ``F.conv1d/conv2d/conv3d`` (and the transposed ones) with a sharded weight or bias, an
input sharded on channels or on a spatial dim, a ``Partial`` input, or ``bias=None`` on 2.9.
Torch routes ``aten.convolution`` and ``aten.convolution_backward`` to custom handlers built
for two layouts: an input sharded only on the batch (or replicated) with a replicated weight
and bias, and an input sharded on its last spatial dim with "same" padding (a halo exchange
between neighbouring ranks). Every other layout runs the local kernel on shards it does not
fit, measured on 2.9.1 and 2.13.0:

- a sharded weight or bias: a kernel error (``expected bias to be 1-dimensional with 3
  elements, but got bias of size [2]``);
- an input sharded on channels: a kernel error; on its last spatial dim without padding: each
  rank convolves only its own slab and the windows across the boundary are lost, silently
  (``conv3d`` of a ``Shard(-1)`` input: the local shape ``(1, 1, 1, 1, 4)`` under a global
  ``(1, 1, 1, 1, 7)``);
- ``bias=None`` on 2.9: torch's propagation rule asserts a bias (``AssertionError``); 2.9 also
  asserts the halo conditions for batch-sharded inputs (stride equal to the kernel, …);
- a ``Partial`` input with a bias: the bias is added once per rank.

Fix: one custom handler per op, replacing torch's. It acts on the placements of the call:

- batch layout (input ``Shard(0)``/``Replicate()`` on every mesh dim; weight and bias
  ``Replicate()``): the local kernel on each rank, no communication; the output keeps the
  input's placements. Backward: ``grad_output`` placed like the input, ``grad_input`` like the
  input, ``grad_weight``/``grad_bias`` ``Partial(sum)`` over the mesh dims that shard the batch;
- the input sharded on its last spatial dim, which torch's halo exchange is for: measured
  wrong with it on 2.13 (forward and backward disagree in shape with a "same"-padded
  ``conv1d``: ``The size of tensor a (8) must match the size of tensor b (4)``), so it is
  computed gathered as below;
- anything else: the fallback's machinery (``dispatch.gather.run_gathered``): inputs gathered, the op
  run once on full tensors, outputs described (``Replicate()`` unless an output has the shape
  of an input); logged and counted in ``fallback_report()`` like any fallback.

Cost: a placement check per convolution call, in a Python handler that torch already runs for
every DTensor convolution. All-or-nothing: the op writes nothing in place, and outputs are made
only after the computation succeeded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.dtensors import local_tensor
from dtensor_patches._torch.schemas import op_arguments
from dtensor_patches.dispatch.shards import contiguous_stride
from dtensor_patches.patch import Handler, Patch
from dtensor_patches.reproducers import Case, loss_and_grad, randn

FORWARD = "aten.convolution.default"
BACKWARD = "aten.convolution_backward.default"


def _is_replicate(placements: Any) -> bool:
    from torch.distributed.tensor import Replicate

    return all(isinstance(p, Replicate) for p in placements)


def _params_replicated(*params: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return all(
        p is None or (isinstance(p, DTensor) and _is_replicate(p.placements)) for p in params
    )


def _batch_layout(x: Any, mesh: Any) -> bool:
    """Sharded on the batch dim only (or replicated), on ``mesh``."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return (
        isinstance(x, DTensor)
        and x.device_mesh == mesh
        and all(
            isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0) for p in x.placements
        )
    )


def _wrap(local: torch.Tensor | None, like: Any, placements: Any, batch: int | None) -> Any:
    from torch.distributed.tensor import DTensor

    if local is None:
        return None
    shape = list(local.shape)
    if batch is not None:
        shape[0] = batch
    size = torch.Size(shape)
    return DTensor.from_local(
        local,
        like.device_mesh,
        placements,
        run_check=False,
        shape=size,
        stride=contiguous_stride(size),
    )


def _gathered(op_call: Any, args: Any, kwargs: Any) -> Any:
    """Every layout but the batch one: the fallback's computation on gathered inputs."""
    from dtensor_patches.dispatch import gather

    return gather.run_gathered(
        op_call, tuple(args), dict(kwargs), "convolution layout torch's handler does not compute"
    )


def _forward_handler() -> Callable[..., Any]:
    def handle(op_call: Any, args: Any, kwargs: Any) -> Any:
        bound = op_arguments(op_call, tuple(args), dict(kwargs))
        x, weight, bias = bound["input"], bound["weight"], bound.get("bias")
        mesh = x.device_mesh
        if _batch_layout(x, mesh) and _params_replicated(weight, bias):
            local = op_call(
                *[local_tensor(a) if hasattr(a, "device_mesh") else a for a in args],
                **kwargs,
            )
            return _wrap(local, x, x.placements, int(x.shape[0]))
        return _gathered(op_call, args, kwargs)

    return handle


def _backward_handler() -> Callable[..., Any]:
    def handle(op_call: Any, args: Any, kwargs: Any) -> Any:
        from torch.distributed.tensor import DTensor, Partial, Replicate

        bound = op_arguments(op_call, tuple(args), dict(kwargs))
        grad_out, x, weight = bound["grad_output"], bound["input"], bound["weight"]
        mesh = x.device_mesh
        if (
            _batch_layout(x, mesh)
            and _params_replicated(weight)
            and isinstance(grad_out, DTensor)
            and grad_out.device_mesh == mesh
        ):
            if tuple(grad_out.placements) != tuple(x.placements):
                grad_out = grad_out.redistribute(mesh, x.placements)
            local_args = [
                local_tensor(grad_out),
                local_tensor(x),
                local_tensor(weight),
                *args[3:],
            ]
            grad_input, grad_weight, grad_bias = op_call(*local_args, **kwargs)
            # Each rank summed the gradient over its own batch rows: a pending sum over the
            # mesh dims that shard the batch.
            param_placements = [
                Replicate() if isinstance(p, Replicate) else Partial() for p in x.placements
            ]
            return (
                _wrap(grad_input, x, x.placements, int(x.shape[0])),
                _wrap(grad_weight, x, param_placements, None),
                _wrap(grad_bias, x, param_placements, None),
            )
        return _gathered(op_call, args, kwargs)

    return handle


def _registrations() -> list[Handler]:
    return [
        Handler(FORWARD, _forward_handler()),
        Handler(BACKWARD, _backward_handler()),
    ]


def _conv(fn: Callable[..., torch.Tensor], **options: Any) -> Callable[..., Any]:
    """``fn(x, w, b, **options)``: value and the gradient w.r.t. ``x``."""
    return loss_and_grad(lambda x, w, *b: fn(x, w, *(b or (None,)), **options))


# The tripwire's cases: Convolutions with sharded weights, channel and spatial shards, ``bias=None``, forward and input gradient, against single-device results.
CASES = [
    Case(
        "conv2d, weight and bias Shard(0)",
        lambda x, w, b: torch.nn.functional.conv2d(x, w, b, padding=1),
        lambda: [randn(2, 3, 5, 5), randn(4, 3, 3, 3), randn(4)],
        ["R", "S0", "S0"],
    ),
    Case(
        "conv1d, input Shard(-1), no padding (windows across shards)",
        _conv(torch.nn.functional.conv1d),
        lambda: [randn(2, 3, 8), randn(4, 3, 3), randn(4)],
        ["S-1", "R", "R"],
    ),
    Case(
        "conv3d bias=None, input Shard(0)",
        _conv(torch.nn.functional.conv3d, stride=1),
        lambda: [randn(4, 2, 3, 4, 4), randn(3, 2, 2, 2, 2)],
        ["S0", "R"],
    ),
    Case(
        "conv2d, input Shard(1) (channels)",
        _conv(torch.nn.functional.conv2d),
        lambda: [randn(2, 4, 5, 5), randn(3, 4, 3, 3), randn(3)],
        ["S1", "R", "R"],
    ),
]


PATCH = Patch(
    name="conv_layouts",
    summary="conv1d/2d/3d (and transposed) in every layout: sharded weights, channels, no halo",
    ops=(FORWARD, BACKWARD),
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    cases=CASES,
    replicates=True,  # every layout but the batch one is computed on gathered inputs
    overrides_existing=True,
    communication="none in the batch layout; else **replicates**",
)

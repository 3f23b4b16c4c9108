"""Run a call by torch's own sharding decision, in Python, without letting the C++ fast path
(2.10+) cache that decision.

For calls with a plain tensor beside DTensors: the C++ cache key of such a call is the same as
that of the call with a ``Replicate()`` DTensor in the plain tensor's place, so a cached
decision would let every later call with that signature through without asking Python what
the plain tensor is. Returning the output from the slow path (instead of the decision) keeps
it out of the cache, as torch itself does for the decompositions it runs there.
"""

from __future__ import annotations

from typing import Any

import torch

from dtensor_patches._torch.access import attribute, internal
from dtensor_patches._torch.dtensors import dtensor_class, set_spec, spec_of
from dtensor_patches._torch.schemas import out_argument_names
from dtensor_patches._torch.tables import op_dispatcher
from dtensor_patches.errors import MixedTensorError

__all__ = ["has_plain_tensor", "run_uncached"]


def has_plain_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a plain tensor of more than one element sits among the call's arguments (one
    level of lists, as ATen schemas nest them)."""
    dtensor = dtensor_class()

    def plain(x: Any) -> bool:
        return isinstance(x, torch.Tensor) and not isinstance(x, dtensor) and x.numel() != 1

    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            if any(plain(x) for x in value):
                return True
        elif plain(value):
            return True
    return False


def _refuse(op_call: Any, target: torch.Tensor, why: str) -> MixedTensorError:
    return MixedTensorError(
        f"{op_call}: the plain torch.Tensor of shape {list(target.shape)} it writes into {why}; "
        "write into a DTensor instead (`DTensor.from_local(t, mesh, placements)`), or write "
        "the DTensor's full value: `t.copy_(d.full_tensor())`",
        op=str(op_call),
        shape=tuple(target.shape),
    )


def run_uncached(
    op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any], op_info: Any, sharding: Any
) -> Any:
    """The output of ``op_call`` run by torch's decision ``sharding`` (an ``OutputSharding``)
    for ``op_info`` (torch's ``OpInfo`` of the call): the inputs redistributed as it says, the
    local op, the output wrapped (``OpDispatcher._dispatch_get_local_results_slow_path`` and
    ``wrap``). An in-place op writing into a plain tensor writes it whole, as the single device
    would (torch's own tail refuses a plain target with a bare ``AssertionError``).

    Raises:
        MixedTensorError: a plain target that torch's decision would redistribute (the write
            would be lost) or a plain ``out=`` tensor; raised before anything runs.
        PatchError: an internal moved.
    """
    dispatcher = op_dispatcher()
    schema = op_info.schema
    dtensor = dtensor_class()
    inplace = schema.is_inplace_op()
    out_variant = schema.is_out_variant_op()
    if inplace and not isinstance(args[0], dtensor):
        redistributed = sharding.redistribute_schema if sharding.needs_redistribute else None
        if redistributed is not None and tuple(redistributed.args_schema[0].placements) != tuple(
            schema.args_schema[0].placements
        ):
            raise _refuse(op_call, args[0], "would be written in a redistributed copy")
    if out_variant:
        for name in out_argument_names(op_call):
            if not isinstance(kwargs.get(name), dtensor):
                raise _refuse(op_call, kwargs[name], "is an out= tensor")
    op_info.output_sharding = sharding
    local_results = attribute(
        dispatcher,
        "_dispatch_get_local_results_slow_path",
        "OpDispatcher._dispatch_get_local_results_slow_path",
    )(op_call, args, op_info)
    output_spec = sharding.output_spec
    if inplace:
        target = args[0]
        if output_spec is None:
            return None
        if isinstance(target, dtensor) and spec_of(target).placements != output_spec.placements:
            set_spec(target, output_spec)
        return target
    if out_variant:
        specs = output_spec if isinstance(output_spec, tuple) else (output_spec,)
        outs = [kwargs[name] for name in out_argument_names(op_call)]
        for out, spec in zip(outs, specs, strict=True):
            set_spec(out, spec)
        return tuple(outs) if len(outs) > 1 else outs[0]
    wrap = attribute(type(dispatcher), "wrap", "OpDispatcher.wrap")
    result = wrap(local_results, output_spec)
    if schema.is_view_op():
        correct = internal("torch.utils._python_dispatch", "return_and_correct_aliasing")
        return correct(op_call, args, kwargs, result)
    return result

"""Dispatch modes, the autograd node running a backward, and alias correction of in-place views.

A ``TorchDispatchMode`` sees every op call at the Python dispatch key, before DTensor's own
dispatch (the C++ fast path on 2.10+ included): ``verify()`` and ``scan()`` are built on one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dtensor_patches._torch.access import attribute, internal
from dtensor_patches._torch.dtensors import set_spec

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

__all__ = [
    "accumulating_grad",
    "current_autograd_node",
    "current_dispatch_mode",
    "dispatch_mode_class",
    "finish_inplace_view",
    "foreach_max",
    "foreach_mul_",
    "foreach_norm",
    "queue_backward_callback",
]


def dispatch_mode_class() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode``.

    Raises:
        PatchError: the class moved.
    """
    return internal("torch.utils._python_dispatch", "TorchDispatchMode")


def current_dispatch_mode() -> Any:
    """The dispatch mode on top of this thread's stack, or ``None``
    (``torch.utils._python_dispatch._get_current_dispatch_mode``).

    Raises:
        PatchError: the function moved.
    """
    return internal("torch.utils._python_dispatch", "_get_current_dispatch_mode")()


def current_autograd_node() -> Any:
    """The autograd node whose backward is running on this thread, or ``None`` outside
    backward (``torch._C._current_autograd_node``).

    Raises:
        PatchError: the function moved.
    """
    return attribute(torch._C, "_current_autograd_node", "torch._C._current_autograd_node")()


def accumulating_grad() -> bool:
    """Whether the autograd node running on this thread is an ``AccumulateGrad`` (writing a
    leaf's ``.grad``). Its first gradient it takes by ``detach`` when no other reference holds
    it and copies otherwise (``new_empty_strided`` + ``copy_``, or ``clone``): a reference
    count (``torch/csrc/autograd/functions/accumulate_grad.h``), so ranks may differ.

    Raises:
        PatchError: ``torch._C._current_autograd_node`` moved.
    """
    node = current_autograd_node()
    return node is not None and node.name() == "torch::autograd::AccumulateGrad"


def queue_backward_callback(callback: Any) -> None:
    """Run ``callback()`` once the backward pass running on this thread has finished (every
    node's outputs then carry their ``grad_fn``); call only inside backward
    (:func:`current_autograd_node` not ``None``). ``Variable._execution_engine.queue_callback``,
    as FSDP uses it.

    Raises:
        PatchError: the engine's ``queue_callback`` moved.
        RuntimeError: called outside a backward pass (torch's message).
    """
    engine = attribute(
        torch.autograd.Variable, "_execution_engine", "torch.autograd.Variable._execution_engine"
    )
    attribute(engine, "queue_callback", "Variable._execution_engine.queue_callback")(callback)


def finish_inplace_view(
    op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], target: DTensor, spec: DTensorSpec
) -> DTensor:
    """Give ``target`` (a DTensor an in-place view op such as ``squeeze_`` just changed, its
    local tensor already changed) the output ``spec`` and make its outer size and strides match
    (``torch.utils._python_dispatch.return_and_correct_aliasing``, which re-runs the op on the
    wrapper's metadata only). Returns ``target``.

    Raises:
        PatchError: ``DTensor._spec`` or ``return_and_correct_aliasing`` moved.
    """
    correct = internal("torch.utils._python_dispatch", "return_and_correct_aliasing")
    set_spec(target, spec)
    return correct(op, args, kwargs, target)


def foreach_mul_() -> Any:
    """``torch._foreach_mul_`` (scales a list of tensors in place, one kernel per device).

    Raises:
        PatchError: the function moved.
    """
    return attribute(torch, "_foreach_mul_", "torch._foreach_mul_")


def foreach_max() -> Any:
    """``torch._foreach_max`` (the maximum of each tensor of a list, 2.6+).

    Raises:
        PatchError: the function moved.
    """
    return attribute(torch, "_foreach_max", "torch._foreach_max")


def foreach_norm() -> Any:
    """``torch._foreach_norm`` (the per-tensor norms ``clip_grad_norm_`` takes).

    Raises:
        PatchError: the function moved.
    """
    return attribute(torch, "_foreach_norm", "torch._foreach_norm")


def subclass_torch_function_disabled() -> Any:
    """A context manager in which tensor subclasses' ``__torch_function__`` is not called
    (``torch._C.DisableTorchFunctionSubclass``): for a subclass's own ``__torch_function__`` to
    run the call underneath it.

    Raises:
        PatchError: the class moved.
    """
    return internal("torch._C", "DisableTorchFunctionSubclass")()

"""Inside ``loss_parallel()``, every use of ``log_softmax`` but the loss itself gets a wrong
gradient: the entropy bonus, label smoothing, a KL term (pytorch/pytorch#190746).

``loss_parallel()`` installs handlers that keep the logits sharded on the class dim. Its
``nll_loss`` backward returns the gradient with respect to the *logits* (``softmax - onehot``,
the log-softmax backward folded in), so its ``_log_softmax_backward_data`` handler passes its
incoming gradient through unchanged. Any other term that reads the log-probabilities (an
entropy bonus ``-(p * logp).sum(-1)``, label smoothing's ``-logp.mean(-1)``) then has its
gradient passed through as if it were already with respect to the logits: silently wrong.
Measured on 2 ranks: wrong on every release 2.9.1 to 2.15.0 (see the gate).

Fix (replacing two entries of ``loss_parallel()``'s own handler table, so only calls inside
the block change): the ``nll_loss`` backward returns the gradient with respect to the
log-probabilities (torch's handler with the softmax term removed: ``exp(-inf) = 0``), and the
``log_softmax`` backward computes ``g - softmax * g.sum(class)``: one all-reduce of a
``[batch, 1]`` tensor, the class dim stays sharded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.dtensors import local_tensor, make_dtensor, spec_of
from dtensor_patches.patch import LossParallelHandler, Patch
from dtensor_patches.patches._along_shards import (
    sharded_along,
    softmax_backward_on_shards,
)
from dtensor_patches.reproducers import compare, failure_of, randn

_LOG_SOFTMAX_BACKWARD = "aten._log_softmax_backward_data.default"
_NLL_BACKWARD = ("aten.nll_loss_backward.default", "aten.nll_loss2d_backward.default")
OPS = (_LOG_SOFTMAX_BACKWARD, *_NLL_BACKWARD)


def _nll_backward(torch_handler: Callable[..., Any]) -> Callable[..., Any]:
    def handler(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        log_probs = args[1]
        # torch's handler returns (onehot_neg + exp(log_probs)) * g; with exp() = 0 it is the
        # gradient with respect to the log-probabilities, -onehot * g.
        no_softmax = make_dtensor(
            torch.full_like(local_tensor(log_probs), float("-inf")), spec_of(log_probs)
        )
        return torch_handler(op_call, (args[0], no_softmax, *args[2:]), kwargs)

    return handler


def _log_softmax_backward(torch_handler: Callable[..., Any]) -> Callable[..., Any]:
    def handler(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        grad_output, output = args[0], args[1]
        dim, input_dtype = args[2], args[3]
        if sharded_along(output, dim):
            # On the shard, whatever layout the gradient arrives in (a replicated one is cut
            # locally): one all-reduce of [..., 1].
            return softmax_backward_on_shards(op_call, args, kwargs)
        total = grad_output.sum(dim, keepdim=True)
        return (grad_output - output.exp() * total).to(input_dtype)

    return handler


def _registrations() -> list[LossParallelHandler]:
    return [
        LossParallelHandler(_LOG_SOFTMAX_BACKWARD, _log_softmax_backward),
        *(LossParallelHandler(op, _nll_backward) for op in _NLL_BACKWARD),
    ]


def _entropy_bonus(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits, -1)
    entropy = -(logp.exp() * logp).sum(-1).mean()
    return F.cross_entropy(logits, target) - 0.1 * entropy


def _label_smoothing(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # What cross_entropy(label_smoothing=0.2) computes; written out because torch's own
    # decomposition writes in place into a Partial (masked_fill_), which needs the
    # inplace_writes patch (tested with apply_all() in tests/test_verify.py).
    logp = torch.log_softmax(logits, -1)
    return 0.8 * F.nll_loss(logp, target) - 0.2 * logp.mean(-1).mean()


def _plain_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, target, reduction="sum")


def _case(mesh: Any, loss: Callable[..., torch.Tensor], label: str) -> str | None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    logits = randn(4, 8)  # 8 classes: no rank without one on 2 or 4 ranks
    target = torch.tensor([0, 5, 2, 3])
    plain = logits.clone().requires_grad_()
    loss(plain, target).backward()
    dist_logits = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_()
    dist_target = distribute_tensor(target, mesh, [Replicate()])

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        with loss_parallel():
            value = loss(dist_logits, dist_target)
            value.backward()
        return value.full_tensor(), dist_logits.grad.full_tensor()

    got, error = failure_of(run)
    if error is not None:
        return f"{label}: {error}"
    return compare(got[0], loss(plain, target).detach(), what=f"{label} loss") or compare(
        got[1], plain.grad, what=f"{label} grad"
    )


def reproduce(mesh: object) -> str | None:
    """Entropy bonus, label smoothing and plain cross entropy inside ``loss_parallel()``,
    logits ``Shard(1)`` (class dim): losses and logit gradients vs single-device."""
    for loss, label in (
        (_entropy_bonus, "cross_entropy - 0.1 * entropy in loss_parallel()"),
        (_label_smoothing, "label smoothing 0.2 in loss_parallel()"),
        (_plain_cross_entropy, "cross_entropy(sum) in loss_parallel()"),
    ):
        problem = _case(mesh, loss, label)
        if problem is not None:
            return problem
    return None


PATCH = Patch(
    name="loss_parallel_backward",
    summary="loss_parallel(): log_softmax backward is right for terms other than the loss (entropy, label smoothing)",
    ops=OPS,
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    reproduce=reproduce,
    upstream_issue="https://github.com/pytorch/pytorch/issues/190746",
    overrides_existing=True,
    communication="one all-reduce of a `[batch, 1]` tensor; class dim stays sharded",
)

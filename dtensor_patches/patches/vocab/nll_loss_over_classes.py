"""``nll_loss`` / ``cross_entropy`` of class-sharded (vocab-parallel) log-probs gathers the whole
``[N, C]`` input, forward and backward, on every release 2.9 to 2.15.

Trigger: ``F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)`` with TP
vocab-sharded ``Shard(-1)`` logits outside ``loss_parallel()`` (``reduction="none"`` per-token
losses, ``label_smoothing``, class weights). torch's strategy replicates the class dim
(2.14+; the ``nll_loss`` patch's handler did the same below 2.14). The values are right; the
cost is an all-gather of ``[tokens, vocab]`` each way.

Fix (a miss rule on the four ``nll_loss`` ops, taken only when the class dim is sharded; below
2.14 the ``nll_loss`` patch's handler does the same): each rank picks the targets in its class
block (the others are ignored locally) and the per-rank results are summed
(``Partial(sum)``), ``mean`` divided by the global total weight (one scalar all-reduce); the
backward is computed on the shard with no communication. The softmax itself stays sharded by
``softmax_over_shards``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from packaging.specifiers import SpecifierSet

from dtensor_patches.dispatch.miss_rules import DivertedCall, NativeDecision
from dtensor_patches.patch import MissRule, Patch
from dtensor_patches.patches.losses._global_mean import class_sharded, nll_loss
from dtensor_patches.patches.vocab._reproduce import moves_no_full_tensor

_FORWARD = ("aten.nll_loss_forward.default", "aten.nll_loss2d_forward.default")
_BACKWARD = ("aten.nll_loss_backward.default", "aten.nll_loss2d_backward.default")
OPS = (*_FORWARD, *_BACKWARD)


def _forward_rule(schema: Any, native: NativeDecision) -> DivertedCall | None:
    return nll_loss if class_sharded(schema, backward=False) else None


def _backward_rule(schema: Any, native: NativeDecision) -> DivertedCall | None:
    return nll_loss if class_sharded(schema, backward=True) else None


def _registrations() -> list[MissRule]:
    return [MissRule(op, _forward_rule) for op in _FORWARD] + [
        MissRule(op, _backward_rule) for op in _BACKWARD
    ]


def _labels_and_weights() -> list[torch.Tensor]:
    """Labels of 8 tokens over a vocabulary of 11 (-100, ignored, on one) and class weights."""
    return [torch.tensor([0, 10, 5, -100, 6, 2, 7, 3]), torch.linspace(0.5, 1.5, 11)]


def _loss_and_grad(*, weighted: bool = False, **options: Any) -> Any:
    def run(logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor) -> Any:
        x = logits.detach().requires_grad_()
        loss = F.cross_entropy(x, labels, weight=weight if weighted else None, **options)
        (grad,) = torch.autograd.grad((loss * loss.detach()).sum(), [x])
        return loss.detach(), grad

    return run


def reproduce(mesh: Any) -> str | None:
    """``cross_entropy`` of ``Shard(-1)`` logits ``[8, 11]`` with an ignored label, ``mean``,
    ``none`` and ``sum`` with class weights (label smoothing is tested with ``apply_all()``: its
    decomposition writes in place into a ``Partial``), values and gradients: single-device results and no
    collective as large as a shard of the logits."""
    return moves_no_full_tensor(
        mesh,
        [
            ("cross_entropy(mean) of Shard(-1) logits + grad", _loss_and_grad()),
            ("cross_entropy(none) of Shard(-1) logits + grad", _loss_and_grad(reduction="none")),
            (
                "cross_entropy(sum, weight) of Shard(-1) logits + grad",
                _loss_and_grad(reduction="sum", weighted=True),
            ),
        ],
        shape=(8, 11),
        extra=_labels_and_weights,
    )


PATCH = Patch(
    name="nll_loss_over_classes",
    summary="nll_loss/cross_entropy of vocab-sharded log-probs without gathering the class dim",
    ops=OPS,
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    reproduce=reproduce,
    requires=("softmax_over_shards",),
    overrides_existing=True,
    upstream_fix="none in any release up to 2.15.0 (measured: the class dim is replicated)",
    communication="one scalar all-reduce for `mean`; the per-token results are `Partial(sum)`",
)

"""Which ``dtensor_patches`` patches the critic's own path needs, and what to do when
``apply_all()`` could not apply some.

:data:`CRITIC_PATCHES` is recorded by a script, ``python -m tools.critic_patch_needs``: on 4 CPU
ranks a ``TorchDispatchMode`` records every aten op that receives a DTensor while a
:class:`~ppo_value.worker.ValueWorker` runs ``get_values``, two ``train`` steps (AdamW,
clipping), ``save_checkpoint``, ``load_checkpoint`` and ``full_state_dict`` on every layout the
critic has (TP + SP, TP without SP, dp only, mixed precision, packing, activation
checkpointing with token budgets, context parallelism with and without TP), and keeps each
registered patch whose ``ops`` include one of them. CI re-records it
(``tests/ppo_value/test_patch_needs.py``) and fails when this set is stale. Recorded on torch
2.13.0 (issue 22):

- ``inplace_writes``: ``add_``, ``mul_``, ``addcmul_``, ``addcdiv_``, ``lerp_`` (AdamW,
  gradient accumulation), ``copy_`` (loading state dicts);
- ``full_state_dict``: ``copy_`` of full tensors into sharded parameters (checkpoint loading);
- ``float_keywords_unkeyed``: ``addcdiv_`` / ``add_`` with a float keyword that changes every
  step (AdamW's ``value=``; gated to 2.10 and 2.11, where torch re-propagates them);
- ``partial_add_scalar``: ``add.Tensor`` (residual stream, value head bias);
- ``partial_int_cast``: ``_to_copy`` (``.float()`` of hidden states, dtype casts);
- ``partial_item``: ``_local_scalar_dense`` (``.item()`` of the grad norm);
- ``mean_uneven``: ``mean.dim`` (RMSNorm);
- ``mask_partial_reduced_first`` and ``tp_tied_weights``: ``embedding`` /
  ``embedding_dense_backward`` (the vocab-sharded embedding under TP);
- ``t_of_vector``: ``t`` (the linear layers' weights);
- ``wrong_cells_other`` and ``wrong_cells_scans`` (issue 19): ``addmm`` and ``add.Tensor``
  are among the ops of their routed cells (the record is by op, not by cell: only calls of
  those exact cells are diverted, and the critic's results equal the single device's).

The grad norm no longer stacks per-tensor norms (``dtensor_patches.grad_norm``), so
``stack_dim`` left the set.
"""

from __future__ import annotations

import logging

from dtensor_patches.report import Report, Status

__all__ = ["CRITIC_PATCHES", "PatchRequirementError", "check_patch_report"]

log = logging.getLogger(__name__)

#: Patches whose ops the critic runs on DTensors (see the module docstring for how found).
CRITIC_PATCHES: frozenset[str] = frozenset(
    {
        "embedding_over_nested_shards",
        "empty_dims_reduce_all",
        "float_keywords_unkeyed",
        "full_state_dict",
        "inplace_writes",
        "mask_partial_reduced_first",
        "mean_uneven",
        "partial_add_scalar",
        "partial_divisor",
        "partial_int_cast",
        "partial_item",
        "t_of_vector",
        "tp_tied_weights",
        "wrong_cells_other",
        "wrong_cells_scans",
    }
)

# Failed patches already reported in this process: the warning is given once, not per worker.
_told: set[str] = set()


class PatchRequirementError(RuntimeError):
    """``dtensor_patches.apply_all()`` failed to apply a patch the critic's path needs."""


def check_patch_report(
    report: Report, *, needed: frozenset[str] = CRITIC_PATCHES, warn: bool = True
) -> None:
    """Raise if a patch the critic needs failed; warn once about other failed patches.

    Args:
        report: what ``dtensor_patches.apply_all()`` returned.
        needed: the names the critic needs (default :data:`CRITIC_PATCHES`).
        warn: log the warning about the other failures (e.g. only on rank 0).

    Raises:
        PatchRequirementError: naming each needed patch whose outcome is ``failed`` and why.
            Their ops would run with torch's own behaviour, which on this release is missing
            or wrong for what the critic does.
    """
    failed = [o for o in report if o.status is Status.FAILED]
    blocking = [o for o in failed if o.name in needed]
    if blocking:
        detail = "; ".join(f"{o.name}: {o.reason or 'no reason given'}" for o in blocking)
        raise PatchRequirementError(
            f"dtensor_patches could not apply {len(blocking)} patch(es) the value worker needs "
            f"on torch {report.torch_version}: {detail}. See `dtensor-patches doctor`."
        )
    others = [o for o in failed if o.name not in _told]
    if others and warn:
        names = ", ".join(o.name for o in others)
        log.warning(
            "dtensor_patches could not apply %d patch(es) on torch %s: %s. The value worker "
            "does not use their ops and runs normally; other DTensor code in this process gets "
            "torch's own behaviour for them. Reasons: %s",
            len(others),
            report.torch_version,
            names,
            "; ".join(f"{o.name}: {o.reason or 'no reason given'}" for o in others),
        )
        _told.update(o.name for o in others)

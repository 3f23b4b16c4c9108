"""Which ``dtensor_patches`` patches the critic's own path needs, and what to do when
``apply_all()`` could not apply some.

:data:`CRITIC_PATCHES` was found by recording every aten op that received a DTensor (a
``TorchDispatchMode`` around the calls) while a :class:`~ppo_value.worker.ValueWorker` ran
``get_values``, two ``train`` steps (AdamW, clipping), ``save_checkpoint``,
``load_checkpoint`` and ``full_state_dict`` on dp=2 x tp=2 + SP, dp=2 x tp=2 without SP,
dp=4, and dp=2 x tp=2 with mixed precision, on torch 2.9.1 and 2.13.0 (same op set on both),
and keeping each registered patch whose ``ops`` include one of them:

- ``inplace_writes``: ``add_``, ``mul_``, ``addcmul_``, ``addcdiv_``, ``lerp_`` (AdamW,
  gradient accumulation), ``copy_`` (loading state dicts);
- ``partial_add_scalar``: ``add.Tensor`` (residual stream, value head bias);
- ``partial_int_cast``: ``_to_copy`` (``.float()`` of hidden states, dtype casts);
- ``mean_uneven``: ``mean.dim`` (RMSNorm);
- ``stack_dim``: ``stack`` (``clip_grad_norm_``'s total norm).

Re-run that recording when the model families, the parallel plan or the optimizer change.
"""

from __future__ import annotations

import logging

from dtensor_patches.report import Report, Status

__all__ = ["CRITIC_PATCHES", "PatchRequirementError", "check_patch_report"]

log = logging.getLogger(__name__)

#: Patches whose ops the critic runs on DTensors (see the module docstring for how found).
CRITIC_PATCHES: frozenset[str] = frozenset(
    {"inplace_writes", "mean_uneven", "partial_add_scalar", "partial_int_cast", "stack_dim"}
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

"""``dtensor-patches doctor``: the installation, what ``apply_all()`` would do, the tripwires,
a summary of what to do."""

from __future__ import annotations

import argparse
import json
import os
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dtensor_patches import _text

if TYPE_CHECKING:
    from dtensor_patches.tripwire import TripwireResult

from dtensor_patches.cli._check import (
    print_failures,
    print_quiet_warnings,
    run_tripwires_table,
    start_pool,
)
from dtensor_patches.cli._output import details, load_torch, out

__all__ = ["cmd_doctor"]


def _environment() -> dict[str, object]:
    import platform

    import torch
    import torch.distributed as dist

    from dtensor_patches import __version__, registry
    from dtensor_patches._torch.versions import torch_release

    backends = {
        name: bool(getattr(dist, f"is_{name}_available", lambda: False)())
        for name in ("gloo", "nccl", "mpi", "ucc", "xccl")
    }
    return {
        "dtensor_patches": __version__,
        "python": platform.python_version(),
        "torch_version": torch.__version__,
        "torch_release": str(torch_release()),
        "torch_git": getattr(torch.version, "git_version", None),
        "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "distributed_available": dist.is_available(),
        "backends": backends,
        "disable_env": {registry.DISABLE_ENV: os.environ.get(registry.DISABLE_ENV, "")},
    }


def _plan_reason(outcome: Any) -> str:
    from dtensor_patches import registry
    from dtensor_patches._torch.versions import torch_release
    from dtensor_patches.report import Status

    if outcome.status is Status.GATED_OUT:
        gate = _text.format_gate(registry.get(outcome.name).gate)
        return f"gate {gate} excludes {torch_release()}"
    return str(outcome.reason)


def _summary(plan: Any, results: Sequence[TripwireResult], checked: bool) -> list[str]:
    """doctor's closing lines: what applies, what is stale or broken, what to do."""
    from dtensor_patches.report import Status
    from dtensor_patches.tripwire import Verdict

    release = str(plan.torch_version).split("+")[0]
    applies = plan.names(Status.WOULD_APPLY) + plan.names(Status.ALREADY_APPLIED)
    failed = plan.names(Status.FAILED)
    off = plan.names(Status.DISABLED) + plan.names(Status.EXCLUDED)
    facts = [f"{len(applies)} of {len(plan)} patches apply to torch {release}"]
    if off:
        facts.append(f"{len(off)} switched off")
    if failed:
        facts.append(f"{len(failed)} fail to apply ({', '.join(failed)})")
    by = {v: [r.patch for r in results if r.verdict is v] for v in Verdict}
    if checked:
        tw = [f"{len(by[Verdict.OK])} ok"]
        tw += [
            f"{len(by[v])} {v.value} ({', '.join(by[v])})"
            for v in Verdict
            if v is not Verdict.OK and by[v]
        ]
        facts.append("tripwires: " + ", ".join(tw))
    todo = []
    if failed:
        todo.append(
            f"{', '.join(failed)} cannot be applied here (a torch internal moved, see the reason "
            "above): pin a torch release the patches support and report it"
        )
    if by[Verdict.GATE_TOO_NARROW]:
        todo.append(
            f"this torch still has the bug of {', '.join(by[Verdict.GATE_TOO_NARROW])} but the "
            "gate skips the patch: expect that bug, and report the gate"
        )
    if by[Verdict.INEFFECTIVE]:
        names = ",".join(by[Verdict.INEFFECTIVE])
        todo.append(
            f"the patch does not fix the bug here: set DTENSOR_PATCHES_DISABLE={names} "
            "and report it"
        )
    if by[Verdict.STALE]:
        todo.append(
            f"torch {release} fixed {', '.join(by[Verdict.STALE])}: no longer needed here "
            "(the reproducer is right with or without the patch), so its gate should end "
            "before this release: report it"
        )
    if not todo:
        todo.append(
            "nothing to fix: call dtensor_patches.apply_all() before building the model"
            if checked
            else "run `dtensor-patches check` for the tripwires; "
            "call dtensor_patches.apply_all() before building the model"
        )
    lines = []
    for text in ["summary: " + "; ".join(facts) + ".", *("to do: " + item for item in todo)]:
        lines += textwrap.wrap(text, width=_text.WIDTH, subsequent_indent="  ")
    return lines


def _survives_loss_parallel() -> str:
    """Apply every patch, enter and leave ``loss_parallel()`` (no mesh needed: it only swaps
    handlers), and say whether torch's tables still hold every patch's entries."""
    from torch.distributed.tensor.parallel import loss_parallel

    from dtensor_patches import registry
    from dtensor_patches.registry_health import health

    with registry.patched():
        with loss_parallel():
            pass
        after = health()
    if after.intact:
        return f"patches survive loss_parallel(): yes ({len(after.patches)} applied, all in effect)"
    return f"patches survive loss_parallel(): NO, lost: {', '.join(after.lost)}"


def cmd_doctor(args: argparse.Namespace) -> int:
    from dtensor_patches import registry
    from dtensor_patches.report import Status

    pool = None if args.no_check else start_pool(args)
    try:
        load_torch(args)
        env = _environment()
        plan = registry.plan()
        env["loss_parallel"] = _survives_loss_parallel()
        plan_failed = bool(plan.names(Status.FAILED))
        if args.json:
            results = [] if pool is None else run_tripwires_table(args, pool, stream=False)
            print(
                json.dumps(
                    {
                        "environment": env,
                        "apply_all_would": plan.to_dict()["patches"],
                        "tripwires": [r.to_dict() for r in results],
                    },
                    indent=2,
                )
            )
            return 1 if plan_failed or any(not r.passed for r in results) else 0
        out(f"dtensor-patches {env['dtensor_patches']} on Python {env['python']}")
        build = f"CUDA {env['cuda_build']}" if env["cuda_build"] else "CPU-only build"
        out(f"torch {env['torch_version']} (release {env['torch_release']}, {build})")
        if args.verbose:
            details("torch git", env["torch_git"])
        out(f"CUDA available: {env['cuda_available']}")
        backends = env["backends"]
        assert isinstance(backends, dict)
        out(
            "distributed backends: "
            + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in backends.items())
        )
        out(str(env["loss_parallel"]))
        out()
        out("apply_all() would:")
        cells = [[o.name, o.status.value, _plan_reason(o)] for o in plan]
        head, widths = _text.table(["patch", "action", "reason"], cells, flexible=2)
        for line in head:
            out(line)
        for cell in cells:
            out(_text.row_line(cell, widths))
            if args.verbose and len(cell[2]) > widths[2]:
                details("reason", cell[2])
        results = []
        if pool is not None:
            out()
            results = run_tripwires_table(args, pool, stream=True)
            print_failures(results)
    finally:
        if pool is not None:
            pool.close()
    print_quiet_warnings(args, pool)
    out()
    for line in _summary(plan, results, checked=pool is not None):
        out(line)
    return 1 if plan_failed or any(not r.passed for r in results) else 0

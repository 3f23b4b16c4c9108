"""``dtensor-patches`` / ``python -m dtensor_patches``: list, check, doctor."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from dtensor_patches import registry
from dtensor_patches.tripwire import TripwireResult, run_tripwires

__all__ = ["main"]


def _patch_rows() -> list[dict[str, object]]:
    rows = []
    for patch in registry.all_patches():
        rows.append(
            {
                "name": patch.name,
                "summary": patch.summary,
                "ops": list(patch.ops),
                "gate": str(patch.gate),
                "applies_to_this_torch": patch.applies_to(),
                "replicates": patch.replicates,
                "upstream_issue": patch.upstream_issue,
                "upstream_fix": patch.upstream_fix,
            }
        )
    return rows


def _print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


def _cmd_list(args: argparse.Namespace) -> int:
    rows = _patch_rows()
    if args.json:
        from dtensor_patches.tripwire import run_fallback_alone

        # Whether the fallback alone (no patch) makes each reproducer correct (issue 10):
        # runs every reproducer on 2 ranks, so only on request.
        alone = run_fallback_alone() if args.fallback_alone else {}
        for row in rows if args.fallback_alone else ():
            row["fallback_alone"] = {
                "correct": alone[row["name"]] is None,
                "result": alone[row["name"]],
            }  # type: ignore[index]
        print(json.dumps({"torch_version": _torch_version(), "patches": rows}, indent=2))
        return 0
    print(f"torch {_torch_version()}")
    _print_table(
        ["patch", "gate", "this torch", "ops", "upstream"],
        [
            [
                r["name"],
                f"torch{r['gate']}",
                "needed" if r["applies_to_this_torch"] else "gated out",
                ", ".join(r["ops"]),  # type: ignore[arg-type]
                r["upstream_fix"] or r["upstream_issue"] or "-",
            ]
            for r in rows
        ],
    )
    return 0


def parse_gate_overrides(pairs: Sequence[str] | None) -> dict[str, str]:
    """``["alias=>=2.9,<2.11"]`` -> ``{"alias": ">=2.9,<2.11"}``.

    Raises:
        ValueError: an item without ``=`` or with an invalid specifier.
    """
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    overrides: dict[str, str] = {}
    for pair in pairs or ():
        name, sep, spec = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"--gate takes NAME=SPECIFIER, got {pair!r}")
        try:
            SpecifierSet(spec)
        except InvalidSpecifier as exc:
            raise ValueError(f"--gate {pair!r}: invalid version specifier {spec!r}") from exc
        overrides[name] = spec
    return overrides


def _tripwires(args: argparse.Namespace) -> list[TripwireResult]:
    return run_tripwires(
        args.only or None,
        world_size=args.world_size,
        gate_overrides=parse_gate_overrides(args.gate),
    )


def _print_tripwires(results: Sequence[TripwireResult]) -> None:
    _print_table(
        ["patch", "gate", "bug on stock torch", "with patch", "verdict"],
        [
            [
                r.patch,
                f"torch{r.gate}",
                r.bug or "none (correct)",
                ("fixed" if r.after_patch is None else r.after_patch) if r.in_gate else "-",
                r.verdict.value,
            ]
            for r in results
        ],
    )
    for r in results:
        if not r.passed:
            print(f"FAIL {r.message}")


def _cmd_check(args: argparse.Namespace) -> int:
    results = _tripwires(args)
    failed = any(not r.passed for r in results)
    if args.json:
        print(
            json.dumps(
                {"torch_version": _torch_version(), "tripwires": [r.to_dict() for r in results]},
                indent=2,
            )
        )
    else:
        print(f"torch {_torch_version()}: tripwires on a {args.world_size}-rank CPU gloo mesh")
        _print_tripwires(results)
        print(
            f"{sum(r.passed for r in results)} passed, {sum(not r.passed for r in results)} failed"
        )
    return 1 if failed else 0


def _torch_version() -> str:
    import torch

    return torch.__version__


def _environment() -> dict[str, object]:
    import platform

    import torch
    import torch.distributed as dist

    from dtensor_patches import __version__, compat

    backends = {
        name: bool(getattr(dist, f"is_{name}_available", lambda: False)())
        for name in ("gloo", "nccl", "mpi", "ucc", "xccl")
    }
    return {
        "dtensor_patches": __version__,
        "python": platform.python_version(),
        "torch_version": torch.__version__,
        "torch_release": str(compat.torch_release()),
        "torch_git": getattr(torch.version, "git_version", None),
        "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "distributed_available": dist.is_available(),
        "backends": backends,
        "disable_env": {registry.DISABLE_ENV: os.environ.get(registry.DISABLE_ENV, "")},
    }


def _cmd_doctor(args: argparse.Namespace) -> int:
    env = _environment()
    plan = registry.plan()
    results = [] if args.no_check else _tripwires(args)
    failed = any(not r.passed for r in results)
    if args.json:
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
        return 1 if failed else 0
    print(f"dtensor-patches {env['dtensor_patches']} on Python {env['python']}")
    build = f"CUDA {env['cuda_build']}" if env["cuda_build"] else "CPU-only build"
    print(
        f"torch {env['torch_version']} (release {env['torch_release']}, {build}, git {env['torch_git']})"
    )
    print(f"CUDA available: {env['cuda_available']}")
    backends = env["backends"]
    assert isinstance(backends, dict)
    print(
        "distributed backends: "
        + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in backends.items())
    )
    print()
    print("apply_all() would:")
    _print_table(["patch", "action", "reason"], [[o.name, o.status.value, o.reason] for o in plan])
    if results:
        print()
        print(f"tripwires ({args.world_size}-rank CPU gloo mesh, stock torch vs each patch):")
        _print_tripwires(results)
    return 1 if failed else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dtensor-patches", description="Version-gated fixes for PyTorch DTensor gaps."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="patches, gates, upstream links, status on this torch")
    p_list.add_argument("--json", action="store_true", help="machine-readable output")
    p_list.add_argument(
        "--fallback-alone",
        action="store_true",
        help="with --json: run each reproducer with only the fallback on (2 ranks) and say per "
        "patch whether that alone is correct",
    )
    p_list.set_defaults(func=_cmd_list)
    for name, func, helptext in (
        (
            "check",
            _cmd_check,
            "run the tripwires; exit 1 on a stale, too-narrow or ineffective patch",
        ),
        ("doctor", _cmd_doctor, "torch build, backends, what apply_all() would do, tripwires"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument(
            "--world-size", type=int, default=2, help="ranks in the CPU gloo mesh (default 2)"
        )
        p.add_argument("--only", nargs="*", metavar="PATCH", help="check only these patches")
        p.add_argument(
            "--gate",
            action="append",
            metavar="NAME=SPEC",
            help="check a proposed gate instead of the registered one, e.g. 'alias=>=2.9,<2.11'",
        )
        if name == "doctor":
            p.add_argument("--no-check", action="store_true", help="skip the tripwires")
        p.set_defaults(func=func)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (0 ok, 1 a tripwire failed, 2 bad usage)."""
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (KeyError, ValueError) as exc:
        print(f"dtensor-patches: {exc.args[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""``dtensor-patches`` / ``python -m dtensor_patches``: list, check, doctor.

Every line of the plain output fits 100 columns (verdict first, long op lists and messages
shortened); ``-v`` adds the details on indented lines, ``--json`` has all of them. torch is
imported only by the commands that need it, so ``--help`` answers at once; ``check`` and
``doctor`` start the tripwire ranks before importing it, so the two overlap.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import textwrap
import time
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dtensor_patches import _text

if TYPE_CHECKING:
    from dtensor_patches.testing import RankPool
    from dtensor_patches.tripwire import TripwireResult

__all__ = ["main", "parse_gate_overrides"]


def _load_torch(args: argparse.Namespace) -> None:
    """Import torch and the registry; their import-time warnings (a missing NumPy) are kept
    for ``-v`` instead of being printed."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import torch  # noqa: F401

        from dtensor_patches import registry

        registry.all_patches()
    args.import_warnings = [f"{w.category.__name__}: {w.message}" for w in caught]


def _torch_version() -> str:
    import torch

    return torch.__version__


def _patch_rows() -> list[dict[str, object]]:
    from dtensor_patches import registry

    rows = []
    for patch in registry.all_patches():
        rows.append(
            {
                "name": patch.name,
                "summary": patch.summary,
                "ops": list(patch.ops),
                "gate": _text.format_gate(patch.gate),
                "applies_to_this_torch": patch.applies_to(),
                "replicates": patch.replicates,
                "upstream_issue": patch.upstream_issue,
                "upstream_fix": patch.upstream_fix,
            }
        )
    return rows


def _print(line: str = "") -> None:
    print(line, flush=True)


def _details(label: str, text: object) -> None:
    for line in _text.wrap(f"{label}: {text}", indent="    "):
        _print(line)


def _fallback_alone_rows(args: argparse.Namespace, rows: list[dict[str, object]]) -> None:
    """Add ``fallback_alone`` (``fixed``/``still wrong``/``not needed``) and ``after_fallback``
    to each row: every reproducer that fails on stock torch, rerun with only the fallback on."""
    from dtensor_patches.tripwire import run_tripwires, start_pool

    pool = start_pool(args.world_size)
    try:
        results = run_tripwires([str(r["name"]) for r in rows], pool=pool, fallback_alone=True)
    finally:
        pool.close()
    for row, result in zip(rows, results, strict=True):
        row["fallback_alone"] = result.fallback_alone.value
        row["after_fallback"] = result.after_fallback


def _cmd_list(args: argparse.Namespace) -> int:
    _load_torch(args)
    rows = _patch_rows()
    if args.fallback_alone:
        _fallback_alone_rows(args, rows)
    if args.json:
        print(json.dumps({"torch_version": _torch_version(), "patches": rows}, indent=2))
        return 0
    applies = sum(bool(r["applies_to_this_torch"]) for r in rows)
    _print(f"torch {_torch_version()}: {len(rows)} patches, {applies} apply to this release")
    cells = [
        [
            r["name"],
            r["gate"],
            "applies" if r["applies_to_this_torch"] else "gated out",
            ", ".join(_text.short_op(op) for op in r["ops"]),  # type: ignore[attr-defined]
        ]
        for r in rows
    ]
    headers = ["patch", "gate", "this torch", "ops"]
    if args.fallback_alone:
        # Whether the fallback alone gives the single-device result on this torch: where it
        # does, the patch adds only speed (benchmarks/fallback_costs.py measures how much).
        headers.insert(3, "fallback alone")
        for r, cell in zip(rows, cells, strict=True):
            cell.insert(3, str(r["fallback_alone"]))
    flexible = len(headers) - 1
    head, widths = _text.table(headers, cells, flexible=flexible)
    for line in head:
        _print(line)
    for r, cell in zip(rows, cells, strict=True):
        ops = _text.short_ops(r["ops"], widths[flexible])  # type: ignore[arg-type]
        _print(_text.row_line([*cell[:flexible], ops], widths))
        if args.verbose and r.get("after_fallback"):
            _details("with the fallback alone", r["after_fallback"])
        if args.verbose:
            _details("what", r["summary"])
            _details("ops", ", ".join(r["ops"]))  # type: ignore[arg-type]
            if r["upstream_issue"]:
                _details("upstream issue", r["upstream_issue"])
            if r["upstream_fix"]:
                _details("upstream fix", r["upstream_fix"])
    if not args.verbose:
        _print("(-v: every op, upstream issue and fix; --json: all of it)")
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


class _TripwireTable:
    """Prints tripwire results as they arrive, in columns fixed up front."""

    HEADERS = ("verdict", "patch", "gate", "with patch", "stock torch")

    def __init__(self, names: Sequence[str], gates: Sequence[str], verbose: bool) -> None:
        from dtensor_patches.tripwire import Verdict, WithPatch

        sample = [
            [
                max((v.value for v in Verdict), key=len),
                n,
                g,
                max((w.value for w in WithPatch), key=len),
                "",
            ]
            for n, g in zip(names, gates, strict=True)
        ]
        self.head, self.widths = _text.table(self.HEADERS, sample, flexible=4)
        # The stock column takes every remaining column, so rows printed later fit too.
        self.widths[4] = _text.WIDTH - sum(self.widths[:4]) - 2 * 4
        self.head = [
            _text.row_line(self.HEADERS, self.widths),
            "  ".join("-" * w for w in self.widths),
        ]
        self.verbose = verbose

    def start(self) -> None:
        for line in self.head:
            _print(line)

    def add(self, r: TripwireResult) -> None:
        # One rank's words are enough in the table; -v and --json say which rank.
        stock = "correct" if r.bug is None else "bug: " + re.sub(r"^\[rank \d+\] ", "", r.bug)
        _print(
            _text.row_line(
                [r.verdict.value, r.patch, _text.format_gate(r.gate), r.with_patch.value, stock],
                self.widths,
            )
        )
        if self.verbose:
            if r.bug is not None:
                _details("stock torch", r.bug)
            if r.after_patch is not None:
                _details("with patch", r.after_patch)
            if r.fallback_alone.value != "not run":
                _details("fallback alone", r.after_fallback or r.fallback_alone.value)
            for line in r.warnings:
                _details("warning", line)
            _print(f"    {r.seconds:.1f} s")


def _start_pool(args: argparse.Namespace) -> RankPool:
    from dtensor_patches.tripwire import start_pool

    return start_pool(args.world_size)


def _run_tripwires(
    args: argparse.Namespace, pool: RankPool, *, stream: bool
) -> list[TripwireResult]:
    """Validate the selection, then run it on ``pool``; with ``stream``, print each row as it
    comes. Raises ``KeyError``/``ValueError`` on unknown names or bad gates (exit 2)."""
    from dtensor_patches import registry
    from dtensor_patches.tripwire import run_tripwires

    overrides = parse_gate_overrides(args.gate)
    names = list(args.only) if args.only else [p.name for p in registry.all_patches()]
    gates = []
    for name in names:
        gate = overrides.get(name)
        gates.append(_text.format_gate(gate if gate is not None else registry.get(name).gate))
    for name in overrides:
        registry.get(name)
    table = _TripwireTable(names, gates, args.verbose) if stream else None
    if table is not None:
        _print(
            f"torch {_torch_version()}: {len(names)} tripwire(s) on a {args.world_size}-rank "
            "CPU gloo mesh"
        )
        table.start()
    return run_tripwires(
        names,
        gate_overrides=overrides,
        pool=pool,
        on_result=table.add if table is not None else None,
        fallback_alone=getattr(args, "fallback_alone", False),
    )


def _print_failures(results: Sequence[TripwireResult]) -> None:
    for r in results:
        if not r.passed:
            for n, line in enumerate(_text.wrap(r.message, indent="  ")):
                _print(("FAIL" + line[4:]) if n == 0 else line)


def _print_quiet_warnings(args: argparse.Namespace, pool: RankPool | None) -> None:
    notes = list(getattr(args, "import_warnings", []))
    if pool is not None:
        notes += [n for n in pool.startup_warnings if n not in notes]
    if args.verbose and notes:
        _print("warnings while importing torch (parent and ranks):")
        for note in notes:
            _details("warning", note)


def _cmd_check(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    pool = _start_pool(args)
    try:
        _load_torch(args)
        results = _run_tripwires(args, pool, stream=not args.json)
    finally:
        pool.close()
    failed = sum(not r.passed for r in results)
    if args.json:
        print(
            json.dumps(
                {"torch_version": _torch_version(), "tripwires": [r.to_dict() for r in results]},
                indent=2,
            )
        )
        return 1 if failed else 0
    _print_failures(results)
    _print_quiet_warnings(args, pool)
    if not args.verbose and any(r.warnings for r in results):
        _print("(torch's warnings during the runs are hidden: -v shows them)")
    _print(f"{len(results) - failed} passed, {failed} failed")
    _print(f"({time.perf_counter() - start:.1f} s)")
    return 1 if failed else 0


def _environment() -> dict[str, object]:
    import platform

    import torch
    import torch.distributed as dist

    from dtensor_patches import __version__, compat, registry

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


def _plan_reason(outcome: Any) -> str:
    from dtensor_patches import compat, registry
    from dtensor_patches.report import Status

    if outcome.status is Status.GATED_OUT:
        gate = _text.format_gate(registry.get(outcome.name).gate)
        return f"gate {gate} excludes {compat.torch_release()}"
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
    from dtensor_patches.status import status

    with registry.patched():
        with loss_parallel():
            pass
        after = status()
    if after.intact:
        return f"patches survive loss_parallel(): yes ({len(after.patches)} applied, all in effect)"
    return f"patches survive loss_parallel(): NO, lost: {', '.join(after.lost)}"


def _cmd_doctor(args: argparse.Namespace) -> int:
    from dtensor_patches import registry
    from dtensor_patches.report import Status

    pool = None if args.no_check else _start_pool(args)
    try:
        _load_torch(args)
        env = _environment()
        plan = registry.plan()
        env["loss_parallel"] = _survives_loss_parallel()
        plan_failed = bool(plan.names(Status.FAILED))
        if args.json:
            results = [] if pool is None else _run_tripwires(args, pool, stream=False)
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
        _print(f"dtensor-patches {env['dtensor_patches']} on Python {env['python']}")
        build = f"CUDA {env['cuda_build']}" if env["cuda_build"] else "CPU-only build"
        _print(f"torch {env['torch_version']} (release {env['torch_release']}, {build})")
        if args.verbose:
            _details("torch git", env["torch_git"])
        _print(f"CUDA available: {env['cuda_available']}")
        backends = env["backends"]
        assert isinstance(backends, dict)
        _print(
            "distributed backends: "
            + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in backends.items())
        )
        _print(str(env["loss_parallel"]))
        _print()
        _print("apply_all() would:")
        cells = [[o.name, o.status.value, _plan_reason(o)] for o in plan]
        head, widths = _text.table(["patch", "action", "reason"], cells, flexible=2)
        for line in head:
            _print(line)
        for cell in cells:
            _print(_text.row_line(cell, widths))
            if args.verbose and len(cell[2]) > widths[2]:
                _details("reason", cell[2])
        results = []
        if pool is not None:
            _print()
            results = _run_tripwires(args, pool, stream=True)
            _print_failures(results)
    finally:
        if pool is not None:
            pool.close()
    _print_quiet_warnings(args, pool)
    _print()
    for line in _summary(plan, results, checked=pool is not None):
        _print(line)
    return 1 if plan_failed or any(not r.passed for r in results) else 0


def _cmd_scan(args: argparse.Namespace) -> int:
    # torch is imported lazily, inside the scan module.
    from dtensor_patches.scan import scan_function

    found = scan_function(args.target, world_size=args.world_size, apply_patches=args.apply_all)
    report = found.report(args.release or None)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.table())
    if found.error:
        return 1
    verdicts = {v.release: v for v in report.verdicts}
    for release in args.require or ():
        if release not in verdicts:
            raise ValueError(f"--require {release}: not among the releases reported")
        if verdicts[release].patched() != "runs":
            return 1
    return 0


def _add_scan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "scan",
        help="run a step function, record its DTensor ops, predict each torch release",
        description="Run MODULE:FUNCTION (or FILE.py:FUNCTION, called without arguments) "
        "on CPU gloo ranks, record every distinct (op, input placements) it calls on "
        "DTensors, and say for each torch release 2.9-2.15 which have no strategy, which "
        "patch covers each, which are known wrong, and which would fall back.",
    )
    p.add_argument("target", help="MODULE:FUNCTION or FILE.py:FUNCTION")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn (default 2)")
    p.add_argument(
        "--apply-all",
        action="store_true",
        help="apply_all() before the step, so it runs past this release's gaps",
    )
    p.add_argument("--release", nargs="+", metavar="X.Y.Z", help="only these releases")
    p.add_argument(
        "--require",
        nargs="+",
        metavar="X.Y.Z",
        help="exit 1 unless the step is predicted to run with apply_all() on these releases",
    )
    p.set_defaults(func=_cmd_scan)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dtensor-patches",
        description="Version-gated fixes for PyTorch DTensor gaps: list the patches, run their "
        "tripwires, diagnose this installation.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser(
        "list", help="patches, gates, ops and whether each applies to this torch"
    )
    p_list.add_argument("--json", action="store_true", help="machine-readable output")
    p_list.add_argument(
        "-v", "--verbose", action="store_true", help="every op, upstream issue and fix"
    )
    p_list.add_argument(
        "--fallback-alone",
        action="store_true",
        help="run each patch's reproducer on stock torch with only the fallback on (spawns "
        "ranks): does the fallback alone give the single-device result?",
    )
    p_list.add_argument(
        "--world-size", type=int, default=2, help="ranks for --fallback-alone (default 2)"
    )
    p_list.set_defaults(func=_cmd_list)
    for name, func, helptext in (
        (
            "check",
            _cmd_check,
            "run the tripwires; exit 1 on a stale, too-narrow or ineffective patch",
        ),
        (
            "doctor",
            _cmd_doctor,
            "torch build, backends, what apply_all() would do, the tripwires, a summary",
        ),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument(
            "-v",
            "--verbose",
            action="store_true",
            help="full messages, torch's warnings during each run, seconds per patch",
        )
        p.add_argument(
            "--world-size", type=int, default=2, help="ranks in the CPU gloo mesh (default 2)"
        )
        p.add_argument(
            "--only", nargs="+", metavar="PATCH", help="run only these patches' tripwires"
        )
        p.add_argument(
            "--gate",
            action="append",
            metavar="NAME=SPEC",
            help="check a proposed gate instead of the registered one, e.g. 'alias=>=2.9,<2.11' "
            "(repeatable)",
        )
        p.add_argument(
            "--fallback-alone",
            action="store_true",
            help="also run each failing reproducer with only the fallback on (verdicts are "
            "still judged with it off)",
        )
        if name == "doctor":
            p.add_argument("--no-check", action="store_true", help="skip the tripwires")
        p.set_defaults(func=func)
    _add_scan_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (0 ok, 1 a tripwire or patch failed, 2 bad usage)."""
    args = _parser().parse_args(argv)
    if getattr(args, "world_size", 2) < 2:
        print(
            f"dtensor-patches: --world-size must be >= 2 (tripwires need a multi-rank mesh), "
            f"got {args.world_size}",
            file=sys.stderr,
        )
        return 2
    try:
        return int(args.func(args))
    except (KeyError, ValueError) as exc:
        print(f"dtensor-patches: {exc.args[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

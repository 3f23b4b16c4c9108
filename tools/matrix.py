"""Compatibility matrix: every reproducer, stock and patched, on every torch release.

For each release it builds (or reuses) a virtual environment with that torch, runs
``python -m tools.matrix --collect`` there (a 2-rank CPU gloo mesh: each patch's
reproducer on stock torch, then again after ``apply_all()``), and writes the table to
``docs/compat-matrix.md``::

    python -m tools.matrix --venv-root ~/.cache/dtensor-patches-venvs \\
        --releases 2.9.1 2.10.0 2.11.0 2.12.0 2.13.0 2.14.1 2.15.0

Every cell with patches applied must say ``ok``.

The same run writes the release facts that :func:`dtensor_patches.scan.scan` predicts from
(``dtensor_patches/data/releases.json``, shipped in the wheel): each release's own DTensor
registry (ops with strategies, single-dim strategies, custom handlers, ops torch decomposes),
the ops each patch installs entries for there, and each patch's stock result from the matrix.
Only the registry facts are collected again with ``--scan-data`` (seconds per release); the
stock results are reused from ``docs/compat-matrix.json`` where it is current for a release
(same patches, ops and gates), and the reproducers are run again where it is not::

    python -m tools.matrix --scan-data --no-install \
        --venv 2.9.1=~/.cache/dtensor-patches-ci/venv-torch-2.9.1 ...
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("tools.matrix")

DEFAULT_RELEASES = ("2.9.1", "2.10.0", "2.11.0", "2.12.0", "2.13.0", "2.14.1", "2.15.0")
REPO = Path(__file__).resolve().parents[1]
SCAN_DATA = REPO / "dtensor_patches" / "data" / "releases.json"
SCAN_DATA_FORMAT = 1


def _collect_on_rank() -> list[dict[str, Any]]:
    from dtensor_patches import patched, registry
    from dtensor_patches._torch.versions import torch_version
    from dtensor_patches.dispatch import fallback
    from dtensor_patches.testing import world_mesh
    from dtensor_patches.tripwire import gather_result, with_required

    mesh = world_mesh()
    rows = []
    # Judged with the fallback off: a patch is never counted fixed because of it.
    stock = {}
    with fallback.disabled():
        for p in registry.all_patches():
            with with_required(p):
                stock[p.name] = gather_result(p.reproduce_on(mesh))
    with patched(fallback="off") as report, fallback.disabled():
        for patch in registry.all_patches():
            rows.append(
                {
                    "patch": patch.name,
                    "ops": list(patch.ops),
                    "gate": str(patch.gate),
                    "in_gate": patch.applies_to(),
                    "status": report[patch.name].status.value,
                    "stock": stock[patch.name],
                    "patched": gather_result(patch.reproduce_on(mesh)),
                    "torch": str(torch_version()),
                }
            )
    return rows


def collect(world_size: int = 2) -> list[dict[str, Any]]:
    """This interpreter's row of the matrix (runs the reproducers on ``world_size`` ranks)."""
    from dtensor_patches.testing import RankPool

    with RankPool(world_size, env={"DTENSOR_PATCHES_DISABLE": ""}) as pool:
        return pool.run(_collect_on_rank)[0]


def registry_facts() -> dict[str, Any]:
    """This interpreter's registry facts for the scan data file (no ranks, no reproducers).

    ``strategies``/``single_dim``/``handlers``: torch's own entries
    (:func:`dtensor_patches._torch.tables.native_registry`); ``decomposes``: ops with none of
    those that DTensor decomposes there (a CompositeImplicitAutograd kernel; from 2.11 also a
    ``torch._decomp`` entry, :func:`dtensor_patches._torch.schemas.dtensor_decomposes`);
    ``aten_ops``: every aten overload; ``installs``: per patch in its gate, the ops
    ``apply_all()`` installs entries for here (``"*"`` for a miss rule on every op).
    """
    from dtensor_patches import patched, registry, state
    from dtensor_patches._torch.schemas import all_aten_ops, dtensor_decomposes
    from dtensor_patches._torch.tables import native_registry
    from dtensor_patches._torch.versions import torch_version

    native = native_registry(lambda table, op: state.LEDGER.added((table, op)))
    covered = {op for ops in native.values() for op in ops}
    aten_ops = all_aten_ops()
    facts: dict[str, Any] = {
        "torch": str(torch_version()),
        **native,
        "decomposes": [op for op in aten_ops if op not in covered and dtensor_decomposes(op)],
        "aten_ops": aten_ops,
        "installs": {},
    }
    with patched():
        for patch in registry.all_patches():
            if patch.is_applied:
                facts["installs"][patch.name] = patch.installed()
    return facts


def _rows_current(rows: list[dict[str, Any]] | None, release: str) -> bool:
    """Whether matrix rows measured earlier still describe this checkout's patches on
    ``release``: one row per registered patch, same ops and gate, measured on that release."""
    from packaging.version import Version

    from dtensor_patches import registry

    if not rows:
        return False
    by_name = {row["patch"]: row for row in rows}
    for patch in registry.all_patches():
        row = by_name.get(patch.name)
        if row is None or row["ops"] != list(patch.ops) or row["gate"] != str(patch.gate):
            return False
        if Version(Version(row["torch"]).base_version) != Version(release):
            return False
    return len(by_name) == len(registry.all_patches())


def scan_data(results: dict[str, list[dict[str, Any]]], facts: dict[str, dict[str, Any]]) -> dict:
    """The scan data file's content from matrix rows and registry facts, per release.

    ``absent`` lists the aten ops other releases have and this one lacks (the full op list
    of every release would make the file several times larger).
    """
    every_op = sorted({op for f in facts.values() for op in f["aten_ops"]})
    releases: dict[str, Any] = {}
    for release, fact in facts.items():
        own = set(fact["aten_ops"])
        patches = {}
        for row in results[release]:
            patches[row["patch"]] = {
                "ops": row["ops"],
                "gate": row["gate"],
                "in_gate": row["in_gate"],
                "installs": fact["installs"].get(row["patch"], []),
                "stock": row["stock"],
            }
        releases[release] = {
            "torch": fact["torch"],
            "strategies": fact["strategies"],
            "single_dim": fact["single_dim"],
            "handlers": fact["handlers"],
            "decomposes": fact["decomposes"],
            "absent": [op for op in every_op if op not in own],
            "patches": patches,
        }
    return {
        "format": SCAN_DATA_FORMAT,
        "generated_by": "python -m tools.matrix",
        "releases": releases,
    }


def _run_in(python: Path, flag: str, env: dict[str, str] | None) -> Any:
    proc = subprocess.run(
        [python, "-m", "tools.matrix", flag],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        cwd=REPO,  # ``tools`` is a package of the repository, not of the wheel
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{python} -m tools.matrix {flag} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ensure_venv(path: Path, release: str) -> Path:
    """A virtual environment at ``path`` with ``torch==release`` and this project (editable).

    Releases newer than the local pip cap are installed with ``PIP_CONFIG_FILE=/dev/null``.

    Raises:
        subprocess.CalledProcessError: an install failed.
    """
    python = path / "bin" / "python"
    probe = f"import torch, sys; sys.exit(torch.__version__.split('+')[0] != '{release}')"
    if not python.exists() or subprocess.run([python, "-c", probe], check=False).returncode:
        log.info("creating %s with torch %s", path, release)
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        env = dict(os.environ, PIP_CONFIG_FILE="/dev/null")
        extra = ["--find-links", "/opt/wheels"] if Path("/opt/wheels").is_dir() else []
        subprocess.run(
            [python, "-m", "pip", "install", "-q", *extra, f"torch=={release}"], check=True, env=env
        )
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "-e", str(REPO)], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", "packaging"], check=True)
    return python


def _cell(row: dict[str, Any] | None, release: str = "") -> str:
    if row is None:
        return "n/a"
    stock = "ok" if row["stock"] is None else ("FAIL" if "Error" in row["stock"] else "WRONG")
    if row["patched"] is not None and _known_gap(row["patch"], release):
        return f"{stock} (known gap)"
    patched = "ok" if row["patched"] is None else "**BROKEN**"
    if row["stock"] is None and row["patched"] is None:
        return "ok"
    return f"{stock} → {patched}"


def _known_gap(name: str, release: str) -> bool:
    from dtensor_patches import registry

    try:
        return registry.get(name).is_known_gap(release)
    except KeyError:
        return False


def _problems(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """One line per cell the tripwire judges not ok: still wrong with patches, a stale gate
    (stock correct inside it) or a gate too narrow (stock wrong outside it)."""
    from dtensor_patches.tripwire import Verdict, judge

    problems = []
    for release, rows in results.items():
        for row in rows:
            verdict, message = judge(
                patch=row["patch"],
                torch_version=release,
                in_gate=row["in_gate"],
                bug=row["stock"],
                after_patch=row["patched"],
                known_gap=_known_gap(row["patch"], release),
            )
            if verdict is not Verdict.OK:
                problems.append(f"- `{row['patch']}` on {release}: {message}")
    return problems


def render(results: dict[str, list[dict[str, Any]]]) -> str:
    """The markdown table: patch by release, ``stock → patched``."""
    from dtensor_patches._text import format_gate

    releases = list(results)
    names: list[str] = []
    for rows in results.values():
        for row in rows:
            if row["patch"] not in names:
                names.append(row["patch"])
    index = {(r, row["patch"]): row for r, rows in results.items() for row in rows}
    lines = [
        "# Compatibility matrix",
        "",
        "Generated by `python -m tools.matrix` on a 2-rank CPU gloo mesh. Each cell",
        "is the patch's reproducer (its ops against the single-device result) on stock torch,",
        "then with `apply_all()`: `ok` (correct without patches), `FAIL → ok` (raised, fixed),",
        "`WRONG → ok` (silently wrong, fixed). Every patched cell must say ok.",
        "",
        "| patch | gate | " + " | ".join(releases) + " |",
        "|---|---|" + "---|" * len(releases),
    ]
    for name in names:
        gate = format_gate(next(index[(r, name)]["gate"] for r in releases if (r, name) in index))
        cells = [_cell(index.get((r, name)), r) for r in releases]
        lines.append(f"| `{name}` | `{gate}` | " + " | ".join(cells) + " |")
    lines += ["", "## What stock torch does", ""]
    for name in names:
        for release in releases:
            row = index.get((release, name))
            if row is not None and row["stock"] is not None:
                lines.append(f"- `{name}` on {release}: {row['stock']}")
    broken = _problems(results)
    if broken:
        lines += ["", "## Tripwire problems", "", *broken]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.matrix", description=__doc__)
    parser.add_argument(
        "--collect", action="store_true", help="print this interpreter's row as JSON"
    )
    parser.add_argument("--releases", nargs="+", default=list(DEFAULT_RELEASES))
    parser.add_argument(
        "--venv-root", type=Path, default=Path.home() / ".cache" / "dtensor-patches-venvs"
    )
    parser.add_argument(
        "--venv", action="append", default=[], metavar="RELEASE=PATH", help="reuse an existing venv"
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "compat-matrix.md")
    parser.add_argument("--json", type=Path, default=REPO / "docs" / "compat-matrix.json")
    parser.add_argument(
        "--collect-registry",
        action="store_true",
        help="print this interpreter's registry facts (for the scan data file) as JSON",
    )
    parser.add_argument(
        "--scan-data",
        action="store_true",
        help="regenerate the scan data file only: reuse the matrix rows that are current",
    )
    parser.add_argument("--scan-data-out", type=Path, default=SCAN_DATA)
    parser.add_argument(
        "--no-install",
        action="store_true",
        help="use the venvs as they are (this checkout on PYTHONPATH) instead of installing",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.collect:
        print(json.dumps(collect()))
        return 0
    if args.collect_registry:
        print(json.dumps(registry_facts()))
        return 0
    given = {k: v for k, v in (item.split("=", 1) for item in args.venv)}
    env = None
    if args.no_install:
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        )
    previous: dict[str, list[dict[str, Any]]] = {}
    if args.scan_data and args.json.exists():
        previous = json.loads(args.json.read_text())
    results: dict[str, list[dict[str, Any]]] = {}
    facts: dict[str, dict[str, Any]] = {}
    try:
        for release in args.releases:
            path = Path(given[release]) if release in given else args.venv_root / f"torch-{release}"
            path = path.expanduser()
            python = path / "bin" / "python" if args.no_install else ensure_venv(path, release)
            if args.scan_data and _rows_current(previous.get(release), release):
                log.info("torch %s: matrix rows are current, reused", release)
                results[release] = previous[release]
            else:
                log.info("collecting torch %s (reproducers)", release)
                results[release] = _run_in(python, "--collect", env)
            log.info("collecting torch %s (registry)", release)
            facts[release] = _run_in(python, "--collect-registry", env)
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1
    if results != {r: previous.get(r) for r in results} or not args.scan_data:
        merged = {**previous, **results} if args.scan_data else results
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(render(merged))
        args.json.write_text(json.dumps(merged, indent=1) + "\n")
        log.info("wrote %s", args.out)
    args.scan_data_out.parent.mkdir(parents=True, exist_ok=True)
    args.scan_data_out.write_text(json.dumps(scan_data(results, facts), indent=0) + "\n")
    log.info("wrote %s", args.scan_data_out)
    broken = _problems(results)
    log.info("%d broken cells", len(broken))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())

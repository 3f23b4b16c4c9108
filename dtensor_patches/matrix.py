"""Compatibility matrix: every reproducer, stock and patched, on every torch release.

For each release it builds (or reuses) a virtual environment with that torch, runs
``python -m dtensor_patches.matrix --collect`` there (a 2-rank CPU gloo mesh: each patch's
reproducer on stock torch, then again after ``apply_all()``), and writes the table to
``docs/compat-matrix.md``::

    python -m dtensor_patches.matrix --venv-root ~/.cache/dtensor-patches-venvs \\
        --releases 2.9.1 2.10.0 2.11.0 2.12.0 2.13.0 2.14.1 2.15.0

Every cell with patches applied must say ``ok``.
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

log = logging.getLogger("dtensor_patches.matrix")

DEFAULT_RELEASES = ("2.9.1", "2.10.0", "2.11.0", "2.12.0", "2.13.0", "2.14.1", "2.15.0")
REPO = Path(__file__).resolve().parents[1]


def _collect_on_rank() -> list[dict[str, Any]]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dtensor_patches import compat, fallback, patched, registry
    from dtensor_patches.tripwire import _gather

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rows = []
    # Judged with the fallback off: a patch is never counted fixed because of it.
    with fallback.disabled():
        stock = {p.name: _gather(p.reproduce(mesh)) for p in registry.all_patches()}
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
                    "patched": _gather(patch.reproduce(mesh)),
                    "torch": str(compat.torch_version()),
                }
            )
    return rows


def collect(world_size: int = 2) -> list[dict[str, Any]]:
    """This interpreter's row of the matrix (runs the reproducers on ``world_size`` ranks)."""
    from dtensor_patches.testing import RankPool

    with RankPool(world_size, env={"DTENSOR_PATCHES_DISABLE": ""}) as pool:
        return pool.run(_collect_on_rank)[0]


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


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "n/a"
    stock = "ok" if row["stock"] is None else ("FAIL" if "Error" in row["stock"] else "WRONG")
    patched = "ok" if row["patched"] is None else "**BROKEN**"
    if row["stock"] is None and row["patched"] is None:
        return "ok"
    return f"{stock} → {patched}"


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
            )
            if verdict is not Verdict.OK:
                problems.append(f"- `{row['patch']}` on {release}: {message}")
    return problems


def render(results: dict[str, list[dict[str, Any]]]) -> str:
    """The markdown table: patch by release, ``stock → patched``."""
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
        "Generated by `python -m dtensor_patches.matrix` on a 2-rank CPU gloo mesh. Each cell",
        "is the patch's reproducer (its ops against the single-device result) on stock torch,",
        "then with `apply_all()`: `ok` (correct without patches), `FAIL → ok` (raised, fixed),",
        "`WRONG → ok` (silently wrong, fixed). Every patched cell must say ok.",
        "",
        "| patch | gate | " + " | ".join(releases) + " |",
        "|---|---|" + "---|" * len(releases),
    ]
    for name in names:
        gate = next(index[(r, name)]["gate"] for r in releases if (r, name) in index)
        cells = [_cell(index.get((r, name))) for r in releases]
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
    parser = argparse.ArgumentParser(prog="python -m dtensor_patches.matrix", description=__doc__)
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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.collect:
        print(json.dumps(collect()))
        return 0
    given = dict(item.split("=", 1) for item in args.venv)
    results: dict[str, list[dict[str, Any]]] = {}
    for release in args.releases:
        path = Path(given[release]) if release in given else args.venv_root / f"torch-{release}"
        python = ensure_venv(path, release)
        log.info("collecting torch %s", release)
        proc = subprocess.run(
            [python, "-m", "dtensor_patches.matrix", "--collect"],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            log.error("torch %s failed:\n%s", release, proc.stderr[-4000:])
            return 1
        results[release] = json.loads(proc.stdout.strip().splitlines()[-1])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(results))
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    broken = _problems(results)
    log.info("wrote %s (%d broken cells)", args.out, len(broken))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())

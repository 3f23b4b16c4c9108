"""``python -m tools.validate.table``: one release's validator runs -> its entry of
``dtensor_patches/data/wrong_cells.json``, and ``docs/cells.md`` rendered from every entry.

Three runs of ``python -m tools.validate`` per release (the last two on the OpInfos where the
first found anything):

- ``--stock``: stock torch: the wrong cells of the release;
- ``--patched``: ``--apply-patches`` with the ``wrong_cells_*`` patches excluded
  (``DTENSOR_PATCHES_DISABLE``): a stock cell still wrong here is *routed*;
- ``--final``: ``--apply-patches`` with everything: what is still wrong after ``apply_all()``
  (the goal is nothing).

    python -m tools.validate.table --torch 2.13.0 --stock s.jsonl --patched p.jsonl --final f.jsonl

With ``--merge`` the runs may cover some OpInfos only (``--ops``, ``--match``): what those
found replaces their part of the release's entry, the rest is kept (:func:`merge_entry`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[2] / "dtensor_patches" / "data" / "wrong_cells.json"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "cells.md"


def _read(path: Path | None) -> list[dict[str, Any]]:
    if path is None or not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _low_precision(call: Any) -> bool:
    if isinstance(call, dict):
        if call.get("dtype") in ("float16", "bfloat16"):
            return True
        return any(_low_precision(v) for v in call.values())
    if isinstance(call, list):
        return any(_low_precision(v) for v in call)
    return False


def _cells(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every cell of ``records`` by key (the first sample's record of it), without the value
    differences of half-precision calls (a sum over shards rounds in another order)."""
    out: dict[str, dict[str, Any]] = {}
    for record in records:
        for cell in record["cells"]:
            if "values differ" in cell["problem"] and _low_precision(cell.get("call")):
                continue
            out.setdefault(cell["key"], cell)
    return out


def _unattributed(records: list[dict[str, Any]]) -> list[str]:
    return sorted({u for r in records for u in r.get("unattributed", [])})


def replay_on_rank(
    calls: dict[str, Any], setting: str, mesh_shape: tuple[int, ...] = ()
) -> dict[str, str | None]:
    """Per rank: each recorded call replayed alone (``cell_replay.replay``) on stock torch
    (``"stock"``: with only ``runner.STOCK_KEEPS``), with the hand-written patches (``"patches"``: every patch but the
    ``wrong_cells_*`` ones) or with everything (``"all"``); what differs, per cell key."""
    import dtensor_patches
    from dtensor_patches.cell_replay import replay
    from dtensor_patches.registry import all_patches
    from dtensor_patches.testing import grid_mesh, world_mesh
    from tools.validate.runner import STOCK_KEEPS

    mesh = grid_mesh(mesh_shape) if mesh_shape else world_mesh()
    dtensor_patches.revert_all()
    if setting == "stock":
        dtensor_patches.apply_all(only=STOCK_KEEPS)
    elif setting == "patches":
        routing = [p.name for p in all_patches() if p.name.startswith("wrong_cells_")]
        dtensor_patches.apply_all(exclude=routing)
    elif setting == "all":
        dtensor_patches.apply_all()
    out: dict[str, str | None] = {}
    try:
        for key, call in calls.items():
            try:
                out[key] = replay(call, mesh)
            except Exception as exc:  # noqa: BLE001 - a call that cannot be rebuilt
                out[key] = f"cannot replay: {type(exc).__name__}: {str(exc)[:120]}"
    finally:
        dtensor_patches.revert_all()
    return out


def replays(
    calls: dict[str, Any],
    setting: str,
    mesh_shape: tuple[int, ...] = (),
    *,
    timeout: float = 150.0,
    call_timeout: float = 60.0,
    hash_seeds: tuple[int, ...] | None = None,
) -> dict[str, str | None]:
    """:func:`replay_on_rank` on a fresh pool (fresh: the patches are built from the data file
    as it is now) of 2 ranks, or of ``mesh_shape``'s; a cell counts as wrong if any rank saw
    it wrong. When the ranks hang or die (a call that hangs on stock torch: some ranks raise
    while the others wait in a collective), the calls are replayed one at a time on pools
    restarted after each such call, and a call that hangs alone is wrong ("hangs").
    ``hash_seeds``: the ranks' ``PYTHONHASHSEED``, as the run that found the calls had them."""
    import math

    from dtensor_patches.testing import STARTUP_TIMEOUT, RankPool

    if not calls:
        return {}
    world = math.prod(mesh_shape) if mesh_shape else 2

    def merged(results: list[dict[str, str | None]], keys: Any) -> dict[str, str | None]:
        return {key: next((r[key] for r in results if r[key] is not None), None) for key in keys}

    try:
        with RankPool(world, timeout=timeout, hash_seeds=hash_seeds) as pool:
            return merged(pool.run(replay_on_rank, calls, setting, mesh_shape), calls)
    except Exception:  # noqa: BLE001 - a hang or a dead rank: find the call, one at a time
        pass
    out: dict[str, str | None] = {}
    pool: RankPool | None = None
    try:
        for key, call in calls.items():
            if pool is None:
                pool = RankPool(
                    world,
                    timeout=call_timeout,
                    startup_timeout=STARTUP_TIMEOUT,
                    hash_seeds=hash_seeds,
                )
            try:
                out.update(
                    merged(pool.run(replay_on_rank, {key: call}, setting, mesh_shape), [key])
                )
            except Exception as exc:  # noqa: BLE001 - this call hangs or kills a rank
                out[key] = f"hangs or a rank died when replayed alone ({type(exc).__name__})"
                pool.close()
                pool = None
    finally:
        if pool is not None:
            pool.close()
    return out


def release_entry(
    torch_version: str,
    stock: list[dict[str, Any]],
    patched: list[dict[str, Any]],
    final: list[dict[str, Any]],
    *,
    replay: bool = True,
    mesh_shape: tuple[int, ...] = (),
    hash_seeds: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """The table entry of one release from its three runs.

    A cell is *routed* when its recorded call, replayed alone, is wrong on stock torch and
    still wrong with the hand-written patches: a confirmed bug no patch fixes, with a tripwire.
    A cell whose call is right when replayed alone was wrong only in the context of its sample
    (a view's base, an earlier op): it is listed, not routed (routing a cell on a suspicion
    would send correct calls of common ops to the fallback)."""
    stock_cells = _cells(stock)
    patched_cells = _cells(patched)
    final_cells = _cells(final)
    calls = {k: c["call"] for k, c in stock_cells.items() if c.get("call")}
    on_stock = replays(calls, "stock", mesh_shape, hash_seeds=hash_seeds) if replay else {}
    # A call that hangs alone on stock torch is a bug, but no tripwire can replay a hang: it
    # is listed, not routed (what apply_all() makes of it is in the final run).
    hangs = {k for k, v in on_stock.items() if v is not None and v.startswith("hangs")}
    confirmed = {k: calls[k] for k in calls if on_stock.get(k) is not None and k not in hangs}
    with_patches = (
        replays(confirmed, "patches", mesh_shape, hash_seeds=hash_seeds) if replay else {}
    )
    cells = []
    for key, cell in sorted(stock_cells.items()):
        alone = key in confirmed
        cells.append(
            {
                "key": key,
                "op": cell["op"],
                "family": cell["family"],
                "problem": cell["problem"],
                "found_by": cell["found_by"],
                "replays_alone": alone,
                "routed": alone and with_patches.get(key) is not None,
                **({"hangs_alone_on_stock": True} if key in hangs else {}),
                "call": cell.get("call") if alone else None,
            }
        )
    outcomes: Counter[str] = Counter()
    for record in stock:
        outcomes.update(record.get("outcomes", {}))
    return {
        "torch": torch_version,
        "opinfos": len(stock),
        "outcomes": dict(outcomes),
        "cells": cells,
        "introduced_by_patches": sorted(set(patched_cells) - set(stock_cells)),
        "after_apply_all": sorted(final_cells),
        "families_after_apply_all": dict(Counter(c["family"] for c in final_cells.values())),
        "unattributed_stock": _unattributed(stock),
        "unattributed_after_apply_all": _unattributed(final),
        "crashed_or_timed_out": _crashed(stock),
        "crashed_after_apply_all": _crashed(final),
        "failed_patterns": _failed_patterns(stock),
        "failed_patterns_after_apply_all": _failed_patterns(final),
    }


def _crashed(records: list[dict[str, Any]]) -> list[str]:
    """The OpInfos of a run whose ranks crashed or hung (in some or all of their patterns)."""
    return sorted(r["opinfo"] for r in records if {"crash", "timeout"} & set(r.get("outcomes", {})))


def _failed_patterns(records: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """OpInfo -> {pattern: ``timeout`` or ``crash``} for the OpInfos the validator re-ran one
    pattern at a time (``"*"``: a run with one pattern)."""
    return {r["opinfo"]: r["failed_patterns"] for r in records if r.get("failed_patterns")}


def _with_patterns(names: list[str], failed: dict[str, dict[str, str]]) -> list[str]:
    """``names`` with the patterns that crashed or hung, where the run knows them."""
    out = []
    for name in names:
        where = failed.get(name, {})
        if where and "*" not in where:
            patterns = ", ".join(f"`{p}` {kind}" for p, kind in sorted(where.items()))
            name = f"{name} (only {patterns}; its other patterns validated)"
        out.append(name)
    return out


def _opinfo_of(found_by: str) -> str:
    """The OpInfo key of a ``found_by`` or unattributed text (``"<key>[<sample>] ..."``)."""
    return found_by.split("[", 1)[0]


def merge_entry(old: dict[str, Any], new: dict[str, Any], rerun: set[str]) -> dict[str, Any]:
    """``old`` (a release's entry) with what the OpInfos ``rerun`` found replaced by ``new``
    (the entry of runs of exactly those OpInfos): how a release's table takes a re-validation
    of some OpInfos (a fixed validator, OpInfos added) without re-running them all.

    Cells, unattributed results and crashes are attributed to OpInfos by ``found_by``; a key
    of ``after_apply_all`` or ``introduced_by_patches`` (which name no OpInfo) is dropped when
    it is a key of a re-run OpInfo's old cell and of no other kept cell. ``opinfos`` and
    ``outcomes`` grow by the re-run OpInfos outside ``op_db`` (the foreach OpInfos; the old runs
    covered ``op_db``)."""
    from tools.sweep.runner import _op_db

    kept = [c for c in old["cells"] if _opinfo_of(c["found_by"]) not in rerun]
    kept_keys = {c["key"] for c in kept}
    dropped = {c["key"] for c in old["cells"]} - kept_keys
    cells = kept + [c for c in new["cells"] if c["key"] not in kept_keys]
    cells.sort(key=lambda c: c["key"])
    family = {c["key"]: c["family"] for c in cells}

    def keys(name: str) -> list[str]:
        return sorted({k for k in old[name] if k not in dropped} | set(new[name]))

    def texts(name: str) -> list[str]:
        return sorted({t for t in old[name] if _opinfo_of(t) not in rerun} | set(new[name]))

    # OpInfos outside op_db counted once: a second re-run of one adds nothing.
    known = set(old.get("rerun_opinfos", []))
    added = [k for k in rerun if k not in _op_db() and k not in known]
    outcomes: Counter[str] = Counter(old.get("outcomes", {}))
    outcomes.update(new.get("outcomes", {}) if added else {})
    after = keys("after_apply_all")
    return {
        **old,
        "opinfos": old["opinfos"] + len(added),
        "outcomes": dict(outcomes),
        "cells": cells,
        "introduced_by_patches": keys("introduced_by_patches"),
        "after_apply_all": after,
        "families_after_apply_all": dict(Counter(family.get(k, "other") for k in after)),
        "unattributed_stock": texts("unattributed_stock"),
        "unattributed_after_apply_all": texts("unattributed_after_apply_all"),
        "crashed_or_timed_out": sorted(
            {k for k in old["crashed_or_timed_out"] if k not in rerun}
            | set(new["crashed_or_timed_out"])
        ),
        "crashed_after_apply_all": sorted(
            {k for k in old.get("crashed_after_apply_all", []) if k not in rerun}
            | set(new["crashed_after_apply_all"])
        ),
        "rerun_opinfos": sorted(set(old.get("rerun_opinfos", [])) | rerun),
    }


def render(data: dict[str, Any]) -> str:
    """``docs/cells.md`` from the whole table: the 1-D mesh's entries, then each other mesh's
    (``data["meshes"]``)."""
    lines = [
        "# Cells torch's own strategies get wrong, per release",
        "",
        "Generated by `python -m tools.validate.table` from the strategy validator's runs",
        "(`python -m tools.validate`, see its module doc): torch's `op_db` samples, and its",
        "foreach OpInfos' (`_foreach_*`, three tensors per list), on a 1-D 2-rank CPU gloo",
        "mesh, every tensor argument a DTensor under each placement pattern",
        "(`Shard` of every dim, first-sharded and first-replicated mixes, `Replicate()`,",
        "`Partial` of sum/avg/max/min; op_db's sizes give uneven and empty shards), as a",
        "function, in place and with a DTensor `out=`, forward and backward, every DTensor call",
        "checked by `dtensor_patches.verify` against the same op on full plain tensors.",
        "A cell is an op with the layouts of its DTensor inputs (`~`: a dim the mesh does not",
        "divide); see `dtensor_patches/cells.py`. *Routed*: left wrong by the hand-written",
        "patches, sent to the fallback's computation by `wrong_cells_<family>`. The data, with",
        "each cell's recorded call (its tripwire), is `dtensor_patches/data/wrong_cells.json`.",
        "",
        "Columns: the wrong cells the samples showed on stock torch; of them, those whose",
        "recorded call is wrong when replayed alone (confirmed: each has a tripwire) and the",
        "rest (wrong only in their sample's context: listed, not routed); of the confirmed,",
        "those the hand-written patches fix and those routed; then, after `apply_all()`, the",
        "routed cells that raise a clear error and those still wrong, replayed alone; the cells",
        "still wrong in the samples; and the cells wrong only with the patches applied.",
        "Some OpInfos were validated again after a fix, without re-running the rest",
        "(`--merge`; each release's `rerun_opinfos` in the data): the foreach OpInfos and",
        "`unfold` on every release, `pairwise_distance`, `cosine_similarity`, `normalize` and",
        "the vector norms on 2.9.1, 2.10.0, 2.11.0 and 2.13.0 (2026-12-06), and on every release",
        "the OpInfos whose ranks had crashed or hung, with the reductions over every dim",
        "(2026-12-06). The last two columns count OpInfos whose ranks crashed or hung (one rank",
        "raised while the others waited in a collective): on stock torch, and after",
        "`apply_all()`. The 2-D mesh (2x2, 4 ranks) has its own tables below.",
        "",
    ]
    lines += _mesh_tables(data.get("releases", {}))
    for shape, mesh in sorted(data.get("meshes", {}).items()):
        lines += [
            "",
            f"# {shape} mesh",
            "",
            "The same validation on a 2-D mesh of 4 ranks (`python -m tools.validate --mesh",
            f"{shape}`), with the 2-D placement patterns (`PATTERNS_2D`: one pattern per mesh",
            "dim, e.g. `S0/S1` as FSDP2 + TP lay out a weight, `S0/S0` a dim sharded over both",
            "mesh dims, `S0/P.sum` a data-parallel shard with a pending tensor-parallel sum).",
            "Four ranks on a 2-core host are slow, so it covers a subset of `op_db`, three",
            "samples each (the OpInfos column): on 2.13.0 the OpInfos of the common training",
            "ops and every OpInfo where a 1-D run found anything on some release; on the other",
            "releases the common training ops, every OpInfo where the 2.13.0 2x2 run found",
            "anything, and that release's own 1-D findings where they are few (on 2.12.0 and",
            "2.14.1: every OpInfo where a 2x2 run of another release found anything and 28 of",
            "the common training ops, `conv_transpose1d` left out: it hangs on nearly every",
            "pattern on stock torch); measured on",
            f"{', '.join(mesh['releases'][r].get('torch', r) for r in _by_release(mesh.get('releases', {})))}"
            " (2026-12-06 and -07). The 2.14.1 runs and 2.15.0's `vdot` run again had",
            "ranks seeded 0, 7, 7, 0 (`--hash-seeds`), so that decisions taken in set order",
            "differ between ranks on stock torch (`ranks_decide_alike`); the others let each",
            "rank draw its own seed.",
            "On 2.13.0 the OpInfos the first run found crashing or wrong after `apply_all()`",
            "were validated again after the fixes they led to (`--merge`). Cell keys name one",
            "layout per mesh dim. An OpInfo whose ranks hang is run again one pattern at a",
            "time: the lists name the patterns that hang, and the others count. Stock runs",
            "keep the collective fix `empty_shard_padding` (2.9 only): without it the",
            "validator's own gathers of shards empty along another dim hang. The tripwires run",
            "on 2 ranks and cannot replay these cells; `tests/test_cells.py` replays them on a",
            "2x2 mesh on every release in CI (every routed one on stock torch).",
            "",
        ]
        lines += _mesh_tables(mesh.get("releases", {}), f" ({shape})")
    return "\n".join(lines) + "\n"


def _by_release(entries: dict[str, Any]) -> list[str]:
    """The releases of ``entries``, oldest first."""
    from packaging.version import Version

    return sorted(entries, key=Version)


def _mesh_tables(entries: dict[str, Any], suffix: str = "") -> list[str]:
    """The summary, by-family and per-release sections of one mesh's entries."""
    from packaging.version import Version

    releases = sorted(entries, key=Version)
    data = {"releases": entries}
    lines = [
        "| release | OpInfos | wrong cells | confirmed alone | context only | fixed by patches | "
        "routed | routed: a clear error | routed, still wrong | wrong in samples after "
        "`apply_all()` | only with patches | crashed: stock | crashed: `apply_all()` |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for release in releases:
        entry = data["releases"][release]
        cells = entry["cells"]
        confirmed = sum(c.get("replays_alone", False) for c in cells)
        routed = sum(c["routed"] for c in cells)
        lines.append(
            f"| {entry['torch']} | {entry['opinfos']} | {len(cells)} | {confirmed} | "
            f"{len(cells) - confirmed} | {confirmed - routed} | {routed} | "
            f"{len(entry.get('routed_clear_errors', []))} | "
            f"{len(entry.get('routed_after_apply_all', []))} | {len(entry['after_apply_all'])} | "
            f"{len(entry['introduced_by_patches'])} | {len(entry['crashed_or_timed_out'])} | "
            f"{len(entry.get('crashed_after_apply_all', []))} |"
        )
    lines += ["", f"## By op family (stock / after `apply_all()`){suffix}", ""]
    families = sorted({c["family"] for r in releases for c in data["releases"][r]["cells"]})
    lines.append("| family | " + " | ".join(releases) + " |")
    lines.append("|---|" + "---|" * len(releases))
    for family in families:
        row = []
        for release in releases:
            entry = data["releases"][release]
            stock = sum(c["family"] == family for c in entry["cells"])
            after = entry.get("families_after_apply_all", {}).get(family, 0)
            row.append(f"{stock} / {after}")
        lines.append(f"| {family} | " + " | ".join(row) + " |")
    for release in releases:
        entry = data["releases"][release]
        lines += ["", f"## {entry['torch']}{suffix}", ""]
        if not entry["cells"]:
            lines.append("No wrong cell found.")
        for cell in entry["cells"]:
            if cell.get("hangs_alone_on_stock"):
                how = "hangs when replayed alone on stock torch: not routed"
            elif not cell.get("replays_alone", False):
                how = "wrong only in its sample's context: not routed"
            else:
                how = "routed" if cell["routed"] else "fixed by the hand-written patches"
            lines.append(
                f"- `{cell['key']}` ({cell['family']}, {how}): {cell['problem']} "
                f"[{cell['found_by']}]"
            )
        for title, items in (
            (
                "Routed, and still wrong replayed alone after `apply_all()`",
                entry.get("routed_after_apply_all", []),
            ),
            (
                "Routed, and a clear error after `apply_all()` (no correct result exists: an "
                "in-place write cannot change a DTensor's shape)",
                entry.get("routed_clear_errors", []),
            ),
            ("Still wrong in the samples after `apply_all()`", entry["after_apply_all"]),
            ("Wrong only with the patches applied", entry["introduced_by_patches"]),
            ("Wrong at the end with no single call wrong (stock)", entry["unattributed_stock"]),
            (
                "Wrong at the end with no single call wrong (after `apply_all()`)",
                entry["unattributed_after_apply_all"],
            ),
            (
                "OpInfos whose ranks crashed or hung on stock torch (not validated there)",
                _with_patterns(entry["crashed_or_timed_out"], entry.get("failed_patterns", {})),
            ),
            (
                "OpInfos whose ranks crashed or hung after `apply_all()` (not validated)",
                _with_patterns(
                    entry.get("crashed_after_apply_all", []),
                    entry.get("failed_patterns_after_apply_all", {}),
                ),
            ),
        ):
            if items:
                lines += ["", f"{title}:", ""] + [f"- {item}" for item in items]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.validate.table", description=__doc__)
    parser.add_argument("--torch", required=True, help="the release measured, e.g. 2.13.0")
    parser.add_argument("--stock", type=Path)
    parser.add_argument("--patched", type=Path)
    parser.add_argument("--final", type=Path)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--docs", type=Path, default=DOCS)
    parser.add_argument(
        "--merge",
        action="store_true",
        help="the runs cover some OpInfos only: replace what those found in the release's "
        "entry and keep the rest (merge_entry)",
    )
    parser.add_argument(
        "--mesh",
        help="the runs were on this 2-D mesh (2x2): their entry goes under data['meshes']",
    )
    parser.add_argument(
        "--hash-seeds",
        help="the runs' --hash-seeds (each rank's PYTHONHASHSEED): replays use them too",
    )
    args = parser.parse_args(argv)
    seeds = tuple(int(s) for s in args.hash_seeds.split(",")) if args.hash_seeds else None
    from packaging.version import Version

    data = json.loads(args.data.read_text()) if args.data.exists() else {"releases": {}}
    mesh_shape = tuple(int(n) for n in args.mesh.split("x")) if args.mesh else ()
    entries = (
        data.setdefault("meshes", {}).setdefault(args.mesh, {}).setdefault("releases", {})
        if args.mesh
        else data.setdefault("releases", {})
    )
    if args.stock is not None:
        version = Version(args.torch)
        release = f"{version.major}.{version.minor}"
        stock = _read(args.stock)
        entry = release_entry(
            args.torch,
            stock,
            _read(args.patched),
            _read(args.final),
            mesh_shape=mesh_shape,
            hash_seeds=seeds,
        )
        old = entries.get(release)
        if args.merge and old is not None:
            entry = merge_entry(old, entry, {r["opinfo"] for r in stock})
        entries[release] = entry
    args.data.write_text(json.dumps(data, indent=None, separators=(",", ":")) + "\n")
    if args.stock is not None and args.final is not None:
        # Now that the data routes them, each routed cell replayed alone with everything on.
        entry = entries[f"{version.major}.{version.minor}"]
        routed = {c["key"]: c["call"] for c in entry["cells"] if c["routed"]}
        after = replays(routed, "all", mesh_shape, hash_seeds=seeds)
        entry["routed_after_apply_all"] = sorted(
            k for k, v in after.items() if v is not None and not v.startswith("raises")
        )
        entry["routed_clear_errors"] = sorted(
            f"{k}: {v}" for k, v in after.items() if v is not None and v.startswith("raises")
        )
        args.data.write_text(json.dumps(data, indent=None, separators=(",", ":")) + "\n")
    args.docs.write_text(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())

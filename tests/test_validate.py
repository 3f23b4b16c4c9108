"""The strategy validator (``python -m tools.validate``) on a real 2-rank gloo mesh: it finds
a wrong cell stock torch has on every release (``fill_`` of a ``Partial(sum)`` target, which
fills every rank's share: the ``inplace_writes`` patch fixes it), records a call that replays
alone, and finds nothing with ``apply_all()``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from dtensor_patches.testing import RankPool

if TYPE_CHECKING:
    from tools.validate.runner import Options

pytest.importorskip("expecttest", reason="torch's op_db needs expecttest")


def _run(
    apply_patches: bool, patterns: tuple[str, ...] = ("R", "P.sum"), mesh_shape: tuple = ()
) -> list[dict]:
    from tools.validate.runner import Options, validate_ops

    options = Options(
        patterns=patterns,
        variants=("inplace",),
        backward=False,
        max_samples=1,
        apply_patches=apply_patches,
        mesh_shape=mesh_shape,
    )
    try:
        return validate_ops(["fill"], options)
    finally:
        import dtensor_patches

        dtensor_patches.revert_all()


def _replays(call: dict) -> str | None:
    from dtensor_patches.cell_replay import replay
    from dtensor_patches.testing import world_mesh

    return replay(call, world_mesh())


def test_the_validator_finds_a_stock_wrong_cell_and_records_its_call(pool2: RankPool) -> None:
    records = pool2.run(_run, False)
    timeless = [[{k: v for k, v in r.items() if k != "seconds"} for r in rank] for rank in records]
    assert timeless[0] == timeless[1], "every rank returns the same record"
    cells = {c["key"]: c for c in records[0][0]["cells"]}
    assert "aten.fill_.Scalar(P.sum)" in cells, sorted(cells)
    cell = cells["aten.fill_.Scalar(P.sum)"]
    assert "values differ" in cell["problem"] and cell["call"] is not None
    # The recorded call alone shows the same wrong result on stock torch, on every rank.
    problems = pool2.run(_replays, cell["call"])
    assert problems[0] is not None and problems[0] == problems[1]


def test_the_validator_finds_nothing_wrong_with_apply_all(pool2: RankPool) -> None:
    records = pool2.run(_run, True)
    assert records[0][0]["cells"] == [], records[0][0]["cells"]
    assert records[0][0]["outcomes"].get("ok", 0) > 0


_PATTERNS_2X2 = ("R/P.sum", "S0/P.sum")


def _replays_2x2(call: dict) -> str | None:
    from dtensor_patches.cell_replay import replay
    from dtensor_patches.testing import grid_mesh

    return replay(call, grid_mesh((2, 2)))


def test_the_validator_finds_a_2x2_mesh_cell_and_replays_it_there(pool4: RankPool) -> None:
    """The same cell on a 2x2 mesh: a pending sum over the second mesh dim, under a replicated
    or sharded first one; its key names both mesh dims and its call replays on 2x2."""
    records = pool4.run(_run, False, _PATTERNS_2X2, (2, 2))
    cells = {c["key"]: c for c in records[0][0]["cells"]}
    assert "aten.fill_.Scalar(R/P.sum)" in cells, sorted(cells)
    call = cells["aten.fill_.Scalar(R/P.sum)"]["call"]
    assert call is not None and call["mesh"] == [2, 2]
    problems = pool4.run(_replays_2x2, call)
    assert problems[0] is not None and len(set(problems)) == 1
    patched = pool4.run(_run, True, _PATTERNS_2X2, (2, 2))
    assert patched[0][0]["cells"] == [], patched[0][0]["cells"]
    assert patched[0][0]["outcomes"].get("ok", 0) > 0


def _hangs_on_s1(keys: list[str], options: Options) -> list[dict]:
    """A stand-in for ``validate_ops`` whose ranks hang on the pattern ``S1``."""
    import time

    if "S1" in options.patterns:
        time.sleep(600)
    return [
        {
            "opinfo": keys[0],
            "outcomes": {"ok": len(options.patterns)},
            "cells": [{"key": f"cell under {p}"} for p in options.patterns if p == "S0"],
            "unattributed": [],
        }
    ]


def _record_of_run(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    stand_in: Any,
    patterns: tuple[str, ...],
    pattern_timeout: float,
) -> dict[str, Any]:
    """The one record ``tools.validate`` writes for OpInfo ``x`` with ``stand_in`` as
    ``validate_ops`` on 2 real ranks (op timeout 5 s)."""
    import json

    import tools.validate.__main__ as cli
    from tools.validate.runner import Options

    monkeypatch.setattr(cli, "validate_ops", stand_in)
    out = tmp_path / "run.jsonl"
    cli.run(
        ["x"], Options(patterns=patterns), out, 2, op_timeout=5, pattern_timeout=pattern_timeout
    )
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    return record


@pytest.mark.slow
def test_a_hanging_pattern_is_named_and_the_other_patterns_still_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = _record_of_run(tmp_path, monkeypatch, _hangs_on_s1, ("R", "S1", "S0"), 5)
    assert record["failed_patterns"] == {"S1": "timeout"}
    assert record["outcomes"] == {"ok": 2, "timeout": 1}
    assert record["cells"] == [{"key": "cell under S0"}]

    from tools.validate.table import _crashed, _with_patterns

    assert _crashed([record]) == ["x"]
    (line,) = _with_patterns(["x"], {"x": record["failed_patterns"]})
    assert "`S1` timeout" in line


def _slow_as_a_whole(keys: list[str], options: Options) -> list[dict]:
    import time

    if len(options.patterns) > 1:
        time.sleep(600)  # the whole OpInfo outlasts op_timeout; each pattern alone does not
    return [
        {"opinfo": keys[0], "outcomes": {"ok": 1}, "cells": [], "unattributed": []},
    ]


@pytest.mark.slow
def test_an_opinfo_whose_every_pattern_passes_alone_is_not_listed_as_crashed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tools.validate.table import _crashed

    record = _record_of_run(tmp_path, monkeypatch, _slow_as_a_whole, ("R", "S0"), 30)
    assert record["outcomes"] == {"ok": 2}
    assert record["failed_patterns"] == {}
    assert record["whole_run"] == "timeout"
    assert _crashed([record]) == []

"""The op-database sweep (``python -m tools.sweep``) on a real 2-rank gloo mesh."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from dtensor_patches.testing import RankPool
from tools import sweep

pytest.importorskip("expecttest", reason="torch's op_db needs expecttest")

TORCH_2_9 = torch.__version__.startswith("2.9")


@pytest.fixture(scope="module")
def rows(pool2: RankPool) -> dict[tuple[str, str], dict[str, Any]]:
    """One sweep of a few chosen ops, shared by the tests below: (op, placement) -> row."""
    keys = [key for key, _, reason in sweep.list_ops(["add", "argmax", "logsumexp", "nonzero"])]
    assert sorted(keys) == ["add", "argmax", "logsumexp", "nonzero"]
    options = sweep.Options(
        placements=(*sweep.PLACEMENTS, "Partial()"), max_samples=3, max_candidates=20
    )
    per_rank = pool2.run(sweep.sweep_ops, keys, options)
    timeless = [[{k: v for k, v in r.items() if k != "seconds"} for r in rows] for rows in per_rank]
    assert timeless[0] == timeless[1], "ranks must agree on the merged rows"
    return {(r["op"], r["placement"]): r for r in per_rank[0]}


def test_add_is_ok_everywhere(rows: dict[tuple[str, str], dict[str, Any]]) -> None:
    for placement in (*sweep.PLACEMENTS, "Partial()"):
        row = rows[("add", placement)]
        assert row["outcome"] == "ok", row
        assert row["samples"] == 3
        assert not row["rank_mismatch"]


@pytest.mark.parametrize("op", ["argmax", "logsumexp"])
def test_reductions_match_release(rows: dict[tuple[str, str], dict[str, Any]], op: str) -> None:
    """argmax/logsumexp have no sharding strategy on torch 2.9 (docs/design.md §1) only."""
    if TORCH_2_9:
        for placement in sweep.PLACEMENTS:
            row = rows[(op, placement)]
            assert row["outcome"] == "no-strategy", row
            assert row["aten_op"].startswith(f"aten.{op}."), row
        return
    for placement in sweep.PLACEMENTS:
        assert rows[(op, placement)]["outcome"] != "no-strategy", rows[(op, placement)]
    assert rows[(op, "Replicate()")]["outcome"] == "ok"
    if op == "logsumexp":
        assert all(rows[(op, p)]["outcome"] == "ok" for p in sweep.PLACEMENTS)


def test_nonzero_raises(rows: dict[tuple[str, str], dict[str, Any]]) -> None:
    """Data-dependent output shape: fails before any strategy lookup, on every release."""
    for placement in sweep.PLACEMENTS:
        row = rows[("nonzero", placement)]
        assert row["outcome"] in ("raises", "no-strategy"), row
        assert row["aten_op"] == "aten.nonzero.default", row


def test_writers(tmp_path: Any, rows: dict[tuple[str, str], dict[str, Any]]) -> None:
    report = {
        "torch": torch.__version__,
        "world_size": 2,
        "options": {"placements": list(sweep.PLACEMENTS), "max_samples": 3},
        "seconds": 1.0,
        "ops_swept": 4,
        "rows": list(rows.values()),
        "skipped_ops": [{"op": "bernoulli", "reason": "random"}],
    }
    path = tmp_path / "sweep.json"
    sweep.write_json(report, str(path))
    assert json.loads(path.read_text()) == report
    text = sweep.render_markdown(report)
    assert "## data-dependent output shape" in text
    assert "`nonzero`" in text and "`aten.nonzero.default`" in text
    assert "| `add` |" not in text  # ok rows are not listed
    assert "`bernoulli` (random)" in text
    if TORCH_2_9:
        assert "## reductions" in text
    baseline = json.loads(json.dumps(report))
    for row in baseline["rows"]:
        if row["op"] == "add" and row["placement"] == "Shard(0)":
            row["outcome"] = "no-strategy"
    changed = sweep.render_markdown(report, baseline)
    assert "## Changed from the baseline" in changed
    assert "| `add` | function | `Shard(0)` | no-strategy | ok |" in changed, changed


def test_skip_list_and_categories() -> None:
    assert sweep.skip_reason("nn.functional.dropout2d") == "random"
    assert sweep.skip_reason("empty_like") == "uninitialised output"
    assert sweep.skip_reason("add") is None
    assert sweep.categorize("cumprod") == "scans"
    assert sweep.categorize("nonzero") == "data-dependent output shape"
    assert sweep.categorize("nn.functional.mse_loss") == "losses"
    assert sweep.categorize("nn.functional.scaled_dot_product_attention") == "attention"
    assert sweep.categorize("sin") == sweep.DEFAULT_CATEGORY


def test_compare_outputs() -> None:
    x = torch.tensor([1.0, float("nan")])
    assert sweep._compare(x.clone(), x) is None
    assert "values differ" in sweep._compare(x + 1, x)
    assert "shape" in sweep._compare(x[:1], x)
    assert sweep._compare((x, 3), (x.clone(), 3)) is None
    assert sweep._compare(torch.Size([2]), torch.Size([3])) is not None
    assert "values differ" in sweep._compare(torch.tensor([1, 2]), torch.tensor([1, 3]))


def test_cli_summary(capsys: pytest.CaptureFixture[str]) -> None:
    report = {
        "torch": "x",
        "seconds": 0.0,
        "rows": [
            {
                "op": "nonzero",
                "variant": "function",
                "placement": "Shard(0)",
                "outcome": "raises",
                "error_type": "RuntimeError",
                "error": "aten.nonzero.default",
            },
            {
                "op": "add",
                "variant": "function",
                "placement": "Shard(0)",
                "outcome": "ok",
                "error_type": "",
                "error": "",
            },
        ],
    }
    sweep._print_summary(report)
    out = capsys.readouterr().out
    assert "nonzero" in out and "add" not in out.split("\n", 2)[2]

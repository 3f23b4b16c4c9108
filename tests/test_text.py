"""The CLI's text layout: gates lower bound first, op lists and cells that fit their width."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from packaging.specifiers import SpecifierSet

from dtensor_patches import all_patches
from dtensor_patches._text import clip, format_gate, row_line, short_op, short_ops, table


@pytest.mark.parametrize(
    ("gate", "text"),
    [
        ("<2.10,>=2.9", ">=2.9,<2.10"),
        (">=2.9", ">=2.9"),
        ("!=2.11.0,<2.14,>=2.9", ">=2.9,<2.14,!=2.11.0"),
        ("", "any"),
    ],
)
def test_format_gate_puts_the_lower_bound_first(gate: str, text: str) -> None:
    assert format_gate(SpecifierSet(gate)) == text


def test_format_gate_keeps_every_registered_gate() -> None:
    for patch in all_patches():
        assert SpecifierSet(format_gate(patch.gate)) == patch.gate


def test_short_op() -> None:
    assert short_op("aten.alias.default") == "alias"
    assert short_op("aten.std.correction") == "std.correction"


@given(
    st.lists(
        st.from_regex(r"aten\.[a-z_]{1,20}\.(default|Tensor|out)", fullmatch=True),
        min_size=1,
        max_size=40,
    ),
    st.integers(min_value=12, max_value=80),
)
def test_short_ops_fit_and_count_what_they_drop(ops: list[str], width: int) -> None:
    text = short_ops(ops, width)
    assert len(text) <= width
    if text.endswith(" more"):
        shown = text.rsplit(", +", 1)[0].split(", ")
        hidden = int(text.rsplit("+", 1)[1].split()[0])
        assert [short_op(op) for op in ops[: len(shown)]] == shown
        assert len(shown) + hidden == len(ops)
    else:
        assert text == ", ".join(short_op(op) for op in ops)


@given(st.text(min_size=0, max_size=200), st.integers(min_value=3, max_value=100))
def test_clip_fits(text: str, width: int) -> None:
    out = clip(text, width)
    assert len(out) <= width
    assert "\n" not in out


def test_table_fits_with_a_flexible_column() -> None:
    rows = [["ok", "alias", "x" * 300], ["stale", "count_nonzero", "short"]]
    head, widths = table(["verdict", "patch", "detail"], rows, flexible=2, width=60)
    lines = head + [row_line(r, widths) for r in rows]
    assert max(len(line) for line in lines) <= 60
    assert lines[2].startswith("ok       alias          ") and lines[2].endswith("...")

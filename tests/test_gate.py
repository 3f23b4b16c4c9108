"""Version gates compare releases, whatever pre-release, dev or local label torch carries."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from packaging.specifiers import SpecifierSet

from dtensor_patches import get
from tests import synthetic


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("2.9.0", True),
        ("2.9.1", True),
        ("2.9.1+cu128", True),
        ("2.9.0a0+git1234abc", True),
        ("2.9.0.dev20250901+cpu", True),
        ("2.8.0", False),
        ("2.10.0", False),
        ("2.10.0a0+gitdeadbee", False),
        ("2.13.0+cpu", False),
        ("2.14.1+cu130", False),
    ],
)
def test_alias_gate_on_real_version_strings(version: str, expected: bool) -> None:
    assert get("alias").applies_to(version) is expected


suffixes = st.sampled_from(
    ["", "+cpu", "+cu130", "a0+git0123abc", ".dev20260101", "rc1", "+rocm6.4"]
)


@given(minor=st.integers(0, 30), micro=st.integers(0, 9), suffix=suffixes)
def test_gate_depends_only_on_release(minor: int, micro: int, suffix: str) -> None:
    patch = synthetic.make().with_gate(">=2.9,<2.13")
    assert patch.applies_to(f"2.{minor}.{micro}{suffix}") is (9 <= minor < 13)


def test_with_gate_copies_and_keeps_registered_patch() -> None:
    original = get("alias")
    wider = original.with_gate(">=2.9")
    assert wider.gate == SpecifierSet(">=2.9")
    assert original.gate == SpecifierSet(">=2.9,<2.10")
    assert wider is not original and not wider.is_applied

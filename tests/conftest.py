"""Shared fixtures: long-lived CPU gloo process groups (2 and 4 ranks) for the whole session,
and the hypothesis profiles (``HYPOTHESIS_PROFILE=dev`` for more examples locally)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import settings

from dtensor_patches.testing import RankPool

settings.register_profile("ci", max_examples=6, derandomize=True)
settings.register_profile("dev", max_examples=60)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def pool2() -> Iterator[RankPool]:
    """Two spawned ranks with a gloo process group, shared by every test that needs one."""
    with RankPool(2, timeout=300) as pool:
        yield pool


@pytest.fixture(scope="session")
def pool4() -> Iterator[RankPool]:
    """Four spawned ranks (1-D mesh of 4, or 2x2), shared by every test that needs one."""
    with RankPool(4, timeout=120) as pool:
        yield pool

"""Shared fixtures: one long-lived 2-rank CPU gloo process group for the whole session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dtensor_patches.testing import RankPool


@pytest.fixture(scope="session")
def pool2() -> Iterator[RankPool]:
    """Two spawned ranks with a gloo process group, shared by every test that needs one."""
    with RankPool(2) as pool:
        yield pool

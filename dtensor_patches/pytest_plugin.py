"""pytest plugin: ``pytest --dtensor-patches-check`` fails when a patch went stale.

Registered through the ``pytest11`` entry point and off by default. With the flag, one test
item per registered patch is added to the session (``dtensor-patches::<name>``); all the
tripwires run once, in fresh spawned processes on a CPU gloo mesh, and each item reports its
patch's verdict. A downstream project thus learns the day a torch upgrade makes a patch stale
(upstream fixed it) or shows a gate too narrow (a release outside the gate still has the bug).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

_OPTION = "--dtensor-patches-check"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("dtensor-patches")
    group.addoption(
        _OPTION,
        action="store_true",
        default=False,
        help="run dtensor_patches tripwires: fail when a patch is stale or its gate too narrow",
    )
    group.addoption(
        "--dtensor-patches-gate",
        action="append",
        default=[],
        metavar="NAME=SPEC",
        help="check a proposed gate for a patch instead of its registered one",
    )
    group.addoption(
        "--dtensor-patches-world-size",
        type=int,
        default=2,
        help="ranks of the CPU gloo mesh the tripwires run on (default 2)",
    )


class TripwireFailure(Exception):
    """A patch's tripwire tripped."""


class _Tripwires:
    """Runs every tripwire once per session, on first use."""

    def __init__(self, world_size: int, gate_overrides: dict[str, str]) -> None:
        self.world_size = world_size
        self.gate_overrides = gate_overrides
        self._results: dict[str, Any] | None = None

    def result(self, name: str) -> Any:
        if self._results is None:
            from dtensor_patches.tripwire import run_tripwires

            self._results = {
                r.patch: r
                for r in run_tripwires(
                    world_size=self.world_size, gate_overrides=self.gate_overrides
                )
            }
        return self._results[name]


class TripwireItem(pytest.Item):
    def __init__(self, *, tripwires: _Tripwires, patch_name: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tripwires = tripwires
        self.patch_name = patch_name

    def runtest(self) -> None:
        result = self.tripwires.result(self.patch_name)
        if not result.passed:
            raise TripwireFailure(result.message)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, TripwireFailure):
            return f"dtensor-patches tripwire: {excinfo.value}"
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[str, int | None, str]:
        return "dtensor-patches", None, f"dtensor-patches::{self.patch_name}"


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    if not config.getoption(_OPTION):
        return
    from dtensor_patches import registry
    from dtensor_patches.cli import parse_gate_overrides

    try:
        overrides = parse_gate_overrides(config.getoption("--dtensor-patches-gate"))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from exc
    tripwires = _Tripwires(config.getoption("--dtensor-patches-world-size"), overrides)
    items.extend(_items(session, tripwires, [p.name for p in registry.all_patches()]))


def _items(
    session: pytest.Session, tripwires: _Tripwires, names: list[str]
) -> Iterator[pytest.Item]:
    for name in names:
        yield TripwireItem.from_parent(
            session, name=f"dtensor-patches::{name}", tripwires=tripwires, patch_name=name
        )

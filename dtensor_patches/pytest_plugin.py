"""pytest plugin: ``pytest --dtensor-patches-check`` fails when a patch went stale.

Registered through the ``pytest11`` entry point and off by default. With the flag, the session
collects one test item per registered patch, ``dtensor_patches::<name>`` (``-k alias``,
``--deselect dtensor_patches::alias`` and the collected/selected counts work as for any
test). Each item runs its own patch's tripwire on a CPU gloo mesh of spawned ranks; the ranks
start once per session, on the first tripwire item that runs, and only if one does. A
downstream project thus learns the day a torch upgrade makes a patch stale (upstream fixed it)
or shows a gate too narrow (a release outside the gate still has the bug).

torch's warnings during a tripwire are not printed; a failing item's report lists the ones of
its own run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from dtensor_patches.testing import RankPool
    from dtensor_patches.tripwire import TripwireResult

_OPTION = "--dtensor-patches-check"
_NODE = "dtensor_patches"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("dtensor-patches")
    group.addoption(
        _OPTION,
        action="store_true",
        default=False,
        help="collect one test per dtensor_patches patch (dtensor_patches::<name>) that runs "
        "its tripwire: fails when the patch is stale, its gate too narrow, or it does not fix "
        "its bug",
    )
    group.addoption(
        "--dtensor-patches-gate",
        action="append",
        default=[],
        metavar="NAME=SPEC",
        help="check a proposed gate for a patch instead of its registered one (repeatable)",
    )
    group.addoption(
        "--dtensor-patches-world-size",
        type=int,
        default=2,
        help="ranks of the CPU gloo mesh the tripwires run on (default 2)",
    )


class TripwireFailure(Exception):
    """A patch's tripwire tripped."""


class _Ranks:
    """The session's tripwire ranks: started by the first item that needs them, closed at the
    end of the session (or after a timeout, then started again by the next item)."""

    def __init__(self, world_size: int, gate_overrides: dict[str, str]) -> None:
        self.world_size = world_size
        self.gate_overrides = gate_overrides
        self._pool: RankPool | None = None

    def run(self, name: str) -> TripwireResult:
        from dtensor_patches.tripwire import run_one, start_pool

        if self._pool is None or self._pool.closed:
            self._pool = start_pool(self.world_size)
        return run_one(self._pool, name, self.gate_overrides)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


class TripwireCollector(pytest.Collector):
    """``dtensor_patches``: one :class:`TripwireItem` per registered patch."""

    def __init__(self, *, ranks: _Ranks, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ranks = ranks

    def collect(self) -> Iterator[pytest.Item]:
        from dtensor_patches import registry

        for patch in registry.all_patches():
            yield TripwireItem.from_parent(self, name=patch.name, ranks=self.ranks)


class TripwireItem(pytest.Item):
    """``dtensor_patches::<name>``: runs one patch's tripwire."""

    def __init__(self, *, ranks: _Ranks, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ranks = ranks
        self.result: TripwireResult | None = None

    def runtest(self) -> None:
        self.result = self.ranks.run(self.name)
        if self.result.warnings:
            self.add_report_section(
                "call", "torch warnings (hidden)", "\n".join(self.result.warnings)
            )
        if not self.result.passed:
            raise TripwireFailure(self.result.message)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, TripwireFailure):
            return f"dtensor-patches tripwire: {excinfo.value}"
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[str, int | None, str]:
        return _NODE, None, self.nodeid


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    # The tripwires join the session's top-level collectors, so they are collected (and
    # counted, selected, deselected) like any test, before -k/-m/--deselect apply.
    report = yield
    config = collector.config
    if isinstance(collector, pytest.Session) and config.getoption(_OPTION) and report.passed:
        report.result.append(
            TripwireCollector.from_parent(
                collector, name=_NODE, nodeid=_NODE, ranks=config.stash[_RANKS]
            )
        )
    return report


_RANKS = pytest.StashKey[_Ranks]()


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption(_OPTION, default=False):
        return
    from dtensor_patches.cli import parse_gate_overrides

    try:
        overrides = parse_gate_overrides(config.getoption("--dtensor-patches-gate"))
        if overrides:
            from dtensor_patches import registry

            for name in overrides:
                registry.get(name)
    except (KeyError, ValueError) as exc:
        raise pytest.UsageError(f"--dtensor-patches-gate: {exc.args[0]}") from exc
    world_size = config.getoption("--dtensor-patches-world-size")
    if world_size < 2:
        raise pytest.UsageError(
            f"--dtensor-patches-world-size must be >= 2 (a multi-rank mesh), got {world_size}"
        )
    ranks = _Ranks(world_size, overrides)
    config.stash[_RANKS] = ranks
    config.add_cleanup(ranks.close)

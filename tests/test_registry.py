"""apply_all / revert_all / patched against torch's real registry, in this process."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

import dtensor_patches
from dtensor_patches import PatchError, Status, registry
from dtensor_patches._torch import tables as torch_tables
from dtensor_patches._torch.schemas import resolve_op
from dtensor_patches._torch.versions import torch_version
from tests import synthetic

ALIAS = registry.get("alias")


def _state() -> dict[str, dict[object, object]]:
    return torch_tables.registry_state()


@pytest.fixture(autouse=True)
def _clean_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts and ends with no patch applied and torch's registry untouched."""
    monkeypatch.delenv(registry.DISABLE_ENV, raising=False)
    before = _state()
    yield
    dtensor_patches.revert_all()
    assert _state() == before


@pytest.fixture
def with_synthetic(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Registry = [alias, synthetic]; returns the list of synthetic installs."""
    op = resolve_op(synthetic.OP)
    if torch_tables.has_native_strategy(op):  # pragma: no cover - would need a new stand-in op
        pytest.skip(f"{synthetic.OP} got a native strategy in this torch")
    calls: list[str] = []
    patches = (ALIAS, synthetic.make(calls=calls))
    monkeypatch.setattr(registry, "all_patches", lambda: patches)
    return calls


def test_report_covers_every_patch_and_alias_follows_its_gate() -> None:
    report = dtensor_patches.apply_all()
    assert [o.name for o in report] == [p.name for p in registry.all_patches()]
    expected = Status.APPLIED if ALIAS.applies_to() else Status.GATED_OUT
    assert report["alias"].status is expected
    assert report.torch_version == str(torch_version())


def test_second_call_changes_nothing(with_synthetic: list[str]) -> None:
    first = dtensor_patches.apply_all()
    state = _state()
    second = dtensor_patches.apply_all()
    assert first["synthetic"].status is Status.APPLIED
    assert second["synthetic"].status is Status.ALREADY_APPLIED
    assert not second.changed
    assert _state() == state
    assert with_synthetic == ["synthetic"]


def test_apply_all_from_eight_threads_applies_each_patch_once(with_synthetic: list[str]) -> None:
    barrier = threading.Barrier(8)
    reports: list[dtensor_patches.Report] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            barrier.wait()
            reports.append(dtensor_patches.apply_all())
        except BaseException as exc:  # noqa: BLE001 - collected and asserted on below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    statuses = [r["synthetic"].status for r in reports]
    assert statuses.count(Status.APPLIED) == 1
    assert statuses.count(Status.ALREADY_APPLIED) == 7
    assert with_synthetic == ["synthetic"]
    if ALIAS.applies_to():
        assert [r["alias"].status for r in reports].count(Status.APPLIED) == 1


def test_revert_all_restores_exact_registry(with_synthetic: list[str]) -> None:
    op = resolve_op(synthetic.OP)
    before = _state()
    dtensor_patches.apply_all()
    assert op in torch_tables.sharding_propagator().op_strategy_funcs
    assert _state() != before
    assert dtensor_patches.revert_all()[-1] == "alias" or ALIAS.applies_to() is False
    assert _state() == before
    assert op not in torch_tables.sharding_propagator().op_strategy_funcs


def test_revert_restores_a_preexisting_entry_instead_of_deleting_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    op = resolve_op(synthetic.OP)
    table = torch_tables.sharding_propagator().op_strategy_funcs

    def someone_elses(op_schema: object) -> object:  # pragma: no cover - never dispatched
        raise AssertionError

    table[op] = someone_elses
    try:
        patch = synthetic.make()
        patch.overrides_existing = True
        monkeypatch.setattr(registry, "all_patches", lambda: (patch,))
        assert dtensor_patches.apply_all()["synthetic"].status is Status.APPLIED
        assert table[op] is not someone_elses
        dtensor_patches.revert_all()
        assert table[op] is someone_elses
    finally:
        del table[op]


def test_never_overrides_an_existing_strategy(monkeypatch: pytest.MonkeyPatch) -> None:
    wider = ALIAS.with_gate(">=2.0")
    monkeypatch.setattr(registry, "all_patches", lambda: (wider,))
    native = torch_tables.has_native_strategy(resolve_op("aten.alias.default"))
    before = _state()
    report = dtensor_patches.apply_all(fallback="off")  # the fallback changes torch by design
    if native:
        assert report["alias"].status is Status.SKIPPED_NATIVE
        assert "aten.alias.default" in report["alias"].reason
        assert _state() == before
    else:
        assert report["alias"].status is Status.APPLIED


def test_failed_patch_leaves_torch_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = synthetic.make("broken", fail_after_install=True)
    monkeypatch.setattr(registry, "all_patches", lambda: (broken,))
    before = _state()
    report = dtensor_patches.apply_all(fallback="off")  # the fallback changes torch by design
    assert report["broken"].status is Status.FAILED
    assert "simulated failure" in report["broken"].reason
    assert not broken.is_applied
    assert _state() == before


def test_strict_raises_and_rolls_back_the_whole_call(monkeypatch: pytest.MonkeyPatch) -> None:
    good = synthetic.make("good")
    broken = synthetic.make("broken", op="aten.resolve_neg.default", fail_after_install=True)
    monkeypatch.setattr(registry, "all_patches", lambda: (good, broken))
    before = _state()
    with pytest.raises(PatchError, match="broken"):
        dtensor_patches.apply_all(strict=True)
    assert not good.is_applied
    assert _state() == before


def test_missing_internal_fails_loudly_and_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    patch = synthetic.make()
    monkeypatch.setattr(registry, "all_patches", lambda: (patch,))
    with monkeypatch.context() as moved:
        moved.setattr(torch_tables, "sharding_propagator", lambda: object())
        report = dtensor_patches.apply_all()
        with pytest.raises(PatchError) as info:
            torch_tables.registry_state()
    assert report["synthetic"].status is Status.FAILED
    assert "op_strategy_funcs" in report["synthetic"].reason
    assert info.value.internal == "propagator.op_strategy_funcs"
    assert not patch.is_applied


def test_only_exclude_and_bad_names(with_synthetic: list[str]) -> None:
    report = dtensor_patches.apply_all(exclude=["synthetic"])
    assert report["synthetic"].status is Status.EXCLUDED
    report = dtensor_patches.apply_all(only=["alias"])
    assert report["synthetic"].status is Status.EXCLUDED
    with pytest.raises(ValueError, match="nonexistent"):
        dtensor_patches.apply_all(only=["nonexistent"])
    with pytest.raises(ValueError, match="nonexistent"):
        dtensor_patches.apply_all(exclude=["nonexistent"])
    with pytest.raises(TypeError):
        dtensor_patches.apply_all(only="alias")  # type: ignore[arg-type]
    assert with_synthetic == []


def test_env_var_switches_patches_off(
    with_synthetic: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(registry.DISABLE_ENV, "synthetic")
    assert dtensor_patches.apply_all()["synthetic"].status is Status.DISABLED
    monkeypatch.setenv(registry.DISABLE_ENV, "all")
    report = dtensor_patches.apply_all()
    assert {o.status for o in report} == {Status.DISABLED}
    monkeypatch.setenv(registry.DISABLE_ENV, "synthetic,typo")
    with pytest.raises(ValueError, match="typo"):
        dtensor_patches.apply_all()
    assert with_synthetic == []


def test_patched_context_restores_previous_state(with_synthetic: list[str]) -> None:
    before = _state()
    with dtensor_patches.patched(only=["synthetic"]) as report:
        assert report["synthetic"].status is Status.APPLIED
        assert _state() != before
    assert _state() == before
    assert not registry.get("synthetic").is_applied


def test_patched_keeps_what_was_applied_before_it(with_synthetic: list[str]) -> None:
    dtensor_patches.apply_all(only=["synthetic"])
    applied = _state()
    with dtensor_patches.patched() as report:
        assert report["synthetic"].status is Status.ALREADY_APPLIED
    assert _state() == applied
    assert registry.get("synthetic").is_applied


def test_patched_exclude_takes_out_a_patch_applied_before_it(with_synthetic: list[str]) -> None:
    # "patched(exclude=[x])" means "without x" even after an apply_all() that applied x; on
    # exit x is back, with torch's tables as they were.
    dtensor_patches.apply_all(only=["synthetic"])
    applied = _state()
    with dtensor_patches.patched(exclude=["synthetic"]) as report:
        assert report["synthetic"].status is Status.EXCLUDED
        assert not registry.get("synthetic").is_applied
        assert _state() != applied
    assert registry.get("synthetic").is_applied
    assert _state() == applied
    with dtensor_patches.patched(only=["alias"]):
        assert not registry.get("synthetic").is_applied
    assert _state() == applied


def test_patched_with_bad_names_changes_nothing(with_synthetic: list[str]) -> None:
    dtensor_patches.apply_all(only=["synthetic"])
    applied = _state()
    with pytest.raises(ValueError, match="typo"):
        with dtensor_patches.patched(exclude=["synthetic", "typo"]):
            pass  # pragma: no cover - never entered
    assert registry.get("synthetic").is_applied
    assert _state() == applied


def test_plan_changes_nothing(with_synthetic: list[str]) -> None:
    before = _state()
    report = dtensor_patches.plan()
    assert report["synthetic"].status is Status.WOULD_APPLY
    assert _state() == before


def test_report_renders_and_serialises(with_synthetic: list[str]) -> None:
    report = dtensor_patches.apply_all()
    assert "synthetic  applied" in str(report)
    data = report.to_dict()
    assert data["patches"][1] == {"name": "synthetic", "status": "applied", "reason": ""}


def test_former_patch_names_warn_and_name_the_new_patch() -> None:
    with pytest.warns(DeprecationWarning, match="elementwise_losses"):
        assert registry.get("mse_loss") is registry.get("elementwise_losses")
    with pytest.warns(DeprecationWarning, match="elementwise_strategies"):
        report = dtensor_patches.plan(exclude=["pointwise_2_10"])
    assert report["elementwise_strategies"].status is Status.EXCLUDED


def test_former_module_names_warn_and_give_the_new_objects() -> None:
    import dtensor_patches.compat as old_compat
    from dtensor_patches._torch import schemas

    with pytest.warns(DeprecationWarning, match="dtensor_patches._torch.schemas.resolve_op"):
        assert old_compat.resolve_op is schemas.resolve_op
    with pytest.warns(DeprecationWarning, match="health"):
        status = dtensor_patches.status
    assert status is dtensor_patches.health
    with pytest.raises(AttributeError, match="ledger"):
        _ = old_compat.install_owned

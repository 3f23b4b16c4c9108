"""The worker's reading of ``apply_all()``'s report (issue 12 item 9)."""

from __future__ import annotations

import dataclasses
import logging

import pytest

import dtensor_patches
from dtensor_patches.registry import all_patches
from dtensor_patches.report import Outcome, Report, Status
from ppo_value import patch_needs
from ppo_value.patch_needs import CRITIC_PATCHES, PatchRequirementError, check_patch_report


def _with_failures(report: Report, failed: dict[str, str]) -> Report:
    outcomes = tuple(
        Outcome(o.name, Status.FAILED, failed[o.name]) if o.name in failed else o for o in report
    )
    return dataclasses.replace(report, outcomes=outcomes)


@pytest.fixture
def report(monkeypatch: pytest.MonkeyPatch) -> Report:
    monkeypatch.setattr(patch_needs, "_told", set())  # a fresh process: nothing told yet
    return dtensor_patches.plan()


def test_needed_patches_are_registered() -> None:
    assert CRITIC_PATCHES <= {p.name for p in all_patches()}


def test_this_torchs_report_passes(report: Report, caplog: pytest.LogCaptureFixture) -> None:
    # plan(), not apply_all(): the test process's torch stays unpatched (the workers' tests
    # build real workers, which call apply_all(), in their own rank processes).
    with caplog.at_level(logging.WARNING, logger="ppo_value.patch_needs"):
        check_patch_report(report)
    assert not caplog.records


def test_a_failed_needed_patch_is_an_error_naming_it(report: Report) -> None:
    bad = _with_failures(report, {"partial_item": "torch moved X", "nansum": "torch moved Y"})
    with pytest.raises(
        PatchRequirementError, match=r"1 patch\(es\).*partial_item: torch moved X"
    ) as e:
        check_patch_report(bad)
    assert "nansum" not in str(e.value)


def test_other_failures_are_one_plain_warning(
    report: Report, caplog: pytest.LogCaptureFixture
) -> None:
    bad = _with_failures(report, {"nansum": "torch moved Y", "unfold": "torch moved Z"})
    with caplog.at_level(logging.WARNING, logger="ppo_value.patch_needs"):
        check_patch_report(bad)
        check_patch_report(bad)  # a second worker in the same process: nothing new to say
        check_patch_report(bad, warn=False)
    assert len(caplog.records) == 1
    text = caplog.records[0].getMessage()
    assert "2 patch(es)" in text and "does not use" in text
    assert "nansum: torch moved Y" in text and "unfold: torch moved Z" in text


def test_warning_is_held_back_where_warn_is_false(
    report: Report, caplog: pytest.LogCaptureFixture
) -> None:
    bad = _with_failures(report, {"nansum": "torch moved Y"})
    with caplog.at_level(logging.WARNING, logger="ppo_value.patch_needs"):
        check_patch_report(bad, warn=False)  # rank != 0
    assert not caplog.records


@pytest.mark.slow
def test_recorded_needs_match_critic_patches() -> None:
    """A real run of every worker layout (``python -m tools.critic_patch_needs``) records the
    DTensor ops the critic runs; the patches covering them are exactly ``CRITIC_PATCHES``."""
    from tools.critic_patch_needs import record

    needed, ops = record()
    assert "aten.add.Tensor" in ops and "aten.embedding.default" in ops
    assert needed == CRITIC_PATCHES, (
        sorted(needed - CRITIC_PATCHES),
        sorted(CRITIC_PATCHES - needed),
    )

"""``verify(sample=...)`` (issue 21): each distinct call signature is checked once and repeats
go through unchecked, across blocks; a fraction of the signatures, decided alike on every rank;
and the run verification that ``DTENSOR_PATCHES_VERIFY`` starts, stopped after a number of
optimizer steps. Every listed kind of silent wrong (tests/test_verify.py) is still found the
first time its signature is seen.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from dtensor_patches.testing import RankPool
from dtensor_patches.verify_run import parse_setting
from tests.test_verify import KINDS, _mesh


def _sampled_kind(kind: str) -> dict[str, Any]:
    import dtensor_patches as dp
    from dtensor_patches import registry
    from dtensor_patches.verify import Signatures

    step, fix, _, _ = KINDS[kind]
    mesh = _mesh()
    signatures = Signatures()
    blocks = []
    with registry.patched(exclude=(fix,)):
        in_gate = registry.get(fix).applies_to()
        for _ in range(2):
            with dp.verify(sample=True, raise_on_mismatch=False, signatures=signatures) as report:
                step(mesh)
            blocks.append(
                {
                    "ops": [m.op for m in report.mismatches],
                    "signatures": report.signatures,
                    "skipped": report.skipped,
                    "checked": report.checked,
                }
            )
    return {"in_gate": in_gate, "blocks": blocks, "known": len(signatures)}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_sampling_finds_each_kind_the_first_time_and_skips_repeats(
    pool2: RankPool, kind: str
) -> None:
    _, _, op, _ = KINDS[kind]
    results = pool2.run(_sampled_kind, kind)
    assert results[0]["blocks"] == results[1]["blocks"]  # the ranks decide alike
    first, second = results[0]["blocks"]
    if results[0]["in_gate"]:
        assert op in first["ops"], first
    assert first["signatures"] > 0 and first["signatures"] == results[0]["known"]
    # The second step repeats every signature: nothing is checked, every call goes through.
    assert second["ops"] == [] and second["signatures"] == 0 and second["checked"] == 0
    assert second["skipped"] >= first["signatures"]


def _fraction_run(fraction: float) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    import dtensor_patches as dp
    from dtensor_patches.verify import Signatures

    mesh = _mesh()
    x = distribute_tensor(torch.arange(24.0).reshape(4, 6), mesh, [Shard(0)])
    with dp.patched(), dp.verify(sample=fraction, signatures=Signatures()) as report:
        for k in range(1, 7):
            (x * k).sum(0)
            x.amax(1)
            x[:, :k].mean()  # a new shape, so a new signature, for each k
    return {"signatures": report.signatures, "skipped": report.skipped}


def test_a_fraction_of_signatures_is_checked_alike_on_every_rank(pool2: RankPool) -> None:
    every = pool2.run(_fraction_run, 1.0)
    part = pool2.run(_fraction_run, 0.3)
    assert part[0] == part[1] and every[0] == every[1]
    total = every[0]["signatures"]
    assert every[0]["skipped"] > 0  # (x * k) repeats its signature: k is a python number
    assert 0 < part[0]["signatures"] < total
    assert part[0]["signatures"] + part[0]["skipped"] == total + every[0]["skipped"]


def test_sample_out_of_range_is_refused() -> None:
    import dtensor_patches as dp

    for bad in (0.0, 1.5, -1):
        with pytest.raises(ValueError, match="sample"), dp.verify(sample=bad):
            pass


def test_run_setting_is_parsed_and_bad_values_named() -> None:
    assert parse_setting("") is None and parse_setting("0") is None
    assert parse_setting("full").sample is False  # type: ignore[union-attr]
    setting = parse_setting("sample=0.25,steps=3,atol=1e-3")
    assert setting is not None
    assert (setting.sample, setting.steps, setting.atol) == (0.25, 3, 1e-3)
    assert parse_setting("sample").sample is True  # type: ignore[union-attr]
    for bad in ("sampel", "sample=2", "steps=0", "sample,steps=x"):
        with pytest.raises(ValueError, match="DTENSOR_PATCHES_VERIFY"):
            parse_setting(bad)


def _run_verification_from_env() -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, distribute_tensor

    import dtensor_patches as dp
    from dtensor_patches import registry, verify_run

    mesh = _mesh()
    os.environ["DTENSOR_PATCHES_VERIFY"] = "sampel"
    try:
        dp.apply_all()
    except ValueError as exc:
        refused = str(exc)
    else:
        refused = ""
    os.environ["DTENSOR_PATCHES_VERIFY"] = "sample,steps=2"
    try:
        with registry.patched(exclude=("loss_parallel_backward",)):
            run = verify_run.start_from_env()
            assert run is not None
            w = torch.nn.Parameter(distribute_tensor(torch.ones(3), mesh, [Replicate()]))
            opt = torch.optim.SGD([w], lr=0.1)
            entropy_in_loss_parallel = KINDS["entropy_in_loss_parallel"][0]
            for _ in range(3):
                w.grad = torch.zeros_like(w)
                # A wrong gradient without loss_parallel_backward, on every release.
                entropy_in_loss_parallel(mesh)
                opt.step()
            stopped = verify_run.run_verification() is run and run.steps_left == 0
            report = verify_run.stop_run_verification()
            assert report is not None
    finally:
        os.environ.pop("DTENSOR_PATCHES_VERIFY", None)
    return {
        "refused": refused,
        "mismatch_ops": [m.op for m in report.mismatches],
        "checked_calls": report.calls.get("aten._log_softmax_backward_data.default", 0),
        "stopped": stopped,
        "again": verify_run.run_verification() is None,
    }


def test_env_variable_starts_a_run_verification_that_stops_after_its_steps(
    pool2: RankPool,
) -> None:
    for got in pool2.run(_run_verification_from_env):
        assert "DTENSOR_PATCHES_VERIFY" in got["refused"]
        assert "aten._log_softmax_backward_data.default" in got["mismatch_ops"], got
        # Two optimizer steps, then nothing more is checked: the signature checked once.
        assert got["checked_calls"] == 1 and got["stopped"] and got["again"], got

"""scan(): recording (op, input placements) on a real 2-rank gloo mesh, the shipped release
data against the running torch, and the Qwen2 TP + SP example's prediction against real runs."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dtensor_patches import registry
from dtensor_patches._torch.versions import torch_release
from dtensor_patches.scan import Scan, predict, release_data, scan, scan_function
from dtensor_patches.testing import RankPool

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "qwen2_tp_sp_logits.py"
RELEASE = str(torch_release())


def _running_release_facts() -> dict[str, Any]:
    data = release_data()["releases"]
    if RELEASE not in data:
        pytest.skip(f"the scan data file has no entry for torch {RELEASE} (it has {list(data)})")
    return data[RELEASE]


# --- The data file is this torch's own registry ------------------------------------------


def test_data_file_matches_running_torch() -> None:
    facts = _running_release_facts()
    from tools import matrix

    live = matrix.registry_facts()
    for kind in ("strategies", "single_dim", "handlers", "decomposes"):
        assert facts[kind] == live[kind], f"{kind}: regenerate with python -m tools.matrix"
    assert not set(facts["absent"]) & set(live["aten_ops"])
    assert facts["torch"].split("+")[0] == live["torch"].split("+")[0]
    assert list(facts["patches"]) == [p.name for p in registry.all_patches()]
    for patch in registry.all_patches():
        entry = facts["patches"][patch.name]
        assert entry["ops"] == list(patch.ops) and entry["gate"] == str(patch.gate)
        assert entry["in_gate"] == patch.applies_to()
        assert entry["installs"] == live["installs"].get(patch.name, []), patch.name


def _stock_kinds_on_rank() -> dict[str, str | None]:
    from dtensor_patches.scan import _stock_kind
    from dtensor_patches.testing import world_mesh
    from dtensor_patches.tripwire import gather_result, with_required

    applied = [p.name for p in registry.all_patches() if p.is_applied]
    assert not applied, f"patches left applied on the rank: {applied}"
    mesh = world_mesh()
    kinds = {}
    for p in registry.all_patches():
        with with_required(p):
            kinds[p.name] = _stock_kind(gather_result(p.reproduce_on(mesh)))
    return kinds


@pytest.mark.slow
def test_data_file_stock_results_match_the_reproducers(pool2: RankPool) -> None:
    from dtensor_patches.scan import _stock_kind

    facts = _running_release_facts()
    measured = pool2.run(_stock_kinds_on_rank)[0]
    recorded = {name: _stock_kind(p["stock"]) for name, p in facts["patches"].items()}
    assert recorded == measured


# --- Recording ---------------------------------------------------------------------------


def _small_step_on_rank() -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from dtensor_patches import patched

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(20, dtype=torch.float32).reshape(5, 4)
    with patched():  # so that 2.9's missing alias strategy does not end the step
        x = distribute_tensor(full, mesh, [Shard(0)])  # 5 rows on 2 ranks: uneven
        r = distribute_tensor(full, mesh, [Replicate()])
        with scan() as found:
            whole = x[:, :4]  # a whole-dim slice: aten.alias
            total = x.sum() + 1.0  # Partial(sum) plus a Python number
            both = r * 2.0 + r
        with pytest.raises(ValueError):
            with scan() as failed:
                _ = r * 3.0
                raise ValueError("boom")
    return {
        "found": found.to_dict(),
        "failed": failed.to_dict(),
        "whole": (whole.full_tensor() - full).abs().max().item(),
        "total": total.full_tensor().item() - (full.sum().item() + 1.0),
        "both": (both.full_tensor() - 3 * full).abs().max().item(),
    }


def test_scan_records_op_and_input_placements(pool2: RankPool) -> None:
    results = pool2.run(_small_step_on_rank)
    for result in results:
        # Results under the recording mode are the single-device results.
        assert result["whole"] == 0 and result["total"] == 0 and result["both"] == 0
    found = Scan.from_dict(results[0]["found"])
    calls = {key: call for key, call in found.calls.items()}
    assert calls[("aten.alias.default", ("S(0)",))].uneven
    assert ("aten.sum.default", ("S(0)",)) in calls
    assert ("aten.add.Tensor", ("P(sum)",)) in calls
    assert ("aten.mul.Tensor", ("R",)) in calls
    assert ("aten.add.Tensor", ("R", "R")) in calls
    assert not calls[("aten.add.Tensor", ("R", "R"))].uneven
    failed = Scan.from_dict(results[0]["failed"])
    assert failed.error == "ValueError: boom"
    assert list(failed.calls) == [("aten.mul.Tensor", ("R",))]


def test_prediction_for_the_small_step(pool2: RankPool) -> None:
    found = Scan.from_dict(pool2.run(_small_step_on_rank)[0]["found"])
    report = predict(found)
    verdicts = {v.release: v for v in report.verdicts}
    # aten.alias.default has no strategy on 2.9 (pytorch/pytorch#170427), 2.10 added one.
    v29 = verdicts["2.9.1"]
    assert [(f.call.op, f.patches) for f in v29.missing] == [("aten.alias.default", ("alias",))]
    assert v29.stock() == "fails"
    for release in ("2.10.0", "2.11.0", "2.12.0", "2.13.0", "2.14.1", "2.15.0"):
        assert not verdicts[release].missing, release
    # Partial(sum) + 1.0 adds the number on every rank before 2.11 (partial_add_scalar).
    for release in ("2.9.1", "2.10.0"):
        wrong = [f for f in verdicts[release].of_kind("wrong") if f.call.op == "aten.add.Tensor"]
        assert [(f.call.inputs, f.certain, f.patches) for f in wrong] == [
            (("P(sum)",), True, ("partial_add_scalar",))
        ]
    assert not [f for f in verdicts["2.13.0"].findings if f.call.op == "aten.add.Tensor"]
    table = report.table()
    assert max(len(line) for line in table.splitlines()) <= 100
    assert "alias" in table
    assert json.loads(json.dumps(report.to_dict()))["releases"]["2.9.1"]["stock"] == "fails"


def test_unknown_release_is_a_clear_error() -> None:
    with pytest.raises(KeyError, match=r"no scan data for torch \['2.8.0'\]"):
        predict(Scan(), ["2.8.0"])


def test_bad_targets() -> None:
    with pytest.raises(ValueError, match="MODULE:FUNCTION"):
        scan_function("no_function_part")
    with pytest.raises(ValueError, match="has no function 'nope'"):
        scan_function("tests.test_scan:nope")


def cli_step() -> None:
    """A step for ``dtensor-patches scan tests.test_scan:cli_step`` (module level: ranks
    import it by name)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = distribute_tensor(torch.ones(4, 4), mesh, [Shard(1)])
    (x * 2).sum(1)


def test_cli_scan_json_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    from dtensor_patches.cli import main

    assert main(["scan", "tests.test_scan:cli_step", "--json", "--release", "2.9.1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {(c["op"], tuple(c["inputs"])) for c in out["calls"]} == {
        ("aten.mul.Tensor", ("S(1)",)),
        ("aten.sum.dim_IntList", ("S(1)",)),
    }
    assert list(out["releases"]) == ["2.9.1"] and out["releases"]["2.9.1"]["stock"] == "runs"
    assert main(["scan", "tests.test_scan:cli_step", "--require", "2.15.0"]) == 0
    table = capsys.readouterr().out
    assert max(len(line) for line in table.splitlines()) <= 100
    assert "2 distinct (op, input placements)" in table


# --- The Qwen2 TP + SP example -------------------------------------------------------------


def _qwen2_report() -> Any:
    pytest.importorskip("transformers")
    found = scan_function(f"{EXAMPLE}:scan_step", apply_patches=True)
    assert found.error is None
    return found.report()


def _run_example(*flags: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--logits-to-keep", "0", "1", *flags],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stdout + proc.stderr
    return json.loads(lines[-1])


@pytest.mark.slow
def test_qwen2_scan_predicts_alias_on_2_9_and_nothing_missing_after() -> None:
    report = _qwen2_report()
    verdicts = {v.release: v for v in report.verdicts}
    v29 = verdicts["2.9.1"]
    assert {f.call.op for f in v29.missing} == {"aten.alias.default"}
    assert all(f.patches == ("alias",) for f in v29.missing)
    assert not v29.fallback and v29.stock() == "fails" and "alias" in v29.patches_needed
    for release, verdict in verdicts.items():
        if release != "2.9.1":
            assert not verdict.missing and not verdict.fallback, release


@pytest.mark.slow
def test_qwen2_prediction_for_this_release_matches_a_real_run() -> None:
    # Recorded on this torch, predicted for this torch from the data file, then checked by
    # running the example for real: on stock torch it must fail exactly on a predicted
    # missing op; with only the predicted patches it must match the single-device model.
    _running_release_facts()
    (verdict,) = _qwen2_report().verdicts_for(RELEASE)
    stock = _run_example("--no-patches")
    missing = {f.call.op for f in verdict.missing}
    certain_bugs = [f for f in verdict.of_kind("wrong", "fails") if f.certain]
    if missing or certain_bugs:
        assert not stock["ok"], stock
        errors = [run.get("error", "") for run in stock["logits_to_keep"].values()]
        failed_on = {op for op in missing for e in errors if f"{op} does not have" in e}
        if missing:
            assert failed_on, (errors, missing)
    else:
        assert stock["ok"], stock
    needed = verdict.patches_needed
    with_predicted = _run_example("--only", *needed)
    assert with_predicted["ok"], (needed, with_predicted)
    # Each patch a certain finding needs is necessary (the stock run covers a single one).
    certain = {p for f in verdict.findings if f.certain for p in f.patches}
    for name in sorted(certain) if len(needed) > 1 else ():
        without = _run_example("--only", *[n for n in needed if n != name])
        assert not without["ok"], (name, without)


# --- Ops torch decomposes, or the fallback takes (issue 23, item 16) ----------------------------


def _decomposed_cases() -> dict[str, Any]:
    """Calls a user writes whose op has no strategy on some release: DTensor decomposes it
    there (2.11+ through ``torch._decomp``), refuses it, or (``mse_loss`` mean of uneven
    shards) runs it silently wrong. Each: (DTensor inputs -> result, plain inputs -> result)."""
    import torch
    import torch.nn.functional as F

    def addr(m: Any, v: Any, w: Any) -> Any:
        return torch.addr(m, v, w)

    return {
        "renorm": (lambda x: torch.renorm(x, 2, 0, 1.0), ("S0",)),
        "trace": (torch.trace, ("S0",)),
        "rot90": (torch.rot90, ("S0",)),
        "aminmax": (torch.aminmax, ("S0",)),
        "addr": (addr, ("S0", "R4", "R4")),
        "mse_loss": (F.mse_loss, ("S0odd", "S0odd")),
    }


def _decomposed_ops_on_rank(apply: bool) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from dtensor_patches import patched
    from dtensor_patches.testing import world_mesh

    mesh = world_mesh()
    gen = torch.Generator().manual_seed(7)
    shapes = {"S0": (4, 4), "S0odd": (5, 3), "R4": (4,)}
    out: dict[str, Any] = {}
    for name, (fn, kinds) in _decomposed_cases().items():
        plain = [torch.randn(shapes[k], generator=gen) for k in kinds]
        placed = [
            distribute_tensor(t, mesh, [Replicate() if k.startswith("R") else Shard(0)])
            for t, k in zip(plain, kinds, strict=True)
        ]
        expected = fn(*plain)
        outcome = "right"
        with patched() if apply else contextlib.nullcontext():
            try:
                with scan() as found:
                    got = fn(*placed)
            except Exception as exc:  # noqa: BLE001 - the outcome under test
                outcome = f"raises: {type(exc).__name__}"
            else:
                pairs = zip(
                    got if isinstance(got, tuple) else (got,),
                    expected if isinstance(expected, tuple) else (expected,),
                    strict=True,
                )
                for g, e in pairs:
                    full = g.full_tensor() if isinstance(g, DTensor) else g
                    if full.shape != e.shape or not torch.allclose(full, e, atol=1e-6):
                        outcome = "wrong"
        out[name] = {"found": found.to_dict(), "outcome": outcome}
    return out


def _stock_word(outcome: str) -> str:
    return {"right": "runs", "wrong": "wrong"}.get(outcome, "fails")


def test_scan_predicts_decomposed_and_fallback_ops_as_they_run(pool2: RankPool) -> None:
    """On the running release the prediction is what the calls did: torch's decomposition
    runs ``trace``/``rot90``/``aminmax``/``addr`` where it does (not "no strategy"),
    ``renorm`` fails on stock, ``mse_loss`` mean of uneven shards is silently wrong where it
    is (not "fails"); with ``apply_all()`` every release is predicted to run (a patch, the
    fallback or the decomposition takes each), and the patched results are the single
    device's. Recorded once on stock torch and once with the patches applied."""
    _running_release_facts()
    stock = pool2.run(_decomposed_ops_on_rank, False)[0]
    with_patches = pool2.run(_decomposed_ops_on_rank, True)[0]
    for name in _decomposed_cases():
        measured = _stock_word(stock[name]["outcome"])
        assert with_patches[name]["outcome"] == "right", (name, with_patches[name])
        for recorded in (stock[name], with_patches[name]):
            report = Scan.from_dict(recorded["found"]).report()
            (here,) = report.verdicts_for(RELEASE)
            # A patched scan cannot see whether stock torch would run a decomposed op (a
            # patch may fix one of its parts): "check" is the honest answer there.
            unsure = recorded is with_patches[name] and here.of_kind("decomposes")
            assert here.stock() == ("check" if unsure else measured), (name, recorded, here)
            for verdict in report.verdicts:
                assert verdict.patched() == "runs", (name, verdict.release, verdict.findings)
            if measured == "runs" and recorded is stock[name]:
                assert not here.missing and not here.of_kind("decomposes"), (name, here)


def decomposed_step() -> None:
    """A step for ``dtensor-patches scan --apply-all --require`` (module level: ranks import
    it by name): every op of :func:`_decomposed_cases` once."""
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from dtensor_patches.testing import world_mesh

    mesh = world_mesh()
    shapes = {"S0": (4, 4), "S0odd": (5, 3), "R4": (4,)}
    for fn, kinds in _decomposed_cases().values():
        fn(
            *(
                distribute_tensor(
                    torch.ones(shapes[k]), mesh, [Replicate() if k.startswith("R") else Shard(0)]
                )
                for k in kinds
            )
        )


def test_cli_require_passes_a_step_the_fallback_and_decompositions_run() -> None:
    from dtensor_patches.cli import main

    releases = list(release_data()["releases"])
    assert (
        main(["scan", "tests.test_scan:decomposed_step", "--apply-all", "--require", *releases])
        == 0
    )

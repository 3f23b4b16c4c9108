"""The CLI, and the pytest plugin, as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dtensor_patches import all_patches, get
from dtensor_patches.cli import main, parse_gate_overrides

pytest_plugins = ["pytester"]


def test_list_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (alias,) = [p for p in data["patches"] if p["name"] == "alias"]
    assert alias["ops"] == ["aten.alias.default"]
    assert alias["applies_to_this_torch"] is get("alias").applies_to()
    assert "166867" in alias["upstream_fix"]


def test_list_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "alias" in out and "torch<2.10,>=2.9" in out


def test_doctor_without_tripwires(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json", "--no-check"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["environment"]["backends"]["gloo"] is True
    (alias,) = [p for p in data["apply_all_would"] if p["name"] == "alias"]
    assert alias["status"] == ("would apply" if get("alias").applies_to() else "gated out")


def test_bad_gate_and_bad_name_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--gate", "alias"]) == 2
    assert main(["check", "--gate", "alias=>>2"]) == 2
    assert main(["check", "--only", "nope"]) == 2
    err = capsys.readouterr().err
    assert "NAME=SPECIFIER" in err and "invalid version specifier" in err and "nope" in err


def test_parse_gate_overrides() -> None:
    assert parse_gate_overrides(["alias=>=2.9,<2.11"]) == {"alias": ">=2.9,<2.11"}


def test_doctor_runs_tripwires_as_a_subprocess() -> None:
    """``python -m dtensor_patches doctor`` prints the truth for this torch and exits 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "dtensor_patches", "doctor"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    needed = get("alias").applies_to()
    assert ("would apply" if needed else "gated out") in proc.stdout
    assert "distributed backends: gloo=yes" in proc.stdout
    if needed:
        assert "does not have a sharding strategy registered" in proc.stdout
    else:
        assert "none (correct)" in proc.stdout


def test_check_exit_code_follows_tripwire() -> None:
    wrong = "alias=<2.9" if get("alias").applies_to() else "alias=>=2.9"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dtensor_patches",
            "check",
            "--json",
            "--only",
            "alias",
            "--gate",
            wrong,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (row,) = json.loads(proc.stdout)["tripwires"]
    assert row["verdict"] in {"stale", "gate too narrow"}


def test_pytest_plugin_off_by_default_and_trips_when_on(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_downstream="def test_nothing():\n    assert True\n")
    off = pytester.runpytest_subprocess("-q")
    off.assert_outcomes(passed=1)
    patches = len(all_patches())
    on = pytester.runpytest_subprocess("-q", "--dtensor-patches-check")
    on.assert_outcomes(passed=1 + patches)
    wrong = "alias=<2.9" if get("alias").applies_to() else "alias=>=2.9"
    tripped = pytester.runpytest_subprocess(
        "-q", "--dtensor-patches-check", f"--dtensor-patches-gate={wrong}"
    )
    tripped.assert_outcomes(passed=patches, failed=1)
    tripped.stdout.fnmatch_lines(["*dtensor-patches tripwire: alias: *"])

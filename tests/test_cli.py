"""The CLI, and the pytest plugin, as a user runs them."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from dtensor_patches import all_patches, get
from dtensor_patches._torch.versions import torch_release
from dtensor_patches.cli import main, parse_gate_overrides

pytest_plugins = ["pytester"]


def test_list_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (alias,) = [p for p in data["patches"] if p["name"] == "alias"]
    assert alias["ops"] == ["aten.alias.default"]
    assert alias["applies_to_this_torch"] is get("alias").applies_to()
    assert "166867" in alias["upstream_fix"]


def _widest(text: str) -> int:
    return max((len(line) for line in text.splitlines()), default=0)


def test_list_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert _widest(out) <= 100
    (row,) = [line for line in out.splitlines() if line.startswith("alias ")]
    # gates are written lower bound first, as in the README
    assert row.split()[:3] == [
        "alias",
        ">=2.9,<2.10",
        "applies" if get("alias").applies_to() else "gated",
    ]
    (inplace,) = [line for line in out.splitlines() if line.startswith("inplace_writes ")]
    hidden = len(get("inplace_writes").ops) - inplace.count(",")
    assert f"+{hidden} more" in inplace


def test_list_verbose_shows_every_op(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "-v"]) == 0
    out = capsys.readouterr().out
    assert _widest(out) <= 100
    flat = " ".join(out.split())
    for patch in all_patches():
        assert ", ".join(patch.ops) in flat
    assert "https://github.com/pytorch/pytorch/issues/170427" in flat


def test_help_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from dtensor_patches.cli import main\n"
        "try:\n"
        "    main(['check', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "print('no torch')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--only PATCH [PATCH ...]" in proc.stdout and "--no-check" not in proc.stdout
    assert proc.stdout.rstrip().endswith("no torch")


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
    """``python -m dtensor_patches doctor`` prints the truth for this torch, fits 100 columns,
    closes with a summary, and exits 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "dtensor_patches", "doctor"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _widest(proc.stdout) <= 100
    needed = get("alias").applies_to()
    assert ("would apply" if needed else "gated out") in proc.stdout
    assert "distributed backends: gloo=yes" in proc.stdout
    (alias,) = [
        line for line in proc.stdout.splitlines() if line.startswith("ok ") and " alias " in line
    ]
    assert alias.split()[2:4] == ([">=2.9,<2.10", "fixed"] if needed else [">=2.9,<2.10", "not"])
    if needed:
        assert "  bug: " in alias  # the full message is in -v and --json
    else:
        assert alias.endswith("correct")
    applies = sum(p.applies_to() for p in all_patches())
    summary, todo = proc.stdout.rstrip().splitlines()[-2:]
    assert summary == (
        f"summary: {applies} of {len(all_patches())} patches apply to torch "
        f"{torch_release()}; tripwires: {len(all_patches())} ok."
    )
    assert todo.startswith("to do: nothing to fix")
    # torch's warnings are the tripwires' business, not the reader's
    assert "Warning" not in proc.stderr, proc.stderr
    assert not re.search(r"\]:W\d{4} ", proc.stderr), proc.stderr  # torch's logged warnings


def test_check_json_and_exit_code_follow_tripwire() -> None:
    """A wrong gate trips (exit 1); JSON tells "fixed" from "not run"."""
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
            "unfold",
            "--gate",
            wrong,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    alias, unfold = json.loads(proc.stdout)["tripwires"]
    assert alias["verdict"] in {"stale", "gate too narrow"}
    # unfold's gate covers every supported release: its bug is present and the patch fixes it
    assert (unfold["verdict"], unfold["stock"], unfold["with_patch"]) == ("ok", "bug", "fixed")
    assert unfold["after_patch"] is None
    if alias["verdict"] == "gate too narrow":
        assert (alias["stock"], alias["with_patch"], alias["after_patch"]) == (
            "bug",
            "not run",
            None,
        )
    else:
        assert (alias["stock"], alias["with_patch"]) == ("correct", "fixed")


def test_check_hides_torch_warnings_unless_verbose(capfd: pytest.CaptureFixture[str]) -> None:
    """index_writes' reproducer calls index_reduce_, which torch warns is in beta."""
    assert main(["check", "--only", "index_writes"]) == 0
    plain = capfd.readouterr()
    assert "index_reduce() is in beta" not in plain.out + plain.err
    assert plain.out.splitlines()[1].split() == [
        "verdict",
        "patch",
        "gate",
        "with",
        "patch",
        "stock",
        "torch",
    ]
    assert plain.out.splitlines()[3].startswith("ok ")
    assert "-v shows them" in plain.out
    assert _widest(plain.out) <= 100
    assert main(["check", "-v", "--only", "index_writes"]) == 0
    verbose = capfd.readouterr()
    assert "index_reduce() is in beta" in " ".join(verbose.out.split())
    assert "index_reduce() is in beta" not in verbose.err
    assert _widest(verbose.out) <= 100


def _outcomes_line(result: pytest.RunResult) -> str:
    return result.stdout.lines[-1]


def test_pytest_plugin_off_by_default(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_downstream="def test_nothing():\n    assert True\n")
    off = pytester.runpytest_subprocess("-q")
    off.assert_outcomes(passed=1)
    listed = pytester.runpytest_subprocess("-q", "--collect-only", "--dtensor-patches-check")
    ids = [line for line in listed.stdout.lines if line.startswith("dtensor_patches::")]
    assert ids == [f"dtensor_patches::{p.name}" for p in all_patches()]


def test_pytest_plugin_selects_and_trips(pytester: pytest.Pytester) -> None:
    """One real item per patch: -k selects one tripwire, and only that one runs."""
    pytester.makepyfile(test_downstream="def test_nothing():\n    assert True\n")
    patches = len(all_patches())
    one = pytester.runpytest_subprocess("-v", "--dtensor-patches-check", "-k", "alias")
    one.assert_outcomes(passed=1, deselected=patches)
    one.stdout.fnmatch_lines(
        [
            f"*collected {patches + 1} items / {patches} deselected / 1 selected",
            "dtensor_patches::alias PASSED*",
        ]
    )
    wrong = "alias=<2.9" if get("alias").applies_to() else "alias=>=2.9"
    tripped = pytester.runpytest_subprocess(
        "-q",
        "--dtensor-patches-check",
        f"--dtensor-patches-gate={wrong}",
        "-k",
        "alias or index_writes or nothing",
        "--deselect",
        "test_downstream.py::test_nothing",
    )
    tripped.assert_outcomes(passed=1, failed=1, deselected=patches - 1)
    tripped.stdout.fnmatch_lines(["*dtensor-patches tripwire: alias: *"])
    # Each item reports its own run: index_writes' warning is not in alias's failure report.
    assert "index_reduce" not in tripped.stdout.str()


def test_doctor_summary_names_a_stale_or_too_narrow_gate() -> None:
    wrong = "alias=<2.9" if get("alias").applies_to() else "alias=>=2.9"
    verdict = "gate too narrow" if get("alias").applies_to() else "stale"
    proc = subprocess.run(
        [sys.executable, "-m", "dtensor_patches", "doctor", "--only", "alias", "--gate", wrong],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert _widest(proc.stdout) <= 100
    tail = " ".join(proc.stdout[proc.stdout.rindex("summary: ") :].split())
    assert f"tripwires: 0 ok, 1 {verdict} (alias)." in tail
    assert "to do: " in tail and "alias" in tail.split("to do: ", 1)[1]

"""The main job: HF Qwen2 under TP=2 + SP on a 2-rank CPU gloo mesh, with and without patches."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dtensor_patches import get

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "qwen2_tp_sp_logits.py"


def _run(*flags: str) -> tuple[int, dict[str, object]]:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *flags],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stdout + proc.stderr
    return proc.returncode, json.loads(lines[-1])


@pytest.mark.slow
def test_qwen2_tp_sp_with_and_without_patches() -> None:
    needs_patch = get("alias").applies_to()

    rc, patched = _run()
    assert rc == 0, patched
    (alias,) = [p for p in patched["patches"] if p["name"] == "alias"]  # type: ignore[union-attr]
    assert alias["status"] == ("applied" if needs_patch else "gated out")
    for keep in ("0", "1"):
        run = patched["logits_to_keep"][keep]  # type: ignore[index]
        assert run["ok"] and run["max_abs_diff"] <= 1e-5

    rc, stock = _run("--no-patches")
    whole = stock["logits_to_keep"]["0"]  # type: ignore[index]
    if needs_patch:
        assert rc == 1
        assert "aten.alias.default does not have a sharding strategy" in whole["error"]
    else:
        assert rc == 0 and whole["max_abs_diff"] <= 1e-5
    assert stock["logits_to_keep"]["1"]["ok"]  # type: ignore[index]


@pytest.mark.slow
def test_qwen2_tp_sp_odd_sequence_lengths() -> None:
    # SP shards the sequence: 7 and 5 tokens on TP=2 are padded, then trimmed. Without the
    # padding the forward aborts in a gloo collective (issue: uneven sequence shards).
    for seq_len in ("7", "5"):
        rc, result = _run("--seq-len", seq_len, "--logits-to-keep", "0", "1", "3")
        assert rc == 0, result
        assert result["seq_len"] == int(seq_len)
        for keep in ("0", "1", "3"):
            run = result["logits_to_keep"][keep]  # type: ignore[index]
            assert run["ok"] and run["max_abs_diff"] <= 1e-5, (seq_len, keep, run)

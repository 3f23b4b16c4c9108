"""The README's first example, run as a user runs it: ``torchrun`` on two CPU ranks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"


def test_quickstart_fails_on_stock_torch_and_matches_plain_tensors_patched() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(EXAMPLE),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert any(
        line.startswith("stock torch ") and "aten.searchsorted.Tensor" in line for line in lines
    ), proc.stdout
    assert "patched: placements (Shard(dim=0),), equal to plain tensors: True" in lines
    # documents start at 0, 5, 9, 14: positions 0..15 of the 4x4 block belong to these
    assert lines[-1] == str([[0, 0, 0, 0], [0, 1, 1, 1], [1, 2, 2, 2], [2, 2, 3, 3]])

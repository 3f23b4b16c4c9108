"""Pieces of ``python -m ppo_value.demo`` that need no Ray cluster."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

demo = pytest.importorskip("ppo_value.demo")  # needs the ppo extra


def test_export_gets_ordinary_permissions(tmp_path: Path) -> None:
    export = tmp_path / "hf"
    (export / "sub").mkdir(parents=True)
    weights = export / "model.safetensors"
    weights.write_bytes(b"\0" * 8)
    weights.chmod(0o600)  # what the safetensors writer leaves
    (export / "sub").chmod(0o700)
    umask = os.umask(0o022)
    try:
        demo._readable(export)
    finally:
        os.umask(umask)
    assert stat.S_IMODE(weights.stat().st_mode) == 0o644
    assert stat.S_IMODE((export / "sub").stat().st_mode) == 0o755
    assert stat.S_IMODE(export.stat().st_mode) == 0o755


def test_plot_has_labels_and_title(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at it
    history = [
        {
            "step": s,
            "critic/loss": 1.0 / s,
            "critic/explained_var": 0.1 * s,
            "critic/grad_norm": 1.0,
            "critic/clip_fraction": 0.0,
        }
        for s in (1, 2, 3)
    ]
    demo.save_plot(history, [(0, -0.1), (3, 0.3)], tmp_path / "c.png", "PPO critic: test run")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = figures
    assert fig._suptitle.get_text() == "PPO critic: test run"
    for ax in fig.axes:
        assert ax.get_ylabel() and ax.get_xlabel() == "step"

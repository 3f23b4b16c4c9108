"""Output helpers of the CLI: lines that fit the terminal, torch imported with its warnings kept."""

from __future__ import annotations

import argparse
import warnings
from typing import TYPE_CHECKING

from dtensor_patches import _text

if TYPE_CHECKING:
    pass

__all__ = ["details", "load_torch", "out", "torch_version"]


def load_torch(args: argparse.Namespace) -> None:
    """Import torch and the registry; their import-time warnings (a missing NumPy) are kept
    for ``-v`` instead of being printed."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import torch  # noqa: F401

        from dtensor_patches import registry

        registry.all_patches()
    args.import_warnings = [f"{w.category.__name__}: {w.message}" for w in caught]


def torch_version() -> str:
    import torch

    return torch.__version__


def out(line: str = "") -> None:
    print(line, flush=True)


def details(label: str, text: object) -> None:
    for line in _text.wrap(f"{label}: {text}", indent="    "):
        out(line)

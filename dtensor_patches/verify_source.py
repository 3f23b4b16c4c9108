"""How :func:`dtensor_patches.verify` names a call's arguments and the user's line that made
it (for a backward op: the forward line autograd recorded, in anomaly mode)."""

from __future__ import annotations

import os
import re
import traceback
from typing import Any

import torch

from dtensor_patches._torch.dtensors import dtensor_class
from dtensor_patches._torch.modes import current_autograd_node

__all__ = ["describe", "source"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)\n(?P<code>.*)')


def describe(x: Any) -> str:
    dtensor = dtensor_class()
    if isinstance(x, dtensor):
        return f"{list(x.shape)} {tuple(x.placements)} {str(x.dtype).removeprefix('torch.')}"
    if isinstance(x, torch.Tensor):
        return f"plain {list(x.shape)} {str(x.dtype).removeprefix('torch.')}"
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


def _user_frame_of(frames: list[tuple[str, int, str, str]]) -> str:
    for filename, line, fn, code in reversed(frames):
        path = os.path.abspath(filename)
        if path.startswith((_TORCH_DIR, _PACKAGE_DIR)) or "contextlib" in path:
            continue
        shown = os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else filename
        return f"{shown}:{line} in {fn}: {code.strip()}"
    return "<no user frame>"


def source(phase: str) -> str:
    if phase == "backward":
        node = current_autograd_node()
        trace = getattr(node, "metadata", {}).get("traceback_") if node is not None else None
        if trace:
            frames = [
                (m["file"], int(m["line"]), m["fn"], m["code"])
                for m in (_FRAME.search(entry) for entry in trace)
                if m is not None
            ]
            return f"backward of {_user_frame_of(frames)}"
        return f"backward, called from {_user_frame_of(_stack())}"
    return _user_frame_of(_stack())


def _stack() -> list[tuple[str, int, str, str]]:
    return [(f.filename, f.lineno or 0, f.name, f.line or "") for f in traceback.extract_stack()]

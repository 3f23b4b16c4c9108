"""Reading ``torch.distributed.checkpoint`` (DCP) files without running code from them.

DCP unpickles two kinds of data with no restriction: ``FileSystemReader.read_metadata()`` is
``pickle.load`` on ``dcp/.metadata``, and ``DefaultLoadPlanner.load_bytes`` is
``torch.load(weights_only=False)`` on every stored non-tensor item (the optimizer's
``param_groups`` values). A crafted checkpoint could run any code through either (issue 23
item 8). This module reads both safely:

- :func:`read_metadata` unpickles ``.metadata`` with an allowlist: the classes DCP's metadata
  is made of (those of ``torch.distributed.checkpoint.metadata``, the dataclasses of
  ``torch.distributed.checkpoint.filesystem``), ``torch.Size``, torch dtypes and layouts and
  ``pathlib`` paths; any other global is refused before it is looked up, and the result must be
  a ``Metadata``.
- :class:`SafeFileSystemReader` is DCP's ``FileSystemReader`` reading its metadata that way.
- :class:`SafeLoadPlanner` is DCP's ``DefaultLoadPlanner`` that first unpickles every stored
  bytes item with ``torch.load(weights_only=True)`` (plain containers, numbers, strings,
  tensors) and refuses the item if that fails; only a stream that passed is handed on.

Tensor shards are already read with ``weights_only=True`` by DCP itself. Upstream: DCP's
metadata format is a pickle by design (pytorch/pytorch ``filesystem.py``); no safe-load option
exists on torch 2.9 to 2.15.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import pickle
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

__all__ = ["SafeFileSystemReader", "SafeLoadPlanner", "UnsafeCheckpointError", "read_metadata"]

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_FILESYSTEM_MODULE = "torch.distributed.checkpoint.filesystem"
_PATH_MODULES = ("pathlib", "pathlib._local")  # pathlib._local: Python 3.13+
_PATH_CLASSES = ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file needs an object that is not allowed to be unpickled."""


def _layout_by_name(name: str) -> torch.layout:
    """Our stand-in for the layout lookup DCP's ``TensorProperties`` pickles (``torch.strided``
    by its name): only ``torch.layout`` values of the ``torch`` namespace.

    Raises:
        UnsafeCheckpointError: ``name`` is no torch layout.
    """
    for value in vars(torch).values():
        if isinstance(value, torch.layout) and str(value) == name:
            return value
    raise UnsafeCheckpointError(f"{name!r} is not a torch layout")


def _allowed(module: str, name: str) -> Any:
    """The object ``module.name`` may resolve to in DCP metadata, or ``None``."""
    if module == "torch":
        if name == "Size":
            return torch.Size
        value = getattr(torch, name, None)
        kinds = (torch.dtype, torch.layout, torch.memory_format)
        return value if isinstance(value, kinds) else None
    if module == "torch.serialization" and name == "_get_layout":
        return _layout_by_name
    if module in (_METADATA_MODULE, _FILESYSTEM_MODULE):
        value = getattr(importlib.import_module(module), name, None)
        defined_here = isinstance(value, type) and value.__module__ == module
        if not defined_here:
            return None
        # the metadata module is DCP's metadata classes (dataclasses, one Enum); from the
        # file-system module only its plain dataclasses (the storage records)
        if module == _METADATA_MODULE or dataclasses.is_dataclass(value):
            return value
        return None
    if module in _PATH_MODULES and name in _PATH_CLASSES:
        import pathlib

        return getattr(pathlib, name)
    return None


def _reason(exc: BaseException) -> str:
    """The line of a ``weights_only`` error that names the refused global (torch's message is
    paragraphs long, and opens with advice to load the file with ``weights_only=False``)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    generic = ("Weights only load failed", "Check the documentation")
    specific = [line for line in lines if not line.startswith(generic)]
    return (specific or lines or [""])[0]


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the globals of :func:`_allowed`, and records
    the classes it resolved with their attributes (see :meth:`check_classes_unchanged`)."""

    def __init__(self, stream: IO[bytes]) -> None:
        super().__init__(stream)
        self.classes: dict[type, dict[str, Any]] = {}

    def find_class(self, module: str, name: str) -> Any:
        value = _allowed(module, name)
        if value is None:
            raise UnsafeCheckpointError(
                f"global {module}.{name} is not allowed in DCP metadata (only the classes of "
                "torch.distributed.checkpoint.metadata, torch.Size, dtypes, layouts, paths)"
            )
        if isinstance(value, type) and value not in self.classes:
            self.classes[value] = dict(vars(value))
        return value

    def check_classes_unchanged(self) -> None:
        """Undo and refuse attributes a pickle set on an allowed class itself (``BUILD`` with
        a slot state on a class object is ``setattr`` on the class).

        Raises:
            UnsafeCheckpointError: naming the class.
        """
        for cls, before in self.classes.items():
            after = dict(vars(cls))
            if after.keys() == before.keys() and all(after[k] is before[k] for k in before):
                continue
            for key in after.keys() - before.keys():
                delattr(cls, key)
            for key, value in before.items():
                if after.get(key, value) is not value:
                    setattr(cls, key, value)
            raise UnsafeCheckpointError(
                f"the pickle sets attributes of the class {cls.__module__}.{cls.__qualname__}"
            )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError("persistent ids are not allowed in DCP metadata")


def load_metadata_stream(stream: IO[bytes]) -> Metadata:
    """Unpickle DCP ``Metadata`` from ``stream`` with the allowlist.

    Raises:
        UnsafeCheckpointError: a global outside the allowlist, or a result that is no
            ``Metadata``; nothing outside the allowlist was looked up or called.
        pickle.UnpicklingError, EOFError, ValueError, ...: a malformed pickle.
    """
    unpickler = _MetadataUnpickler(stream)
    try:
        metadata = unpickler.load()
    finally:
        unpickler.check_classes_unchanged()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(
            f"expected torch.distributed.checkpoint Metadata, got {type(metadata).__name__}"
        )
    return metadata


def read_metadata(file: str | Path) -> Metadata:
    """:func:`load_metadata_stream` of ``file`` (a ``.metadata`` file).

    Raises:
        OSError: the file cannot be opened.
        UnsafeCheckpointError: see :func:`load_metadata_stream`.
    """
    with open(file, "rb") as stream:
        return load_metadata_stream(stream)


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose ``read_metadata`` uses the allowlist (see module).

    Args:
        path: the DCP checkpoint directory.
    """

    def __init__(self, path: str | Path) -> None:
        super().__init__(str(path))
        self._checkpoint_dir = Path(path)

    def reset(self, checkpoint_id: str | Any = None) -> None:
        """As ``FileSystemReader.reset``; also follows a new ``checkpoint_id`` directory."""
        super().reset(checkpoint_id)
        if checkpoint_id is not None:
            self._checkpoint_dir = Path(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata (``__{rank}.metadata`` when DCP asks for ``rank=``),
        unpickled with the allowlist; as ``FileSystemReader.read_metadata`` otherwise.

        Raises:
            OSError: the file cannot be opened.
            UnsafeCheckpointError: the file needs an object outside the allowlist.
        """
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        metadata = read_metadata(self._checkpoint_dir / name)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's ``DefaultLoadPlanner`` that refuses a stored bytes item unless it unpickles with
    ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Check the item with ``weights_only=True``, then load it as DCP does.

        Raises:
            UnsafeCheckpointError: naming the item, when ``weights_only=True`` refuses it.
        """
        data = value.read()
        try:
            torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except Exception as exc:
            raise UnsafeCheckpointError(
                f"stored item {read_item.dest_index.fqn}: refused, it cannot be read with "
                f"torch.load(weights_only=True) ({type(exc).__name__}: {_reason(exc)})"
            ) from exc
        # the same bytes, now known to hold only plain data, through DCP's own loading
        super().load_bytes(read_item, io.BytesIO(data))

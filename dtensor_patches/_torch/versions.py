"""The running torch release, and the facts of the supported range that depend on it."""

from __future__ import annotations

import torch
from packaging.version import Version

__all__ = [
    "dispatches_in_cpp",
    "propagates_through_decompositions",
    "release_of",
    "subclass_dispatch_honoured",
    "torch_release",
    "torch_version",
    "view_geometry_is_global",
]

_CPP_DISPATCH = Version("2.10")
_SUBCLASS_DISPATCH_AGAIN = Version("2.12")
_DECOMPOSITION_PROPAGATION = Version("2.11")


def torch_version() -> Version:
    """The running torch version as a :class:`packaging.version.Version` (local label kept)."""
    return Version(torch.__version__)


def release_of(version: Version | str) -> Version:
    """The release a version string is, or leads up to: ``2.14.1+cu130`` -> ``2.14.1``."""
    return Version(Version(str(version)).base_version)


def torch_release() -> Version:
    """The release the running torch is, or leads up to: pre-release, dev and local labels dropped.

    ``2.9.0a0+gitabc`` -> ``2.9.0``; ``2.14.1+cu130`` -> ``2.14.1``. Gates compare against this,
    because a nightly of 2.10 carries the 2.10 code base, not the 2.9 one.
    """
    return release_of(torch_version())


def dispatches_in_cpp() -> bool:
    """Whether DTensor's dispatch entry point is C++ (2.10+, pytorch/pytorch#167051): a cached
    call then never reaches Python, and a cache miss reaches
    ``OpDispatcher._propagate_op_sharding_dispatch_slow_path``. On 2.9 ``OpDispatcher.dispatch``
    is Python. The release decides, not the presence of an attribute, so a moved slow path
    fails loudly instead of a wrapper that never runs."""
    return torch_release() >= _CPP_DISPATCH


def view_geometry_is_global() -> bool:
    """Whether a DTensor view's ``stride()``/``storage_offset()`` describe its place in the
    global base tensor.

    Measured: from 2.10 the wrapper carries the global offset (``x[1:3]`` of a 4x6 base has
    offset 6); on 2.9 every DTensor view reports offset 0.
    """
    return torch_release() >= _CPP_DISPATCH


def subclass_dispatch_honoured() -> bool:
    """Whether a DTensor subclass's own ``__torch_dispatch__`` is called for its ops.

    Measured: 2.10 and 2.11 dispatch DTensor subclasses through DTensor's C++ fast path without
    calling it (2.9 is Python, 2.12 honours it again), so a tracked view cannot see the writes
    into it there.
    """
    release = torch_release()
    return not (_CPP_DISPATCH <= release < _SUBCLASS_DISPATCH_AGAIN)


def propagates_through_decompositions() -> bool:
    """Whether DTensor's sharding propagation, for an op without a strategy, derives one from
    the op's ``torch._decomp`` decomposition (2.11+,
    ``torch.distributed.tensor._decompositions.DecompShardingStrategy``): such an op then runs
    on stock torch instead of raising "does not have a sharding strategy"."""
    return torch_release() >= _DECOMPOSITION_PROPAGATION

"""``DTensor.from_local`` on shards of different lengths: the ranks disagree on the global shape.

Without ``shape=``, ``from_local`` assumes every rank's local tensor has the same size and
multiplies it by the mesh size. RL code re-wraps per-rank data all the time (token log-probs
of a rank's own sequences, an EMA kept on local shards of a 5-row parameter, metrics), and the
lengths differ: with local lengths 3 and 2 on two ranks, rank 0 says the global length is 6
and rank 1 says 4. Values come out silently wrong, or gloo aborts the process (SIGABRT) in the
next all-gather, whose sizes no longer match. Every release 2.9 to 2.15 (torch's own source
has a ``TODO: support uneven sharding when global shape/stride not passed``).

Fix: ``DTensor.from_local`` is wrapped. When the caller passes neither ``shape``/``stride`` nor
``run_check=False`` and a placement shards over a mesh dim longer than 1, the ranks exchange
their local shapes (one all-gather of 32 integers per mesh dim longer than 1, on the mesh's
own groups) and the DTensor gets the true global shape and
stride. Local lengths that are not DTensor's layout (``torch.chunk``'s: ``ceil(n / k)`` per
rank, the last ones shorter or empty) cannot be one DTensor; shapes that differ in another dim
are a mistake; either raises ``ValueError`` on every rank (the check runs over the whole mesh
before anyone raises) and builds nothing.

Inside torch's parallel styles and ``local_map`` (which pass ``run_check=False`` on every
layer) the global shape is taken where it is already known, and exchanged only where it is not
(:mod:`._local_boundaries`).

Left as torch has them: calls with ``shape=`` and ``stride=`` (torch's own way to give the
global shape; what DCP, pipelining and autograd use), other calls with ``run_check=False`` (the
caller vouches that shards are even), ``_StridedShard`` placements, meshes whose sharded dims
all have size 1, ``device_mesh=None``, local tensors of a subclass other than ``Parameter`` and
torch's ``AsyncCollectiveTensor`` (fake tensors), and tracing under ``torch.compile``.

Costs: nothing for the calls left as torch has them but one Python frame; one small
all-gather per mesh dim for the calls it acts on (on a GPU mesh also a device-to-host copy
of those integers).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.dtensors import holds_real_values
from dtensor_patches.dispatch.shards import stride_like
from dtensor_patches.mesh_rows import gather_rows
from dtensor_patches.patch import Patch, WrappedFunction
from dtensor_patches.patches.edges import _local_boundaries

OPS = ("_c10d_functional.all_gather_into_tensor.default",)  # the collective that mis-sizes

# Error bits, OR-ed across the mesh so that every rank raises alike.
_ERR_OTHER_DIM = 1
_ERR_LAYOUT = 2
_ERR_REPLICATE = 4
_ERR_NDIM = 8


def _chunk_sizes(total: int, parts: int) -> list[int]:
    """Lengths DTensor gives ``parts`` shards of a dim of length ``total`` (``torch.chunk``)."""
    step = -(-total // parts) if total else 0
    return [max(0, min(step, total - k * step)) for k in range(parts)]


def global_shape_and_stride(
    local: torch.Tensor, mesh: Any, placements: Sequence[Any]
) -> tuple[torch.Size, tuple[int, ...]]:
    """The global shape and stride of the DTensor whose shard on each rank of ``mesh`` is that
    rank's ``local`` (``placements``: one per mesh dim, ``Shard`` / ``Replicate`` /
    ``Partial``), exchanged over the mesh's groups. Collective: every rank of ``mesh`` calls it.

    Raises:
        ValueError: on every rank alike: the local lengths along a sharded dim are not
            DTensor's layout of their sum, local shapes differ in a dim that is not sharded
            there, or replicas differ in shape.
    """
    ndim = local.ndim
    shape = [int(s) for s in local.shape]
    error = 0
    detail = ""
    for mesh_dim in reversed(range(mesh.ndim)):
        parts = mesh.size(mesh_dim)
        if parts == 1:
            continue
        table = gather_rows(mesh, mesh_dim, [error, ndim, *shape])
        for row in table:
            error |= row[0]
        if len({row[1] for row in table}) > 1:
            error |= _ERR_NDIM
            detail = detail or f"local tensors of {sorted({r[1] for r in table})} dims"
            continue
        sizes = [row[2:] for row in table]
        placement = placements[mesh_dim]
        if placement.is_shard():
            dim = placement.dim % ndim if ndim else 0
            lengths = [s[dim] for s in sizes]
            others = {tuple(s[:dim] + s[dim + 1 :]) for s in sizes}
            total = sum(lengths)
            if len(others) > 1:
                error |= _ERR_OTHER_DIM
                detail = f"local shapes {sizes} differ outside dim {dim} on mesh dim {mesh_dim}"
            elif lengths != _chunk_sizes(total, parts):
                error |= _ERR_LAYOUT
                detail = (
                    f"local lengths {lengths} along dim {dim} (mesh dim {mesh_dim}) are not "
                    f"DTensor's layout of {total} over {parts} ranks ({_chunk_sizes(total, parts)})"
                )
            shape[dim] = total
        elif len({tuple(s) for s in sizes}) > 1:
            error |= _ERR_REPLICATE
            detail = f"replicas on mesh dim {mesh_dim} have different shapes {sizes}"
    if error:
        raise ValueError(
            "DTensor.from_local: the ranks' local tensors cannot form one DTensor with "
            f"placements {tuple(placements)}: "
            + (detail or "another rank's shapes do not fit (see its error)")
            + ". Give each rank torch.chunk's part of the global tensor (or pad), or pass "
            "shape= and stride= yourself"
        )
    return torch.Size(shape), stride_like(local, shape)


_SHARD: list[type] = []  # torch's Shard class, imported on first use (import time)


def _acts_on(mesh: Any, placements: Sequence[Any] | None) -> bool:
    """Whether ``placements`` shard over a mesh dim longer than 1, all with plain ``Shard``
    (a loop, not ``any``/``all`` over generators: this runs on every ``from_local``)."""
    if placements is None:
        return False
    if not _SHARD:
        from torch.distributed.tensor import Shard

        _SHARD.append(Shard)
    shard = _SHARD[0]
    sizes = _local_boundaries.mesh_sizes(mesh)
    acts = False
    for i, placement in enumerate(placements):
        if type(placement) is shard:
            acts = acts or (i < len(sizes) and sizes[i] > 1)
        elif placement.is_shard():
            return False  # _StridedShard: left as torch has it
    return acts


def _sizing(original: Any) -> Callable[..., Any]:
    from_local = _function(original)  # a plain function is cheaper to call than a staticmethod

    def from_local_sized(
        local_tensor: torch.Tensor,
        device_mesh: Any = None,
        placements: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """torch's ``DTensor.from_local``; on a sharded mesh without ``shape``/``stride``, with
        the global shape the ranks' local shapes give (``run_check=False`` calls: inside
        torch's parallel styles and ``local_map`` only, :mod:`._local_boundaries`)."""
        # Left as torch has it: device_mesh=None (torch's current mesh), a DTensor (torch
        # refuses it), and tracing under torch.compile (no collective on fake shapes). The
        # cheapest tests first: this runs on every from_local, in every parallel style.
        frame = _local_boundaries.current()
        if (
            device_mesh is not None
            and _acts_on(device_mesh, placements)
            and kwargs.get("shape") is None
            and kwargs.get("stride") is None
            and holds_real_values(local_tensor)
            and not torch.compiler.is_compiling()
        ):
            assert placements is not None
            sized = None
            if kwargs.get("run_check", True):
                sized = global_shape_and_stride(local_tensor, device_mesh, list(placements))
            elif frame is not None:
                sized = _local_boundaries.resolve(
                    frame, local_tensor, device_mesh, placements, global_shape_and_stride
                )
            if sized is not None:
                kwargs["shape"], kwargs["stride"] = sized
        result = from_local(local_tensor, device_mesh, placements, **kwargs)
        if frame is not None:
            frame.built.append(result.shape)
        return result

    return staticmethod(from_local_sized)  # type: ignore[return-value]


def _function(method: Any) -> Callable[..., Any]:
    return method.__func__ if isinstance(method, staticmethod) else method


def _style_input(original: Any) -> Any:
    """``Colwise/Rowwise/SequenceParallel._prepare_input_fn(..., mod, inputs, device_mesh)``
    run as a boundary of ``mod``."""
    fn = _function(original)

    @functools.wraps(fn)  # torch counts its parameters
    def prepare_input(*args: Any) -> Any:
        if _no_plain_tensor(args[-2]):
            return fn(*args)  # nothing to re-wrap: no boundary needed
        with _local_boundaries.boundary(args[-3], _in_features):
            return fn(*args)

    return staticmethod(prepare_input)


def _no_plain_tensor(inputs: Any) -> bool:
    """Whether a style's ``inputs`` (a tuple) hold no tensor ``from_local`` could re-wrap: the
    common case inside a TP + SP model, whose layers pass DTensors on (a loop over one or two
    items: this runs on every layer)."""
    for value in inputs:
        if isinstance(value, torch.Tensor) and holds_real_values(value):
            return False
    return True


def _in_features(module: Any) -> int | None:
    """A linear layer's input width (``weight``'s last dim, global): what a
    ``RowwiseParallel`` input sharded on its last dim adds up to."""
    if not isinstance(module, torch.nn.Linear):
        return None
    weight = getattr(module, "weight", None)
    if weight is not None and weight.ndim == 2:
        return int(weight.shape[1])
    return None


def _style_output(original: Any) -> Any:
    """``Colwise/Rowwise/SequenceParallel._prepare_output_fn(..., mod, outputs,
    device_mesh)``: a local output is tagged with its DTensor's global shape."""
    fn = _function(original)

    @functools.wraps(fn)  # torch counts its parameters
    def prepare_output(*args: Any) -> Any:
        outputs = args[-2]
        result = fn(*args)
        if holds_real_values(result) and hasattr(outputs, "device_mesh"):
            _local_boundaries.tag(result, outputs.device_mesh, outputs.shape)
        return result

    return staticmethod(prepare_output)


def _tag_results(sources: Sequence[Any], results: Sequence[Any], mesh: Any, built: list) -> None:
    """Tag each plain result with the global shape of its source: the DTensor it was, or the
    next DTensor ``from_local`` built in the boundary."""
    shapes = iter(built)
    for source, result in zip(sources, results, strict=False):
        shape = source.shape if hasattr(source, "device_mesh") else None
        if shape is None and holds_real_values(source):
            shape = next(shapes, None)
        if shape is not None and holds_real_values(result):
            _local_boundaries.tag(result, mesh, shape)


def _module_input_arg(original: Any) -> Any:
    """``PrepareModuleInput._prepare_input_arg(self, input, mesh, input_layout,
    desired_layout)``: a boundary of the style; a local result tagged."""

    @functools.wraps(original)
    def prepare_input_arg(self: Any, value: Any, mesh: Any, *args: Any, **kwargs: Any) -> Any:
        if not holds_real_values(value):
            # A DTensor (redistributed, no from_local: no boundary) or no tensor at all.
            result = original(self, value, mesh, *args, **kwargs)
            if hasattr(value, "device_mesh") and holds_real_values(result):
                _local_boundaries.tag(result, mesh, value.shape)
            return result
        with _local_boundaries.boundary(self) as built:
            result = original(self, value, mesh, *args, **kwargs)
        _tag_results([value], [result], mesh, built)
        return result

    return prepare_input_arg


def _module_output(original: Any) -> Any:
    """``PrepareModuleOutput._prepare_out_fn(self, outputs, device_mesh)``: a boundary of the
    style; local results tagged."""

    @functools.wraps(original)
    def prepare_out(self: Any, outputs: Any, mesh: Any) -> Any:
        with _local_boundaries.boundary(self) as built:
            result = original(self, outputs, mesh)
        many = isinstance(outputs, tuple)
        _tag_results(outputs if many else (outputs,), result if many else (result,), mesh, built)
        return result

    return prepare_out


def _local_map(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.distributed.tensor.experimental._func_map._local_map_wrapped(func, ...,
    *args)``: its outputs' ``from_local`` is a boundary of ``func``; unevenly sharded inputs
    mark their mesh."""

    @functools.wraps(original)
    def local_map_wrapped(func: Any, *args: Any, **kwargs: Any) -> Any:
        _local_boundaries.note_dtensor_inputs([*args, *kwargs.values()])
        with _local_boundaries.boundary(func):
            return original(func, *args, **kwargs)

    return local_map_wrapped


_STYLE = "torch.distributed.tensor.parallel.style:"


def _registrations() -> list[WrappedFunction]:
    styles = ("ColwiseParallel", "RowwiseParallel", "SequenceParallel")
    return [
        WrappedFunction("from_local", _sizing),
        *(WrappedFunction("_prepare_input_fn", _style_input, _STYLE + s) for s in styles),
        *(WrappedFunction("_prepare_output_fn", _style_output, _STYLE + s) for s in styles),
        WrappedFunction("_prepare_input_arg", _module_input_arg, _STYLE + "PrepareModuleInput"),
        WrappedFunction("_prepare_out_fn", _module_output, _STYLE + "PrepareModuleOutput"),
        WrappedFunction(
            "_local_map_wrapped",
            _local_map,
            "torch.distributed.tensor.experimental._func_map",
        ),
    ]


def reproduce(mesh: Any) -> str | None:
    """Rank ``r`` holds torch.chunk's part ``r`` of a ``[2k - 1, 3]`` tensor on ``k`` ranks
    (2 rows each, 1 on the last: every rank gets a part, and lengths differ) and wraps it
    with ``DTensor.from_local(local, mesh, [Shard(0)])``: the global
    shape, every rank's agreement on it, and the full value against the plain tensor."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    parts = mesh.size()
    if parts == 1:
        return None
    rows = 2 * parts - 1  # torch.chunk of 2k + 1 rows gives fewer than k parts on 4 ranks
    full = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    local = torch.chunk(full, parts)[mesh.get_local_rank()].clone()
    dt = DTensor.from_local(local, mesh, [Shard(0)])
    shapes: list[Any] = [None] * parts
    dist.all_gather_object(shapes, tuple(dt.shape), group=mesh.get_group())
    if len(set(shapes)) > 1 or shapes[0] != tuple(full.shape):
        return (
            f"from_local of local lengths {[len(c) for c in torch.chunk(full, parts)]}: the ranks "
            f"say the global shape is {shapes}, not {tuple(full.shape)}"
        )
    got = dt.full_tensor()
    return None if torch.equal(got, full) else "from_local of uneven shards: full_tensor() differs"


PATCH = Patch(
    name="from_local_uneven",
    summary=(
        "DTensor.from_local without shape= (parallel styles and local_map included) gets the "
        "true global shape of uneven shards"
    ),
    ops=OPS,
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    reproduce=reproduce,
    overrides_existing=True,
    communication=(
        "one all-gather of 32 integers per mesh dim longer than 1, for from_local calls "
        "without shape=/stride= or run_check=False on a sharded mesh, and inside parallel "
        "styles and local_map only where the global shape is not already known"
    ),
)

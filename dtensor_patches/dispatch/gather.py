"""The gather engine: gather the inputs, compute on full tensors, give every rank its shard.

Used by the fallback (:mod:`dtensor_patches.dispatch.fallback`) for every call torch refuses,
and by patches whose op gathers by nature (a data-dependent output shape, a strided view, a
convolution layout torch's handler does not compute). It depends on no patch.

- :func:`run_gathered`: the whole computation of a call, in-place and ``out=`` included,
  counted in ``dtensor_patches.fallback_report()``;
- :func:`replicated_result`: an op on gathered inputs, every output ``Replicate()``;
- :func:`inplace_through_full`: an in-place op on the gathered target, written back shard by
  shard;
- :func:`~.shards.shard_of` (re-exported): this rank's local tensor of a full value.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import torch

from dtensor_patches._torch.dtensors import (
    dtensor_class,
    first_mesh,
    full_tensor,
    local_tensor,
)
from dtensor_patches._torch.modes import current_autograd_node, queue_backward_callback
from dtensor_patches._torch.schemas import (
    argument_names,
    is_random,
    is_view_op,
    tree_flatten,
    tree_map,
    written_positions,
)
from dtensor_patches._torch.tables import implicit_replication_on
from dtensor_patches.dispatch import fallback_report, tracked_views
from dtensor_patches.dispatch.shards import (
    contiguous_stride,
    gather_full,
    partial_shares,
    shard_of,
)
from dtensor_patches.errors import PatchError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "contiguous_stride",
    "inplace_through_full",
    "partial_shares",
    "placements_text",
    "replicated_result",
    "run_gathered",
    "shard_of",
]


def _replicated(mesh: DeviceMesh, value: Any) -> Any:
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        return DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return value


def replicated_result(op_call: Any, args: Any, kwargs: Any) -> Any:
    """Run ``op_call`` on the gathered inputs; every tensor output is a ``Replicate()`` DTensor.

    Plain tensors among the arguments are taken as already replicated (the same on every rank).
    """
    mesh = first_mesh(tree_flatten((args, kwargs))[0])
    out = op_call(*tree_map(full_tensor, args), **tree_map(full_tensor, kwargs))
    return tree_map(lambda v: _replicated(mesh, v), out)


def inplace_through_full(op_call: Any, args: Any, kwargs: Any) -> Any:
    """Apply an in-place op to the gathered first argument, then write back this rank's shard.

    The caller's DTensor object (``args[0]``) is updated in place and keeps its placements;
    every rank sees every write, whichever shard it lands in.
    """
    target = args[0]
    full_args = tree_map(full_tensor, args)
    op_call(*full_args, **tree_map(full_tensor, kwargs))
    with torch.no_grad():
        local_tensor(target).copy_(shard_of(full_args[0], target.device_mesh, target.placements))
    return target


def placements_text(leaves: Sequence[Any]) -> str:
    """``"[4, 6](Shard(dim=0),)@2, ..."`` for the DTensors among ``leaves``."""
    dtensor = dtensor_class()
    parts = []
    for leaf in leaves:
        if isinstance(leaf, dtensor):
            mesh = "x".join(str(s) for s in leaf.device_mesh.shape)
            parts.append(f"{list(leaf.shape)}{tuple(leaf.placements)}@{mesh}")
    return ", ".join(parts)


def _scratch(original: Any, full: Any, targets: list[tuple[Any, torch.Tensor]]) -> Any:
    """Copies of a written argument's full tensors (a tensor or a list of them) for the op to
    write into; each tensor among them (a DTensor, or a plain ``out=``/``self`` tensor) is
    recorded in ``targets`` with its copy."""
    if isinstance(full, (list, tuple)):
        return type(full)(_scratch(o, f, targets) for o, f in zip(original, full, strict=True))
    if not isinstance(full, torch.Tensor):
        return full
    copy = full.clone()
    if isinstance(original, torch.Tensor):
        targets.append((original, copy))
    return copy


def _broadcast_from_origin(value: Any, mesh: DeviceMesh) -> Any:
    """``value`` (a plain tensor) as computed on mesh coordinate (0, …, 0), on every rank."""
    import torch.distributed as dist

    if not isinstance(value, torch.Tensor):
        return value
    out = value.contiguous()
    for mesh_dim in range(mesh.ndim):
        group = mesh.get_group(mesh_dim)
        dist.broadcast(out, src=dist.get_global_rank(group, 0), group=group)
    return out


def _describe(mesh: DeviceMesh, full: torch.Tensor, like: Sequence[Any]) -> Any:
    """``full`` (identical on every rank) as a DTensor: sharded like the first input of the
    same shape whose placements are ``Shard``/``Replicate`` only, else ``Replicate()``."""
    from torch.distributed.tensor import DTensor, Replicate

    placements: tuple[Any, ...] = (Replicate(),) * mesh.ndim
    for leaf in like:
        if (
            leaf.shape == full.shape
            and leaf.device_mesh == mesh
            and all(p.is_shard() or isinstance(p, Replicate) for p in leaf.placements)
        ):
            placements = tuple(leaf.placements)
            break
    if all(isinstance(p, Replicate) for p in placements):
        local = full
    else:
        local = shard_of(full, mesh, placements)
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
    )


def _with_scratch_targets(
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    full_args: tuple[Any, ...],
    full_kwargs: dict[str, Any],
    targets: list[tuple[Any, torch.Tensor]],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``full_args``/``full_kwargs`` with every argument ``op`` writes replaced by a copy (the
    caller's tensors are written only once all succeeded)."""
    names = argument_names(op)
    for i in written_positions(op):
        if i < len(args):
            copy = _scratch(args[i], full_args[i], targets)
            full_args = (*full_args[:i], copy, *full_args[i + 1 :])
        elif names[i] in kwargs:
            copy = _scratch(kwargs[names[i]], full_kwargs[names[i]], targets)
            full_kwargs = {**full_kwargs, names[i]: copy}
    return full_args, full_kwargs


def _check_plain_targets(
    op: Any, mesh: DeviceMesh, targets: list[tuple[Any, torch.Tensor]], error: BaseException | None
) -> None:
    """Refuse, before anything is written, a plain target the full result cannot go into.

    A plain ``out=``/``self`` tensor beside DTensors gets the full result on every rank, which
    is right only where it is read as the same on every rank: torch takes it so when it has
    one element or inside ``implicit_replication()`` (the fallback runs only after torch took
    it so; a patch handler sees the call before that check). The writes torch's own kernels
    refuse (an ``expand``-ed target, a resize of a storage that cannot grow) are refused with
    torch's message here, where the op wrote into a copy.

    Raises:
        MixedTensorError: a plain target of more than one element outside
            ``implicit_replication()`` (what it should hold is ambiguous).
        RuntimeError: a target with elements that share memory, or one to resize whose
            storage is not resizable (torch's messages).
    """
    from dtensor_patches.dispatch.mixed import ambiguity_error

    for target, copy in targets:
        if target.numel() != 1 and not implicit_replication_on():
            raise ambiguity_error(
                op,
                target,
                mesh,
                RuntimeError(
                    f"{op}: got mixed torch.Tensor and DTensor, need to convert all "
                    "torch.Tensor to DTensor before calling distributed operators!"
                ),
            ) from error
        if any(n > 1 and s == 0 for n, s in zip(target.shape, target.stride(), strict=True)):
            raise RuntimeError(
                "unsupported operation: more than one element of the written-to tensor refers "
                "to a single memory location. Please clone() the tensor before performing the "
                "operation."
            ) from error
        if target.shape != copy.shape:
            needed = (target.storage_offset() + copy.numel()) * target.element_size()
            storage = target.untyped_storage()
            if needed > storage.nbytes() and not storage.resizable():
                raise RuntimeError("Trying to resize storage that is not resizable") from error


def _write_back(
    op: Any,
    mesh: DeviceMesh,
    targets: list[tuple[Any, torch.Tensor]],
    error: BaseException | None,
) -> None:
    """Write every target: a DTensor gets this rank's shard of its full result, a plain tensor
    the full result itself (read as the same on every rank, as torch reads a plain argument
    it accepts; an ``out=`` one is resized as ``out=`` resizes, and a view's writes reach its
    base). Checks and shards first, writes last: a refused call writes nothing.

    Raises:
        PatchError: a DTensor target whose shape the op changed.
        MixedTensorError, RuntimeError: a plain target that cannot take the full result
            (:func:`_check_plain_targets`).
    """
    dtensor = dtensor_class()
    plain = [(t, c) for t, c in targets if not isinstance(t, dtensor)]
    targets = [(t, c) for t, c in targets if isinstance(t, dtensor)]
    for target, copy in targets:
        if tuple(copy.shape) != tuple(target.shape):
            change = f"({list(target.shape)} -> {list(copy.shape)})"
            if torch.Tag.inplace_view in getattr(op, "tags", ()):
                # squeeze_ and friends may reshape a DTensor in place, but only where each
                # rank's shard follows alone: not a sharded size-1 dim squeezed away, whose
                # values only some ranks hold.
                raise PatchError(
                    f"{op} reshapes a DTensor in place {change} in a way its shards cannot "
                    f"follow ({target.placements}: a dim it removes or moves is sharded, so "
                    "ranks would need each other's values, which an in-place view cannot "
                    "move); use the out-of-place op"
                ) from error
            # resize_ and friends: a DTensor's global shape cannot change in place.
            raise PatchError(
                f"{op} changes the shape of the DTensor it writes in place "
                f"{change}: a DTensor's shape cannot change in place; use the out-of-place op"
            ) from error
    _check_plain_targets(op, mesh, plain, error)
    shards = [
        (target, shard_of(copy, target.device_mesh, target.placements)) for target, copy in targets
    ]
    for target, copy in plain:
        if target.shape != copy.shape:
            target.resize_(copy.shape)
    for target, shard in shards:
        local_tensor(target).copy_(shard)
    for target, copy in plain:
        target.copy_(copy)


_ZEROS_HOOKED = "dtensor_patches.plain_zero_grads"
"""The key a hooked autograd node carries in its ``metadata`` (hooked once)."""


def _plain_zero_grads(
    op: Any, mesh: DeviceMesh, like: Sequence[Any], grad_inputs: Sequence[Any]
) -> tuple[Any, ...] | None:
    """The gradients a fallback op's own backward node gives its DTensor inputs, with plain
    zeros made DTensors (placed like the input of their shape, else ``Replicate()``).

    torch's derivative formulas that only need an input's shape (``zeros_like(self)``, e.g.
    ``reflection_pad1d_backward``'s gradient for ``self``) save a ``TypeAndSize`` and build
    ``at::zeros(sizes, options)``: a plain tensor, whatever the input's subclass. Beside the
    DTensor gradient of the same input, autograd's sum of the two then fails with ``got mixed
    torch.Tensor and DTensor`` (issue 23, item 19). Zeros hold the same values on every rank,
    so the DTensor reading is certain.

    Raises:
        PatchError: a plain gradient that is not all zeros (it is not the zeros above, and
            what it holds on each rank is not known): double backward through ``op`` is not
            supported then.
    """
    dtensor = dtensor_class()
    if not any(isinstance(g, torch.Tensor) and not isinstance(g, dtensor) for g in grad_inputs):
        return None
    fixed = []
    for g in grad_inputs:
        if isinstance(g, torch.Tensor) and not isinstance(g, dtensor):
            if bool(g.any()):
                raise PatchError(
                    f"double backward through {op} (run by the dtensor_patches fallback) is not "
                    f"supported: its backward gave a plain tensor of shape {list(g.shape)} for "
                    "a DTensor input"
                )
            g = _describe(mesh, g, like)
        fixed.append(g)
    return tuple(fixed)


def _hook_double_backward(op: Any, mesh: DeviceMesh, leaves: Sequence[Any], out: Any) -> None:
    """Inside a backward that builds a graph (``create_graph=True``): once this backward is
    done, hook the autograd node of each output of ``op`` (the node of its double backward)
    with :func:`_plain_zero_grads`. Only when every tensor argument is a DTensor (a plain
    tensor's gradient is plain by right)."""
    outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    like = [
        SimpleNamespace(shape=leaf.shape, device_mesh=leaf.device_mesh, placements=leaf.placements)
        for leaf in leaves
    ]

    def hook(grad_inputs: Sequence[Any], _grad_outputs: Sequence[Any]) -> Any:
        return _plain_zero_grads(op, mesh, like, grad_inputs)

    def register() -> None:
        for t in outputs:
            node = t.grad_fn
            if node is None:
                continue
            metadata = cast("dict[str, Any]", node.metadata)
            if not metadata.get(_ZEROS_HOOKED):
                metadata[_ZEROS_HOOKED] = True
                node.register_hook(hook)

    queue_backward_callback(register)


def run_gathered(
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    reason: str,
    *,
    error: BaseException | None = None,
) -> Any:
    """The fallback's computation, whatever the fallback's mode (patches that gather by nature
    use it), counted in ``fallback_report()`` with ``reason``:

    1. every DTensor argument is gathered to ``Replicate()`` (``Partial`` ones reduced);
    2. the op runs once on the full local tensors, below autograd;
    3. an output with the shape of an input (``Shard``/``Replicate`` only) takes that input's
       placements by keeping this rank's chunk, with no communication; any other output is
       ``Replicate()``;
    4. in-place and ``out=`` calls write this rank's shard of the full result into the
       caller's local tensor (placements kept), and the full result into a plain target
       (one torch reads as the same on every rank), after the whole computation succeeded;
    5. random ops run on every rank and the result of mesh coordinate ``(0, …, 0)`` is
       broadcast, so every rank holds the same values;
    6. a view op's result is a tracked view (:mod:`.tracked_views`): a copy, whose writes are
       carried into the tensor it was made from.

    Raises:
        PatchError: DTensor arguments on different meshes; an in-place op that changes the
            shape of its target.
        MixedTensorError: a plain write target whose meaning is ambiguous (more than one
            element, outside ``implicit_replication()``); nothing is written.
        Exception: whatever the op raises on the full plain tensors; nothing is written then.
    """
    dtensor = dtensor_class()
    leaves = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, dtensor)]
    placements = placements_text(leaves)
    mesh = leaves[0].device_mesh
    if any(leaf.device_mesh != mesh for leaf in leaves):
        raise PatchError(
            f"{op}: DTensor arguments on different meshes ({placements}); redistribute them "
            "onto one mesh first"
        ) from error
    moved = 0
    # A backward op run while a backward builds a graph (create_graph=True): its double
    # backward's node is hooked (item 19). Checked only here, on the fallback's path.
    double_backward = (
        torch.is_grad_enabled()
        and current_autograd_node() is not None
        and all(
            isinstance(x, dtensor)
            for x in tree_flatten((args, kwargs))[0]
            if isinstance(x, torch.Tensor)
        )
    )

    def gather(value: Any) -> Any:
        nonlocal moved
        full, n = gather_full(value)
        moved += n
        return full

    with torch.no_grad():
        full_args = tree_map(gather, args)
        full_kwargs = tree_map(gather, kwargs)
        targets: list[tuple[Any, torch.Tensor]] = []
        if written_positions(op):
            full_args, full_kwargs = _with_scratch_targets(
                op, args, kwargs, full_args, full_kwargs, targets
            )
        out = op(*full_args, **full_kwargs)
        if is_random(op):
            out = tree_map(lambda v: _broadcast_from_origin(v, mesh), out)
            targets = [(t, _broadcast_from_origin(c, mesh)) for t, c in targets]
        fallback_report.count(op, placements, moved, reason)
        if targets:
            _write_back(op, mesh, targets, error)
            by_copy = {id(copy): target for target, copy in targets}

            def result(v: Any) -> Any:
                if not isinstance(v, torch.Tensor):
                    return v
                return by_copy[id(v)] if id(v) in by_copy else _describe(mesh, v, leaves)

            return tree_map(result, out)
        described = tree_map(
            lambda v: _describe(mesh, v, leaves) if isinstance(v, torch.Tensor) else v, out
        )
    if double_backward:
        _hook_double_backward(op, mesh, leaves, described)
    if args and isinstance(args[0], dtensor) and is_view_op(op):
        # A view cannot alias across ranks: its values are a copy, and an in-place write into
        # it is carried into the tensor it was made from.
        return tracked_views.track(described, args[0], op, tuple(args[1:]), dict(kwargs))
    return described

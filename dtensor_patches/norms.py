"""The global gradient norm over gradients on any mix of meshes and placements, beside plain
gradients, and clipping by it: :func:`grad_norm` and :func:`clip_grad_norm_` (issue 20).

RL and LLM-training stacks each carry a private copy of this computation, several of them
silently wrong: TP-replicated gradients counted once per TP rank, the norm read from one
rank's share, replicated axes counted again on each of an expert-parallel and a data-parallel
mesh. Torch's ``clip_grad_norm_`` cannot combine norms across meshes. Here each gradient adds
``sum(|local|^p)`` of its local shard to the **reduction group** of its mesh: the ranks of the
mesh dims that any gradient of that mesh is sharded on (from this rank, the sub-mesh through
its coordinate). A gradient ``Replicate()`` on one of those dims is weighted by ``1 / size``
of the dim, so every element counts once; a gradient sharded on none of them counts locally.
``Partial`` gradients are reduced first (to ``Replicate()`` on those dims: the one case that
moves a whole tensor; those of one mesh, pending dims and dtype together, in one flat
all-reduce per pending dim, not one ``redistribute`` each). Groups of the same ranks from
different meshes are merged; then one all-reduce per distinct group (``SUM`` of the powers,
or ``MAX`` for ``norm_type=inf``, with a NaN flag so a NaN on one rank is a NaN everywhere),
and one more over ``pp_group`` if given. The result is the same on every rank, computed without a host
sync: a ``Replicate()`` DTensor when every gradient is on one mesh, else a plain 0-dim tensor.

A replicated gradient of another sub-mesh's replica (an expert on ``mesh["ep"]`` of ranks
``{0, 1}``, and the same expert on ``{2, 3}``) is counted once: each sub-mesh's group sums its
own, and the replicas agree.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from dtensor_patches._torch.dtensors import dtensor_class, local_tensor
from dtensor_patches._torch.modes import foreach_mul_, foreach_norm

__all__ = ["PlainGrads", "clip_grad_norm_", "grad_norm"]

PlainGrads = Literal["auto", "replicated", "per_rank"]
"""How plain (non-DTensor) gradients are counted: the same on every rank and counted once
(``"replicated"``), each rank's own and summed over the group (``"per_rank"``), or told apart by
one all-gather of one scalar per rank (``"auto"``)."""

_GROUPS_LOCK = threading.Lock()
_FLAT_GROUPS: dict[tuple[int, ...], tuple[Any, Any]] = {}  # ranks -> (world, group)
_RANKS: dict[tuple[Any, ...], tuple[int, ...]] = {}  # (mesh, dims, coordinate) -> sub-mesh ranks


def _auto_plain_norm(norm: torch.Tensor, norm_type: float, group: Any) -> torch.Tensor:
    """The norm of the plain gradients of every rank (``plain="auto"``), the same on each:
    ``norm`` is this rank's. One all-gather of the per-rank norms tells the readings apart:
    equal on every rank means replicated (counted once), else each rank's own (FSDP2
    ``ignored_params`` whose gradients are not reduced), combined. A process group of one rank
    (or none initialized) needs no collective."""
    if not dist.is_available() or not dist.is_initialized():
        return norm
    world = dist.get_world_size(group)
    if world == 1:
        return norm
    # The same on every rank, so clipping scales every shard of a DTensor by one coefficient.
    gathered = [torch.empty_like(norm) for _ in range(world)]
    dist.all_gather(gathered, norm.contiguous(), group=group)
    norms = torch.stack(gathered)
    if bool((norms == norms[0]).all() | norms.isnan().all()):
        return norms[0]
    return torch.linalg.vector_norm(norms, float(norm_type))


def _by_layout(tensors: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """The positions of ``tensors`` per (device, dtype): one ``_foreach`` call each."""
    positions: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        positions.setdefault((t.device, t.dtype), []).append(i)
    return positions


def _inf_term(values: torch.Tensor) -> torch.Tensor:
    """``[max of values, any NaN]`` (NaNs left out of the max): the inf-norm's share, reduced
    with ``MAX`` so that a NaN on one rank is a NaN on every rank."""
    isnan = values.isnan()
    return torch.stack([torch.where(isnan, 0.0, values).max(), isnan.any().to(values.dtype)])


@dataclass
class _Group:
    """One reduction group: the process group (``None``: this rank only) and its terms."""

    pg: Any
    device: torch.device
    tensors: list[torch.Tensor] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)


def _as_grads(parameters_or_grads: Any) -> list[torch.Tensor]:
    items = (
        [parameters_or_grads]
        if isinstance(parameters_or_grads, torch.Tensor)
        else list(parameters_or_grads)
    )
    grads = []
    for t in items:
        if isinstance(t, torch.nn.Parameter) or t.requires_grad:
            if t.grad is not None:
                grads.append(t.grad)
        else:
            grads.append(t)
    return grads


def _norm_type(norm_type: float) -> float:
    p = float(norm_type)
    if not (p > 0 or p == math.inf):
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type!r}")
    return p


def _reduce_device(pg: Any, fallback: torch.device) -> torch.device:
    if pg is not None and dist.get_backend(pg) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu") if pg is not None else fallback


def _flat_group(ranks: tuple[int, ...], like: Any) -> Any:
    """A process group over ``ranks`` (the sub-mesh of several mesh dims), made once by those
    ranks only; the world where it is the world."""
    if len(ranks) == dist.get_world_size():
        return dist.group.WORLD
    world = dist.group.WORLD
    with _GROUPS_LOCK:
        entry = _FLAT_GROUPS.get(ranks)
        if entry is None or entry[0] is not world:
            group = dist.new_group(
                list(ranks), backend=dist.get_backend(like), use_local_synchronization=True
            )
            entry = _FLAT_GROUPS[ranks] = (world, group)
        return entry[1]


def _sub_mesh_ranks(mesh: Any, dims: tuple[int, ...]) -> tuple[int, ...]:
    """The ranks of the sub-mesh of ``dims`` through this rank's coordinate (read from the
    mesh's rank tensor once per mesh, dims and coordinate: it costs tens of microseconds)."""
    coordinate = mesh.get_coordinate()
    key = (mesh, dims, tuple(coordinate))
    ranks = _RANKS.get(key)
    if ranks is None:
        index = tuple(slice(None) if d in dims else c for d, c in enumerate(coordinate))
        ranks = tuple(sorted(int(r) for r in mesh.mesh[index].flatten().tolist()))
        _RANKS[key] = ranks
    return ranks


def _splits(placement: Any) -> bool:
    """Whether a placement splits the data over its mesh dim: ``Shard`` and ``_StridedShard``
    (FSDP2 over TP; not a ``Shard`` subclass on every release), anything neither replicated
    nor pending."""
    return not (placement.is_replicate() or placement.is_partial())


_REDUCE_OPS = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN"}


def _batched(placement: Any, partial: type) -> bool:
    """Whether a pending placement is torch's own ``Partial`` of an op an all-reduce does
    (not a subclass such as the vocab mask's, whose reduction is its own)."""
    return type(placement) is partial and getattr(placement, "reduce_op", None) in _REDUCE_OPS


def _reduced(dtensors: list[Any]) -> list[tuple[Any, tuple[Any, ...], torch.Tensor]]:
    """Each gradient as ``(mesh, placements, local tensor)`` with nothing pending: a ``Partial``
    gradient's local tensor is reduced over its pending mesh dims and its placement there
    becomes ``Replicate()``. Gradients of the same mesh, pending dims and ops, dtype and device
    go in one flat all-reduce per pending dim (sequence-parallel norm weights: one collective,
    not one ``redistribute`` each); the gradients themselves are left as they are."""
    from torch.distributed.tensor import Partial, Replicate

    out: list[Any] = []
    buckets: dict[tuple[Any, ...], list[int]] = {}
    for g in dtensors:
        mesh, placements, local = g.device_mesh, tuple(g.placements), local_tensor(g)
        pending = tuple((d, p.reduce_op) for d, p in enumerate(placements) if p.is_partial())
        if pending and all(_batched(placements[d], Partial) for d, _ in pending):
            key = (mesh, pending, local.dtype, local.device)
            buckets.setdefault(key, []).append(len(out))
        elif pending:
            wanted = [Replicate() if p.is_partial() else p for p in placements]
            g = g.redistribute(mesh, wanted)
            placements, local = tuple(g.placements), local_tensor(g)
        out.append((mesh, placements, local))
    for (mesh, pending, _, device), positions in buckets.items():
        flat = torch.cat([out[i][2].reshape(-1) for i in positions])
        for mesh_dim, op in pending:
            pg = mesh.get_group(mesh_dim)
            target = _reduce_device(pg, device)
            buffer = flat if flat.device == target else flat.to(target)
            dist.all_reduce(buffer, op=getattr(dist.ReduceOp, _REDUCE_OPS[op]), group=pg)
            if op == "avg":
                buffer.div_(mesh.size(mesh_dim))
            flat = buffer if buffer.device == device else buffer.to(device)
        parts = flat.split([out[i][2].numel() for i in positions])
        for i, part in zip(positions, parts, strict=True):
            _, placements, local = out[i]
            replicated = tuple(Replicate() if p.is_partial() else p for p in placements)
            out[i] = (mesh, replicated, part.view(local.shape))
    return out


def _layout(
    device: torch.device,
    mesh: Any,
    placements: tuple[Any, ...],
    union: list[int],
    by_ranks: dict[Any, _Group],
    local: _Group,
) -> tuple[_Group, float]:
    """The group a gradient of this mesh and placements adds to, and its weight: ``1 / size``
    of each dim of the mesh's reduction group it is replicated on."""
    dims = tuple(union)
    if not any(_splits(placements[d]) for d in dims):
        return local, 1.0
    weight = 1.0
    for d in dims:
        if not _splits(placements[d]):
            weight /= mesh.size(d)
    ranks = _sub_mesh_ranks(mesh, dims)
    entry = by_ranks.get(ranks)
    if entry is None:
        pg = mesh.get_group(dims[0]) if len(dims) == 1 else _flat_group(ranks, mesh.get_group(0))
        entry = by_ranks[ranks] = _Group(pg, device)
    return entry, weight


def _groups(
    grads: list[torch.Tensor], plain: PlainGrads, group: Any
) -> tuple[list[_Group], list[torch.Tensor], Any]:
    """The reduction groups (in first-use order, the same on every rank), the plain
    gradients of ``plain="auto"``, and the one mesh of every DTensor (``None`` if several or
    none)."""
    dtensor = dtensor_class()
    shards = _reduced([g for g in grads if isinstance(g, dtensor)])
    # Keyed by the mesh's value (DeviceMesh compares by layout): FSDP2 and TP can hand out
    # equal meshes as different objects, and they must share one reduction group.
    sharded_dims: dict[Any, set[int]] = {}
    meshes: dict[Any, Any] = {}
    for mesh, placements, _ in shards:
        union = sharded_dims.setdefault(mesh, set())
        meshes[mesh] = mesh
        union.update(d for d, p in enumerate(placements) if _splits(p))
    by_ranks: dict[Any, _Group] = {}
    local = _Group(None, grads[0].device if grads else torch.device("cpu"))
    # Per (mesh, placements): the group entry (or the local one) and the weight, worked out
    # once per call, not per gradient (a model has few distinct layouts and many gradients).
    layouts: dict[tuple[Any, tuple[Any, ...]], tuple[_Group, float]] = {}
    for mesh, placements, shard in shards:
        layout = layouts.get((mesh, placements))
        if layout is None:
            layout = layouts[(mesh, placements)] = _layout(
                shard.device, mesh, placements, sorted(sharded_dims[mesh]), by_ranks, local
            )
        entry, weight = layout
        entry.tensors.append(shard)
        entry.weights.append(weight)
    plains = [g for g in grads if not isinstance(g, dtensor)]
    auto: list[torch.Tensor] = []
    if plain == "replicated" or not (dist.is_available() and dist.is_initialized()):
        local.tensors += plains
        local.weights += [1.0] * len(plains)
    elif plain == "per_rank" and plains:
        pg = group if group is not None else dist.group.WORLD
        key = tuple(sorted(dist.get_process_group_ranks(pg)))
        entry = by_ranks.get(key) or by_ranks.setdefault(key, _Group(pg, local.device))
        entry.tensors += plains
        entry.weights += [1.0] * len(plains)
    else:
        auto = plains
    only_mesh = next(iter(meshes.values())) if len(meshes) == 1 and not plains else None
    return [local, *by_ranks.values()], auto, only_mesh


def _norms(
    tensors: list[torch.Tensor], p: float, foreach: bool | None, dtype: torch.dtype
) -> list[torch.Tensor]:
    """Per-tensor ``p``-norms in ``dtype`` (on each tensor's device)."""
    if not tensors:
        return []
    use_foreach = foreach if foreach is not None else all(t.is_cuda for t in tensors)
    if use_foreach:
        out: list[torch.Tensor | None] = [None] * len(tensors)
        for (_, tensor_dtype), positions in _by_layout(tensors).items():
            if _narrows(tensor_dtype, dtype):
                norms = [n.to(dtype) for n in foreach_norm()([tensors[i] for i in positions], p)]
            else:
                norms = foreach_norm()([tensors[i] for i in positions], p, dtype=dtype)
            for i, n in zip(positions, norms, strict=True):
                out[i] = n
        return [n for n in out if n is not None]
    return [
        torch.linalg.vector_norm(t, p).to(dtype)
        if _narrows(t.dtype, dtype)
        else torch.linalg.vector_norm(t, p, dtype=dtype)
        for t in tensors
    ]


def _narrows(tensor_dtype: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether reading ``tensor_dtype`` in ``dtype`` loses precision (float64 gradients with the
    float32 default): torch's norms refuse it, so those norms are taken in their own dtype."""
    return torch.promote_types(tensor_dtype, dtype) != dtype


def _term(entry: _Group, p: float, foreach: bool | None, dtype: torch.dtype) -> torch.Tensor:
    """This rank's share of one group: ``[sum w * norm^p]``, or ``[max norm, any NaN]`` for
    the inf-norm, on the group's reduction device."""
    device = _reduce_device(entry.pg, entry.device)
    norms = [n.to(device) for n in _norms(entry.tensors, p, foreach, dtype)]
    if math.isinf(p):
        if not norms:
            return torch.zeros(2, dtype=dtype, device=device)
        return _inf_term(torch.stack(norms))
    total = torch.zeros((), dtype=dtype, device=device)
    # One stacked sum per distinct weight (a few: 1, 1/tp, ...), scaled by a Python number:
    # no per-gradient kernels, and no host-to-device copy of the weights.
    by_weight: dict[float, list[torch.Tensor]] = {}
    for n, w in zip(norms, entry.weights, strict=True):
        by_weight.setdefault(w, []).append(n)
    for w, group_norms in by_weight.items():
        total = total + torch.stack(group_norms).pow(p).sum() * w
    return total.reshape(1)


def _combine(terms: list[torch.Tensor], p: float, device: torch.device) -> torch.Tensor:
    terms = [t.to(device) for t in terms]
    if math.isinf(p):
        stacked = torch.stack(terms)
        value = stacked[:, 0].max()
        return torch.where(stacked[:, 1].max() > 0, torch.full_like(value, math.nan), value)
    return torch.stack([t[0] for t in terms]).sum()


def _all_reduce(term: torch.Tensor, p: float, pg: Any) -> None:
    if dist.get_world_size(pg) == 1:
        return
    op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
    dist.all_reduce(term, op=op, group=pg)


@torch.no_grad()
def grad_norm(
    parameters_or_grads: Any,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    plain: PlainGrads = "replicated",
    group: Any = None,
    pp_group: Any = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The ``norm_type``-norm of all gradients together, over every rank: the norm the same
    model would have on one device.

    Args:
        parameters_or_grads: a tensor or an iterable of tensors: parameters (an
            ``nn.Parameter`` or any tensor that requires grad: its ``.grad``, skipped where
            ``None``) or gradients themselves. DTensors on any meshes (FSDP2, HSDP 2-D, TP, EP,
            CP), with ``Shard``/``_StridedShard`` (uneven too), ``Replicate`` (each element
            counted once) and ``Partial`` (reduced first) placements, CPU-offloaded local
            tensors, and plain tensors. Every rank passes its gradients of the same model in
            the same order.
        norm_type: ``p`` > 0 (1, 2, ...) or ``inf``.
        error_if_nonfinite: raise if the norm is NaN or inf (a host sync, as torch's).
        foreach: per-tensor norms with ``torch._foreach_norm`` (default: where every tensor is
            on CUDA).
        plain: how plain gradients are counted (:data:`PlainGrads`; default
            ``"replicated"``: a parameter outside FSDP2/TP, the same on every rank).
        group: the ranks ``plain="per_rank"``/``"auto"`` gradients are spread over (default:
            the world).
        pp_group: the pipeline-parallel group: each stage holds its own parameters, and the
            stages' totals are combined over it (one more all-reduce).
        dtype: the floating dtype the norms are computed and summed in (``torch.float64``
            for a float64 reference; bf16 gradients are read, not copied, into it on CUDA).

    Returns:
        A 0-dim ``dtype`` tensor, the same on every rank: a ``Replicate()`` DTensor when every
        gradient is a DTensor of one mesh (``.item()`` and ``.full_tensor()`` read it with no
        collective), else a plain tensor on the first gradient's device. NaN or inf where any
        gradient holds one, on every rank alike. ``0`` for no gradients.

    Communication: one all-reduce of one number (two for ``inf``) per distinct reduction
    group, plus one over ``pp_group``; an all-gather of one scalar per rank for
    ``plain="auto"``; for ``Partial`` gradients, one all-reduce of their local tensors together
    per mesh, pending mesh dim and dtype (a ``redistribute`` each for subclasses of
    ``Partial``). No host sync unless
    ``error_if_nonfinite``.

    Raises:
        ValueError: ``norm_type`` is not > 0 or inf; ``plain`` is not one of its readings.
        RuntimeError: ``error_if_nonfinite`` and the norm is not finite (torch's message).
    """
    p = _norm_type(norm_type)
    if plain not in ("auto", "replicated", "per_rank"):
        raise ValueError(f"plain must be 'auto', 'replicated' or 'per_rank', got {plain!r}")
    grads = _as_grads(parameters_or_grads)
    entries, auto, only_mesh = _groups(grads, plain, group)
    out_device = grads[0].device if grads else torch.device("cpu")
    if only_mesh is not None and only_mesh.device_type != "cpu":
        out_device = _reduce_device(only_mesh.get_group(0), out_device)
    terms = []
    for entry in entries:
        term = _term(entry, p, foreach, dtype)
        if entry.pg is not None:
            _all_reduce(term, p, entry.pg)
        terms.append(term)
    if auto:
        norm = torch.linalg.vector_norm(torch.stack(_norms(auto, p, foreach, dtype)), p)
        norm = _auto_plain_norm(norm, p, group)
        terms.append(_inf_term(norm.reshape(1)) if math.isinf(p) else norm.pow(p).reshape(1))
    total = _combine(terms, p, out_device)
    if pp_group is not None:
        term = _inf_term(total.reshape(1)) if math.isinf(p) else total.reshape(1)
        term = term.to(_reduce_device(pp_group, out_device))
        _all_reduce(term, p, pp_group)
        total = _combine([term], p, out_device)
    result = total if math.isinf(p) else total.pow(1.0 / p)
    if error_if_nonfinite and bool(torch.logical_or(result.isnan(), result.isinf())):
        raise RuntimeError(
            f"The total norm of order {p} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the "
            "non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    if only_mesh is not None:
        from torch.distributed.tensor import DTensor, Replicate

        return DTensor.from_local(
            result, only_mesh, [Replicate()] * only_mesh.ndim, run_check=False
        )
    return result


@torch.no_grad()
def clip_grad_norm_(
    parameters: Any,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    plain: PlainGrads = "replicated",
    group: Any = None,
    pp_group: Any = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over any mix of meshes, placements and plain
    gradients: the gradients are scaled in place by ``min(1, max_norm / (norm + 1e-6))``
    (torch's coefficient), with ``norm`` the global :func:`grad_norm`, so that every shard of
    every gradient is scaled by the one coefficient.

    Args:
        parameters: as :func:`grad_norm` (parameters: their ``.grad`` is scaled).
        max_norm: the norm to clip to (> 0).
        norm_type, error_if_nonfinite, foreach, plain, group, pp_group, dtype: as
            :func:`grad_norm`.

    Returns:
        The norm before clipping (see :func:`grad_norm`).

    Raises:
        ValueError, RuntimeError: as :func:`grad_norm`; nothing is scaled then.
    """
    grads = _as_grads(parameters)
    total = grad_norm(
        grads,
        norm_type,
        error_if_nonfinite=error_if_nonfinite,
        foreach=foreach,
        plain=plain,
        group=group,
        pp_group=pp_group,
        dtype=dtype,
    )
    dtensor = dtensor_class()
    value = local_tensor(total) if isinstance(total, dtensor) else total
    coefficient = torch.clamp(float(max_norm) / (value + 1e-6), max=1.0)
    locals_ = [local_tensor(g) if isinstance(g, dtensor) else g for g in grads]
    for (device, grad_dtype), positions in _by_layout(locals_).items():
        tensors = [locals_[i] for i in positions]
        scale = coefficient.to(device=device, dtype=grad_dtype)
        if foreach or (foreach is None and device.type == "cuda"):
            foreach_mul_()(tensors, scale)
        else:
            for t in tensors:
                t.mul_(scale)
    return total

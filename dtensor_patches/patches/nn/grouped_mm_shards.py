"""MoE experts under tensor parallelism: ``torch._grouped_mm`` on sharded experts (2.9 to 2.15).

Trigger: the grouped matmul of MoE expert layers (``torch._grouped_mm(x, w, offs=offs)``,
``transformers``' ``grouped_mm`` experts implementation, torchtitan's ``GroupedExperts``) with
DTensor expert weights ``w`` ``[E, K, N]``:

- weights sharded over experts (``Shard(0)``: each TP rank holds ``E / tp`` experts, tokens
  replicated and sorted by expert, ``offs`` the cumulative token counts): torch's strategy
  has no such placement and all-gathers every expert weight to every rank, forward and
  backward (and the weight gradient comes back ``Replicate()``, computed for every expert on
  every rank);
- any float32 or float16 call (the CPU kernel takes them): torch's sharding propagation runs
  the op's meta function, which accepts bfloat16 only (``Expected inputs of BF16 type``), so
  DTensor refuses every non-bf16 grouped matmul, the column- and row-wise TP layouts torch has
  strategies for included (measured on 2.9.1, 2.11.0, 2.13.0, 2.15.0).

Fix (a miss rule on ``aten._grouped_mm.default``, decided once per sharding schema): on each
mesh dim the inputs' placements select a local computation from the table below, and each
rank runs the kernel on its local tensors. ``Shard(0)`` experts: the rank takes the rows of
its own experts (``offs`` read on the host: two integers), runs them with ``offs`` made local,
and leaves zeros in the other rows, so the output is ``Partial(sum)``; the weight gradient
(``x.T`` by the output gradient, grouped by ``offs``) is computed only for the rank's experts
and comes back ``Shard(0)``, like the weight, when its ``offs`` belong to such a forward
(remembered per ``offs`` tensor, weakly), else replicated as torch would. A ``Partial`` token
tensor in an expert layer (the activation of the rows just computed, or its gradient) is
exact on the rows of the rank's experts: one 1-element all-reduce checks that each rank's
share is zero elsewhere, and where it is not the tensor is summed first. Other layouts:
column-wise ``Shard`` of ``N``, row-wise ``Shard`` of ``K`` (``Partial`` output; a replicated
operand is cut to the matching block first, no collective), batch ``Shard(0)``, ``Partial``
times ``Replicate``. A layout outside the table, or a bfloat16 call in a layout torch serves
itself, keeps torch's decision. A shard whose rows are shorter than the 16 bytes the kernels
require for every stride (2 float32 columns of an expert on 4 TP ranks: "strides should be
multiple of 16 bytes") is padded with zeros to the next 16 bytes for the kernel and the
padding cut off its output (a copy, only for such shards).

Per mesh dim (``x`` = mat1, ``w`` = mat2, ``offs`` replicated):

============  ==================  ==========  ==========================================
call          x, w                output      what each rank does
============  ==================  ==========  ==========================================
2-D x 3-D     R or P, Shard(0)    Partial     its experts' rows (P: checked as owned)
2-D x 3-D     R, Shard(2)         Shard(1)    kernel on shards
2-D x 3-D     Shard(1), Shard(1)  Partial     kernel on shards
2-D x 3-D     R, Shard(1)         Partial     x cut along K, kernel on shards
2-D x 3-D     Shard(1), R         Partial     w cut along K, kernel on shards
2-D x 2-D     R or P, R or P      Shard(0)    its experts' blocks (1-D mesh, expert offs)
2-D x 2-D     Shard(0), R         Shard(1)    kernel on shards
2-D x 2-D     R, Shard(1)         Shard(2)    kernel on shards
3-D x 3-D     Shard(0), Shard(0)  Shard(0)    kernel on shards (also R cut to Shard(0))
3-D x 3-D     R, Shard(2)         Shard(2)    kernel on shards
3-D x 3-D     Shard(1), R         Shard(1)    kernel on shards
3-D x 3-D     Shard(2), Shard(1)  Partial     kernel on shards (also R cut to match)
any           Partial, R / R, P   Partial     kernel on shards
============  ==================  ==========  ==========================================
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from packaging.specifiers import SpecifierSet
from torch.utils.weak import WeakIdKeyDictionary

from dtensor_patches._torch.dtensors import is_dtensor, local_tensor
from dtensor_patches._torch.schemas import resolve_op
from dtensor_patches.dispatch.miss_rules import DivertedCall, NativeDecision
from dtensor_patches.dispatch.shards import sharded_result
from dtensor_patches.errors import first_line
from dtensor_patches.patch import MissRule, Patch
from dtensor_patches.patches._along_shards import shard_extent
from dtensor_patches.reproducers import compare, randn

OP = "aten._grouped_mm.default"
EXPERTS = "experts"  # this rank's experts' rows (a Partial share) or blocks (a Shard(0) shard)
MAYBE_EXPERTS = "experts?"  # a replicated weight-gradient call: experts' blocks if its offs
# belong to an expert-sharded forward, else replicated

Slice = tuple[int, int] | None  # (operand 0 or 1, tensor dim) cut to this rank's block first

# (mat1 ndim, mat2 ndim) -> {(mat1 code, mat2 code): (output code, slice)} per mesh dim
_TABLE: dict[tuple[int, int], dict[tuple[str, str], tuple[str, Slice]]] = {
    (2, 3): {
        ("R", "R"): ("R", None),
        ("R", "S0"): (EXPERTS, None),
        ("P", "S0"): (EXPERTS, None),  # rows of one's experts from an expert layer: see _owned
        ("R", "S2"): ("S1", None),
        ("S1", "S1"): ("P", None),
        ("R", "S1"): ("P", (0, 1)),
        ("S1", "R"): ("P", (1, 1)),
    },
    (2, 2): {
        ("R", "R"): (MAYBE_EXPERTS, None),
        ("P", "R"): (MAYBE_EXPERTS, None),
        ("R", "P"): (MAYBE_EXPERTS, None),
        ("S0", "R"): ("S1", None),
        ("R", "S1"): ("S2", None),
    },
    (3, 3): {
        ("R", "R"): ("R", None),
        ("S0", "S0"): ("S0", None),
        ("R", "S2"): ("S2", None),
        ("S1", "R"): ("S1", None),
        ("S2", "S1"): ("P", None),
        ("R", "S1"): ("P", (0, 2)),
        ("S2", "R"): ("P", (1, 1)),
        ("S0", "R"): ("S0", (1, 0)),
        ("R", "S0"): ("S0", (0, 0)),
    },
}

# offs (local tensors) of expert-sharded forward calls: their weight gradients are computed
# per expert shard. Weak: gone with the step's autograd graph.
_EXPERT_OFFS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _code(placement: Any) -> str | None:
    if placement.is_replicate():
        return "R"
    if placement.is_shard():
        return f"S{placement.dim}"
    if placement.is_partial() and getattr(placement, "reduce_op", "sum") == "sum":
        return "P"
    return None


def _plan(
    nd1: int, nd2: int, p1: Sequence[str | None], p2: Sequence[str | None]
) -> list[tuple[str, Slice]] | None:
    """``(output code, slice)`` per mesh dim, or ``None`` where a mesh dim has no entry of the
    table (or an operand would be cut along a dim another mesh dim shards too)."""
    table = _TABLE.get((nd1, nd2))
    if table is None:
        return None
    plan: list[tuple[str, Slice]] = []
    for a, b in zip(p1, p2, strict=True):
        if a is None or b is None:
            return None
        if (a, b) in table:
            plan.append(table[(a, b)])
        elif {a, b} == {"P", "R"}:
            plan.append(("P", None))
        else:
            return None
    if len(plan) > 1:
        # which mesh dim holds the experts of a replicated weight-gradient call is not known
        plan = [
            ("P" if "P" in (a, b) else "R", cut) if c == MAYBE_EXPERTS else (c, cut)
            for (c, cut), a, b in zip(plan, p1, p2, strict=True)
        ]
    if sum(c == EXPERTS for c, _ in plan) > 1:
        return None
    for m, (_c, cut) in enumerate(plan):
        if cut is not None:
            codes = p1 if cut[0] == 0 else p2
            if any(f"S{cut[1]}" == code for i, code in enumerate(codes) if i != m):
                return None
    return plan


def _rule(schema: Any, native: NativeDecision) -> DivertedCall | None:
    args = schema.args_schema
    if len(args) < 2 or (len(args) > 3 and args[3] is not None):
        return None  # a bias: torch's own path (it refuses one too)
    mat1, mat2 = args[0], args[1]
    p1, p2 = _codes(mat1), _codes(mat2)
    if p1 is None or p2 is None:
        return None
    offs = args[2] if len(args) > 2 else schema.kwargs_schema.get("offs")
    if offs is not None and not isinstance(offs, torch.Tensor):
        p_offs = _codes(offs)
        if p_offs is None or any(c != "R" for c in p_offs):
            return None
    nd1, nd2 = len(_meta(mat1).shape), len(_meta(mat2).shape)
    if (nd1, nd2) in ((2, 3), (2, 2)) and offs is None:
        return None
    plan = _plan(nd1, nd2, p1, p2)
    if plan is None or all(c == "R" for c, _ in plan):
        return None
    codes = {c for c, _ in plan}
    bf16 = _meta(mat1).dtype == torch.bfloat16 and _meta(mat2).dtype == torch.bfloat16
    if bf16 and not codes & {EXPERTS, MAYBE_EXPERTS}:
        return None  # torch's strategy serves this layout in bf16
    return _run(plan)


def _spec(arg: Any) -> Any:
    strategies = getattr(arg, "strategies", None)
    return strategies[0].output_spec if strategies else arg


def _codes(arg: Any) -> tuple[str | None, ...] | None:
    """Per mesh dim codes (``R``, ``S<d>``, ``P``) of a schema argument; ``None`` when it is
    not a DTensor."""
    placements = getattr(_spec(arg), "placements", None)
    if placements is None:
        return None
    return tuple(_code(p) for p in placements)


def _meta(arg: Any) -> Any:
    return _spec(arg).tensor_meta


def _placement(code: str, nd2: int) -> Any:
    from torch.distributed.tensor import Partial, Replicate, Shard

    if code == EXPERTS:  # the rows of one's experts: a share; the weight-gradient blocks: a shard
        return Partial() if nd2 == 3 else Shard(0)
    if code == "P":
        return Partial()
    if code in ("R", MAYBE_EXPERTS):
        return Replicate()
    return Shard(int(code[1:]))


def _cut(
    local: torch.Tensor, shape: Sequence[int], mesh: Any, mesh_dim: int, dim: int
) -> torch.Tensor:
    """This rank's block along ``dim`` of a ``local`` tensor replicated on ``mesh_dim``."""
    from torch.distributed.tensor import Replicate, Shard

    placements = [Replicate()] * mesh.ndim
    placements[mesh_dim] = Shard(dim)
    offset, size = shard_extent(shape, mesh, placements, dim)
    return local.narrow(dim, offset, size)


def _run(plan: list[tuple[str, Slice]]) -> Any:
    def grouped_mm_on_shards(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        mat1, mat2 = args[0], args[1]
        offs = args[2] if len(args) > 2 else kwargs.get("offs")
        out_dtype = args[4] if len(args) > 4 else kwargs.get("out_dtype")
        extra = {} if out_dtype is None else {"out_dtype": out_dtype}
        mesh = mat1.device_mesh
        operands = [local_tensor(mat1), local_tensor(mat2)]
        offs_local = local_tensor(offs) if is_dtensor(offs) else offs
        nd1, nd2 = mat1.ndim, mat2.ndim
        for m, (_code_m, cut) in enumerate(plan):
            if cut is not None:
                which, dim = cut
                shape = (mat1 if which == 0 else mat2).shape
                operands[which] = _cut(operands[which], shape, mesh, m, dim)
        x, w = operands
        if (nd1, nd2) == (2, 3):
            shape = [mat1.shape[0], mat2.shape[2]]
        elif (nd1, nd2) == (2, 2):
            shape = [int(offs.shape[0]), mat1.shape[0], mat2.shape[1]]
        else:
            shape = [mat1.shape[0], mat1.shape[1], mat2.shape[2]]
        codes = [c for c, _ in plan]
        if MAYBE_EXPERTS in codes:
            m = codes.index(MAYBE_EXPERTS)
            partial = any(t.placements[m].is_partial() for t in (mat1, mat2))
            expert = offs_local in _EXPERT_OFFS
            codes[m] = EXPERTS if expert else ("P" if partial else "R")
        placements = [_placement(c, nd2) for c in codes]
        if EXPERTS not in codes:
            local = _kernel(op_call, x, w, offs_local, extra)
            return sharded_result(local, mesh, placements, shape)
        m = codes.index(EXPERTS)
        if nd2 == 3:  # forward and input gradient: this rank's experts' rows
            first, count = shard_extent(mat2.shape, mesh, mat2.placements, 0)
            rows = _rows(offs_local, first, count)  # one host read of two ints, once per call
            if mat1.placements[m].is_partial():
                x = _owned(x, 0, *rows, mesh, m)
            local = _expert_rows(op_call, x, w, offs_local, first, count, rows, extra)
            _EXPERT_OFFS[offs_local] = True
        else:  # weight gradient: this rank's experts' blocks
            first, count = shard_extent(shape, mesh, placements, 0)
            rows = _rows(offs_local, first, count)
            if mat1.placements[m].is_partial():
                x = _owned(x, 1, *rows, mesh, m)
            if mat2.placements[m].is_partial():
                w = _owned(w, 0, *rows, mesh, m)
            local = _expert_blocks(op_call, x, w, offs_local, first, count, rows, extra)
        return sharded_result(local, mesh, placements, shape)

    return grouped_mm_on_shards


def _rows(offs: torch.Tensor, first: int, count: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of experts ``[first, first + count)``: offs holds cumulative ends."""
    bounds = offs.new_zeros(2)
    if first > 0:
        bounds[0] = offs[first - 1]
    if count > 0:
        bounds[1] = offs[first + count - 1]
    start, end = (int(v) for v in bounds.tolist())
    return start, max(start, end)


def _owned(
    local: torch.Tensor, dim: int, start: int, end: int, mesh: Any, mesh_dim: int
) -> torch.Tensor:
    """A ``Partial`` operand's rows ``[start, end)`` (along ``dim``) made exact on this rank.

    In an expert layer every row of a ``Partial`` token tensor is nonzero only on the rank that
    owns the row's expert (it came from :func:`_expert_rows` and pointwise ops that keep 0 at
    0), so this rank's share of its own rows already is their full value. Checked, not
    assumed: each rank tests that its share is zero outside its rows, one 1-element all-reduce
    (MAX) over ``mesh_dim`` combines the answers, and if any rank's share is not, the operand is
    summed over ``mesh_dim`` (the all-reduce torch would do) before use.
    """
    size = local.shape[dim]
    outside = (
        local.narrow(dim, 0, start).ne(0).any() | local.narrow(dim, end, size - end).ne(0).any()
    )
    flag = outside.to(torch.int32).reshape(1)
    group = mesh.get_group(mesh_dim)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if int(flag.item()) == 0:
        return local
    total = local.clone()
    dist.all_reduce(total, group=group)
    return total


def _expert_rows(
    op_call: Any,
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    first: int,
    count: int,
    rows: tuple[int, int],
    extra: dict[str, Any],
) -> torch.Tensor:
    """``x`` ``[S, K]`` (all rows) by this rank's experts ``w`` ``[count, K, N]`` (their
    ``rows`` from :func:`_rows`): the rows of its experts computed, the others zero (this
    rank's share of a ``Partial`` sum)."""
    dtype = extra.get("out_dtype") or x.dtype
    out = x.new_zeros((x.shape[0], w.shape[-1]), dtype=dtype)
    start, end = rows
    if count and end > start:
        local_offs = (offs[first : first + count] - start).to(torch.int32)
        out[start:end] = _kernel(op_call, x[start:end], w, local_offs, extra)
    return out


def _expert_blocks(
    op_call: Any,
    xt: torch.Tensor,
    g: torch.Tensor,
    offs: torch.Tensor,
    first: int,
    count: int,
    rows: tuple[int, int],
    extra: dict[str, Any],
) -> torch.Tensor:
    """The blocks ``[count, K, N]`` of this rank's experts (their ``rows`` from :func:`_rows`)
    of ``xt`` ``[K, S]`` by ``g`` ``[S, N]`` grouped by ``offs`` (the weight gradient of
    expert-sharded weights)."""
    dtype = extra.get("out_dtype") or xt.dtype
    start, end = rows
    if not count:
        return xt.new_zeros((0, xt.shape[0], g.shape[1]), dtype=dtype)
    local_offs = (offs[first : first + count] - start).to(torch.int32)
    return _kernel(op_call, xt[:, start:end], g[start:end], local_offs, extra)


def _kernel(
    op_call: Any, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, extra: dict[str, Any]
) -> torch.Tensor:
    """``op_call(a, b, offs)`` on operands laid out as the grouped-matmul kernels require: data
    on a 16-byte boundary and every stride a multiple of 16 bytes ("strides should be multiple
    of 16 bytes"). A row slice of an expert's tokens can start off the boundary, and a TP shard
    can be narrower than 16 bytes (2 float32 columns of an expert on 4 ranks). Such operands
    are copied into fresh zero-padded buffers: ``a``'s last dim (the contraction, or the grouped
    token dim of ``[K, S] x [S, N]``) and ``b``'s matching dim -2 get zeros, which add nothing;
    ``b``'s last dim gets zeros, whose output columns are cut off. Operands already laid out so
    run as they are (no copy)."""
    step = max(1, 16 // a.element_size())

    def misaligned(t: torch.Tensor) -> bool:
        if t.data_ptr() % 16:
            return True
        return any(s % step for s, n in zip(t.stride(), t.shape, strict=True) if s != 1 and n > 1)

    if not (misaligned(a) or misaligned(b)):
        return op_call(a, b, offs, **extra)
    columns = b.shape[-1]
    inner_pad, columns_pad = -a.shape[-1] % step, -columns % step
    out = op_call(_padded(a, 0, inner_pad), _padded(b, inner_pad, columns_pad), offs, **extra)
    return out[..., :columns] if columns_pad else out


def _padded(t: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """A fresh contiguous copy of ``t`` with ``rows`` zero rows (dim -2) and ``columns`` zero
    columns (dim -1) added at the end; the allocator places it on a 16-byte boundary."""
    out = t.new_zeros((*t.shape[:-2], t.shape[-2] + rows, t.shape[-1] + columns))
    out[..., : t.shape[-2], : t.shape[-1]] = t
    return out


def _registrations() -> list[MissRule]:
    return [MissRule(OP, _rule)]


def _experts_case(mesh: Any, placement: str) -> str | None:
    """fp32 ``_grouped_mm`` of replicated tokens ``[12, 16]`` by experts ``[4, 16, 8]`` placed
    ``placement`` (``offs`` replicated), forward and both gradients, against the single device;
    and, for ``Shard(0)`` experts, no collective inside the call or its backward."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    grouped_mm = resolve_op(OP)
    x, w, g = randn(12, 16, seed=1), randn(4, 16, 8, seed=2), randn(12, 8, seed=3)
    offs = torch.tensor([3, 5, 5, 12], dtype=torch.int32)  # an expert without tokens too
    x.requires_grad_()
    w.requires_grad_()
    expected = grouped_mm(x, w, offs)
    expected_x, expected_w = torch.autograd.grad((expected * g).sum(), [x, w])
    sharding = {"S0": Shard(0), "S2": Shard(2)}[placement]
    dx = distribute_tensor(x.detach(), mesh, [Replicate()] * mesh.ndim).requires_grad_()
    dw = distribute_tensor(w.detach(), mesh, [sharding] * mesh.ndim).requires_grad_()
    doffs = distribute_tensor(offs, mesh, [Replicate()] * mesh.ndim)
    dg = distribute_tensor(g, mesh, [Replicate()] * mesh.ndim)
    try:
        with CommDebugMode() as comm:
            out = grouped_mm(dx, dw, doffs)
            grad_x, grad_w = torch.autograd.grad((out * dg).sum(), [dx, dw])
        moved = comm.get_total_counts()
        got = (out.full_tensor(), grad_x.full_tensor(), grad_w.full_tensor())
    except Exception as exc:  # noqa: BLE001 - the error is the verdict
        return f"experts {placement}: {first_line(exc)}"
    if placement == "S0" and moved:
        return (
            f"experts Shard(0): {moved} collective(s) inside the grouped matmul (weights gathered)"
        )
    outputs = (expected, expected_x, expected_w)
    for what, a, b in zip(("output", "grad x", "grad w"), got, outputs, strict=True):
        problem = compare(a, b.detach(), what=f"experts {placement}: {what}", atol=1e-4)
        if problem:
            return problem
    return None


def reproduce(mesh: Any) -> str | None:
    """Expert-sharded (``Shard(0)``) and column-wise (``Shard(2)``) float32 expert weights."""
    if mesh.ndim != 1:
        return None
    return _experts_case(mesh, "S0") or _experts_case(mesh, "S2")


PATCH = Patch(
    name="grouped_mm_shards",
    summary="torch._grouped_mm on expert-sharded (Shard(0)) and float32 TP-sharded MoE expert weights, computed on the shards",
    ops=(OP,),
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    reproduce=reproduce,
    overrides_existing=True,
    out_variants=False,
    upstream_fix="none up to 2.15.0 (measured: Shard(0) experts are gathered; the meta function accepts bfloat16 only)",
    communication="none: each rank computes its experts' rows (Partial output) or its TP shard; offs read on the host",
)

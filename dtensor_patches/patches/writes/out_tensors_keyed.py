"""``out=`` calls into outs of another placement reuse the first call's cached decision.

torch's propagation cache hashes an op's keyword arguments only where its ``RuntimeSchemaInfo``
names them in ``static_kwargkey``, and most ``out=`` overloads with a sharding strategy do not
name their out tensors (124 on 2.13.0, 187 on 2.15.0). Where the strategy follows the out's
placement (``mm.out``, ``bmm.out``: from 2.13), ``torch.mm(a, b, out=o2)`` with ``o2``
replicated, after ``torch.mm(a, b, out=o1)`` with ``o1`` sharded, gets the first call's
decision: torch relabels ``o2`` to the first call's placement (``o2.to_local()`` is now a shard where the user made a replica), and
where ``o2`` is a view of another DTensor (``out=base.view(...)``, ``out=base[0]``, and the
views composite ops such as ``linalg.multi_dot`` make of their ``out``) that base's local
tensors are left half written under its old placement: wrong values, no error. Measured on
2.13.0 and 2.15.0 (not reported upstream that we found; ``mm.out`` has no strategy before 2.13).
It is what the strategy validator saw as "context-only" cells: ``mm.out`` into views inside
``linalg.multi_dot`` after another layout's sample.

A strategy that ignores the out's placement altogether (``amax.out``: its decision follows the
input) relabels the out on a fresh call too, with the same effect on a view's base: fixed by
``out_keeps_placement`` (2.9 to 2.13), which needs the out keyed as here.

The same holds for the ``out=`` overloads torch propagates through their decomposition (no
strategy of their own, 2.11+): torch infers their ``RuntimeSchemaInfo`` on the first call and
leaves every tensor keyword out of it. ``torch.mv(a, v, out=base.view(6))`` with ``base`` a
``Shard(1)`` ``[2, 3]``, after a call into a replicated ``out``: ``base`` keeps zeros
(measured on 2.12.0 to 2.15.0, stock and with every other patch; 2.11.0 keys every keyword
argument and is right). It was the strategy validator's one cell still wrong after
``apply_all()`` on 2.13.0 (``mv.out`` into a ``_StridedShard`` view).

Fix (for the kind): every out tensor of every ``out=`` overload that has a sharding strategy
on the release is put into its cache key (:class:`~dtensor_patches.dispatch.cache_key.CacheKey`
with ``keywords``; where torch registered no ``RuntimeSchemaInfo``, a default one naming only
them). The ops are found in the release's own tables when the patch applies
(:func:`out_tensors_unkeyed`); ``tests/test_cache_keys.py`` fails if a release adds one that
:data:`OPS` does not list. The decomposition ops are keyed
the same way, all of the release's at once, each entry written as torch would infer it plus
its out tensors (:class:`~dtensor_patches.dispatch.cache_key.DecompositionOutKeys`). Cost: one
more cache entry per distinct out placement; nothing per cached call, no communication. The
decision itself stays torch's.
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch import tables as torch_tables
from dtensor_patches._torch.schemas import out_argument_names
from dtensor_patches.dispatch.cache_key import DecompositionOutKeys
from dtensor_patches.patch import CacheKey, Patch


def out_tensors_unkeyed() -> list[tuple[str, str, tuple[str, ...]]]:
    """``(schema-info table, op, out argument names)`` for every ``out=`` overload with a
    sharding strategy in this release's tables whose ``RuntimeSchemaInfo`` (or its absence)
    leaves an out tensor out of the propagation cache key."""
    directory = torch_tables.tables()
    present = set(torch_tables.table_names())
    infos = torch_tables.schema_infos()
    found = []
    for strategies, info_table in torch_tables.SCHEMA_INFO_TABLE_OF.items():
        if strategies not in present or info_table not in infos:
            continue
        for op in list(directory[strategies]):  # type: ignore[attr-defined]
            outs = out_argument_names(op)
            if not outs:
                continue
            info = infos[info_table].get(op)
            keyed = set(getattr(info, "static_kwargkey", None) or ())
            if not set(outs) <= keyed:
                found.append((info_table, str(op), outs))
    return found


def _registrations() -> list[CacheKey | DecompositionOutKeys]:
    keys: list[CacheKey | DecompositionOutKeys] = [
        CacheKey(op, None, table, keywords=outs)
        for table, op, outs in out_tensors_unkeyed()
        if op in OPS
    ]
    return [*keys, DecompositionOutKeys()]


def _product_into_views(mesh: Any) -> str | None:
    """``torch.mm(a, b, out=...)`` of two ``Shard(1)`` ``[4, 2 p]`` / ``[2 p, 2 p]`` tensors,
    first into a view of a ``Shard(1)`` out, then into a view of a ``Replicate()`` one: each
    base's placement and full value against the plain ``mm``. ``None`` where torch has no
    strategy for ``mm.out`` (before 2.13)."""
    import warnings

    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    width = 2 * mesh.size()
    left = torch.arange(4 * width, dtype=torch.float32).reshape(4, width) / 7
    right = torch.arange(width * width, dtype=torch.float32).reshape(width, width).flip(0) / 5
    expected = left @ right
    a = distribute_tensor(left, mesh, [Shard(1)])
    b = distribute_tensor(right, mesh, [Shard(1)])
    for placement in (Shard(1), Replicate()):
        base = distribute_tensor(torch.zeros_like(expected), mesh, [placement])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's "an output was resized" on the bug
            try:
                torch.mm(a, b, out=base.view(expected.shape))
            except NotImplementedError:
                return None  # no strategy for mm.out (before 2.13): no decision to reuse
        if tuple(base.placements) != (placement,) or not torch.allclose(
            base.full_tensor(), expected
        ):
            return (
                f"mm(out=) into a view of a {placement} DTensor after another placement's "
                "call: its base does not hold the product"
            )
    return None


def _decomposed_into_a_view(mesh: Any) -> str | None:
    """``torch.mv(a, v, out=...)`` (propagated through its decomposition from 2.11), first into
    a replicated ``[2 p + 2]`` out, then into ``base.view(-1)`` with ``base`` a ``Shard(1)``
    ``[2, p + 1]``: ``base``'s full value against the plain ``mv``."""
    import warnings

    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    rows = 2 * (mesh.size() + 1)
    matrix = torch.arange(rows * 5, dtype=torch.float32).reshape(rows, 5) / 9
    vector = torch.arange(5, dtype=torch.float32).flip(0) / 3
    expected = matrix @ vector
    a = distribute_tensor(matrix, mesh, [Shard(1)])
    v = distribute_tensor(vector, mesh, [Replicate()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "an output was resized" on the bug
        try:
            torch.mv(a, v, out=distribute_tensor(torch.zeros(rows), mesh, [Replicate()]))
        except NotImplementedError:
            return None  # no way to propagate mv (before 2.11): no decision to reuse
        base = distribute_tensor(torch.zeros(2, rows // 2), mesh, [Shard(1)])
        try:
            flat = base.view(-1)
        except RuntimeError:
            return None  # 2.11 refuses to flatten a sharded dim: no such view to write into
        torch.mv(a, v, out=flat)
    if not torch.allclose(base.full_tensor().reshape(-1), expected):
        return (
            "mv(out=) into a view of a Shard(1) DTensor after a call into a replicated out: "
            "its base does not hold the product"
        )
    return None


def reproduce(mesh: Any) -> str | None:
    """An op with a strategy (``mm.out``) and one propagated through its decomposition
    (``mv.out``), each written into an out of another placement than its first call's."""
    return _product_into_views(mesh) or _decomposed_into_a_view(mesh)


# Every op the rule finds on some release 2.9.1 to 2.15.0 (measured: 9 on 2.9.1, 11 on 2.11.0,
# 124 on 2.13.0, 187 on 2.15.0); keyed on 2.13 and later, where the case is measured.
OPS: tuple[str, ...] = (
    "aten._adaptive_avg_pool2d.out",
    "aten._adaptive_avg_pool2d_backward.out",
    "aten._adaptive_avg_pool3d.out",
    "aten._batch_norm_with_update.out",
    "aten._fft_c2c.out",
    "aten._fft_c2r.out",
    "aten._fft_r2c.out",
    "aten._index_put_impl.out",
    "aten._linalg_det.result",
    "aten._linalg_eigh.eigenvalues",
    "aten._linalg_slogdet.sign",
    "aten._linalg_solve_ex.result",
    "aten._linalg_svd.U",
    "aten._log_softmax.out",
    "aten._log_softmax_backward_data.out",
    "aten._native_batch_norm_legit.no_stats_out",
    "aten._native_batch_norm_legit.out",
    "aten._native_batch_norm_legit_no_training.out",
    "aten._scaled_mm.out",
    "aten._softmax.out",
    "aten._softmax_backward_data.out",
    "aten._upsample_bicubic2d_aa.out",
    "aten._upsample_bicubic2d_aa_backward.grad_input",
    "aten._upsample_bilinear2d_aa.out",
    "aten._upsample_bilinear2d_aa_backward.grad_input",
    "aten._upsample_lanczos2d_aa.out",
    "aten._upsample_lanczos2d_aa_backward.grad_input",
    "aten._upsample_nearest_exact1d.out",
    "aten._upsample_nearest_exact1d_backward.grad_input",
    "aten._upsample_nearest_exact2d.out",
    "aten._upsample_nearest_exact2d_backward.grad_input",
    "aten._upsample_nearest_exact3d.out",
    "aten._upsample_nearest_exact3d_backward.grad_input",
    "aten.adaptive_avg_pool1d.out",
    "aten.adaptive_max_pool2d.out",
    "aten.adaptive_max_pool3d.out",
    "aten.addmm.out",
    "aten.all.all_out",
    "aten.all.out",
    "aten.amax.out",
    "aten.amin.out",
    "aten.any.all_out",
    "aten.any.dims_out",
    "aten.any.out",
    "aten.argmax.out",
    "aten.argmin.out",
    "aten.avg_pool1d.out",
    "aten.avg_pool2d.out",
    "aten.avg_pool3d.out",
    "aten.baddbmm.out",
    "aten.bernoulli.float_out",
    "aten.bernoulli.out",
    "aten.bmm.out",
    "aten.bucketize.Tensor_out",
    "aten.cat.out",
    "aten.cholesky.out",
    "aten.cholesky_inverse.out",
    "aten.cholesky_solve.out",
    "aten.clone.out",
    "aten.constant_pad_nd.out",
    "aten.convolution.out",
    "aten.convolution_backward.out",
    "aten.cummax.out",
    "aten.cummin.out",
    "aten.cumprod.out",
    "aten.cumsum.out",
    "aten.diag.out",
    "aten.diag_embed.out",
    "aten.diagonal_copy.out",
    "aten.diagonal_scatter.out",
    "aten.dot.out",
    "aten.embedding.out",
    "aten.embedding_dense_backward.out",
    "aten.eye.m_out",
    "aten.fill.Scalar_out",
    "aten.flip.out",
    "aten.fractional_max_pool2d.output",
    "aten.fractional_max_pool3d.output",
    "aten.frexp.Tensor_out",
    "aten.gather.out",
    "aten.gelu_backward.grad_input",
    "aten.geometric.out",
    "aten.geqrf.a",
    "aten.grid_sampler_2d.out",
    "aten.grid_sampler_2d_backward.out",
    "aten.grid_sampler_3d.out",
    "aten.grid_sampler_3d_backward.out",
    "aten.histc.out",
    "aten.index.Tensor_out",
    "aten.index_fill.int_Scalar_out",
    "aten.index_fill.int_Tensor_out",
    "aten.index_put.out",
    "aten.index_reduce.out",
    "aten.index_select.out",
    "aten.kthvalue.values",
    "aten.linalg_cholesky_ex.L",
    "aten.linalg_cross.out",
    "aten.linalg_eig.out",
    "aten.linalg_householder_product.out",
    "aten.linalg_inv_ex.inverse",
    "aten.linalg_ldl_factor_ex.out",
    "aten.linalg_ldl_solve.out",
    "aten.linalg_lu.out",
    "aten.linalg_lu_factor_ex.out",
    "aten.linalg_lu_solve.out",
    "aten.linalg_matrix_exp.out",
    "aten.linalg_pinv.atol_rtol_tensor_out",
    "aten.linalg_qr.out",
    "aten.linalg_solve_triangular.out",
    "aten.linalg_vector_norm.out",
    "aten.log_normal.out",
    "aten.logcumsumexp.out",
    "aten.logit_backward.grad_input",
    "aten.logsumexp.out",
    "aten.lu_unpack.out",
    "aten.max.dim_max",
    "aten.max.out",
    "aten.max.unary_out",
    "aten.max_pool2d_with_indices.out",
    "aten.max_pool2d_with_indices_backward.grad_input",
    "aten.max_pool3d_with_indices.out",
    "aten.max_unpool2d.out",
    "aten.max_unpool3d.out",
    "aten.mean.dtype_out",
    "aten.mean.out",
    "aten.median.dim_values",
    "aten.median.out",
    "aten.min.dim_min",
    "aten.min.out",
    "aten.min.unary_out",
    "aten.mm.out",
    "aten.mode.values",
    "aten.multinomial.out",
    "aten.nanmedian.dim_values",
    "aten.nanmedian.out",
    "aten.nansum.out",
    "aten.native_batch_norm.out",
    "aten.native_batch_norm_backward.out",
    "aten.native_dropout.out",
    "aten.native_group_norm.out",
    "aten.native_layer_norm.out",
    "aten.native_layer_norm_backward.out",
    "aten.nll_loss2d_backward.grad_input",
    "aten.nll_loss2d_forward.output",
    "aten.nll_loss_backward.grad_input",
    "aten.nll_loss_forward.output",
    "aten.norm.Scalar_out",
    "aten.normal.out",
    "aten.ormqr.out",
    "aten.prod.int_out",
    "aten.prod.out",
    "aten.randint_like.low_dtype_out",
    "aten.roll.out",
    "aten.scatter.src_out",
    "aten.scatter.value_out",
    "aten.scatter_add.out",
    "aten.select_backward.out",
    "aten.select_scatter.out",
    "aten.sigmoid_backward.grad_input",
    "aten.silu_backward.grad_input",
    "aten.slice_backward.out",
    "aten.slice_scatter.out",
    "aten.sort.values",
    "aten.sort.values_stable",
    "aten.std.correction_out",
    "aten.sum.IntList_out",
    "aten.sum.out",
    "aten.tanh_backward.grad_input",
    "aten.threshold_backward.grad_input",
    "aten.topk.values",
    "aten.triangular_solve.X",
    "aten.tril.out",
    "aten.triu.out",
    "aten.uniform.out",
    "aten.upsample_bicubic2d.out",
    "aten.upsample_bicubic2d_backward.grad_input",
    "aten.upsample_bilinear2d.out",
    "aten.upsample_bilinear2d_backward.grad_input",
    "aten.upsample_linear1d.out",
    "aten.upsample_linear1d_backward.grad_input",
    "aten.upsample_nearest1d.out",
    "aten.upsample_nearest1d_backward.grad_input",
    "aten.upsample_nearest2d.out",
    "aten.upsample_nearest2d_backward.grad_input",
    "aten.upsample_nearest3d.out",
    "aten.upsample_nearest3d_backward.grad_input",
    "aten.upsample_trilinear3d.out",
    "aten.upsample_trilinear3d_backward.grad_input",
    "aten.var.correction_out",
    "aten.var_mean.correction_out",
    "aten.zero.out",
)

PATCH = Patch(
    name="out_tensors_keyed",
    summary="an out= tensor's placement keys the cached sharding decision of its op",
    ops=OPS,
    gate=SpecifierSet(">=2.12"),
    registrations=_registrations,
    reproduce=reproduce,
    overrides_existing=True,
    out_variants=False,
    # A call may be the case (only after a call into an out of another placement).
    concerns=lambda call: None,
    communication="none",
)

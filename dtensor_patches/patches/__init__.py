"""The built-in patches, grouped by op family, in the one order ``apply_all()`` applies them.

Each module holds one patch: its registrations, gate, reproducer and upstream references
together. The families:

- ``pointwise``: elementwise ops and activations, pending reductions through them;
- ``reductions``: reductions, scans and order statistics along dims, ``.item()`` of a
  ``Partial``;
- ``views``: views and shape ops (slices, selects, squeezes, stacks, flips, ``as_strided``);
- ``indexing``: advanced indexing, indexed writes, data-dependent output shapes;
- ``writes``: in-place writes (``Partial`` targets, writes through redistributed views);
- ``losses``: losses reduced over shards, ``loss_parallel()``;
- ``vocab``: ops along a sharded class (vocabulary) dim: softmax, gather of ids, top-k;
- ``nn``: attention, convolutions, matrix-vector products;
- ``parallel_styles``: tensor-parallel plans;
- ``validated``: the cells torch's own strategies get wrong, measured by ``tools/validate``
  and routed by data, one patch per op family (``wrong_cells_<family>``);
- ``edges``: where DTensors meet plain tensors (full state dicts loaded into DTensor
  parameters) and local tensors become DTensors (``from_local`` of uneven shards);
- ``propagation``: how torch decides placements for any op (every rank the same decision).

The order matters where two patches own entries of one op: the later one is on top.
"""

from __future__ import annotations

from collections.abc import Iterable

from dtensor_patches.patch import Patch
from dtensor_patches.patches.edges import (
    empty_shard_padding,
    from_local_uneven,
    full_state_dict,
    mesh_in_lists,
    uneven_gather_layout,
)
from dtensor_patches.patches.indexing import (
    data_dependent,
    getitem,
    index_functional,
    index_put,
    index_writes,
    isin_searchsorted,
    masked_scatter,
)
from dtensor_patches.patches.losses import (
    elementwise_losses,
    loss_parallel_backward,
    loss_parallel_keeps_patches,
    nll_loss,
)
from dtensor_patches.patches.nn import (
    context_parallel_cpu,
    conv_layouts,
    grouped_mm_shards,
    layer_norm_backward_layouts,
    mv,
    sdpa_cpu,
)
from dtensor_patches.patches.parallel_styles import tp_tied_weights
from dtensor_patches.patches.pointwise import (
    activations,
    elementwise_strategies,
    float_keywords_unkeyed,
    ne_glu_entr,
    partial_add_scalar,
    partial_divisor,
    partial_int_cast,
)
from dtensor_patches.patches.propagation import ranks_decide_alike
from dtensor_patches.patches.reductions import (
    all_any_dims,
    all_over_shards,
    argmax_all,
    count_nonzero,
    cumsum_negative_dim,
    dim_reductions,
    empty_dims_reduce_all,
    empty_shard_extrema,
    extremum_partial_norms,
    is_all_true,
    is_any_true,
    max_min_indices,
    mean_uneven,
    nansum,
    norm_partial_reduced_first,
    order_stats,
    partial_item,
    partial_norms,
    scans,
    size_arguments_keyed,
    var_mean,
)
from dtensor_patches.patches.validated import wrong_cells
from dtensor_patches.patches.views import (
    alias,
    as_strided,
    flip_roll,
    inplace_view_shape,
    select_spec,
    squeeze,
    stack_dim,
    t_of_vector,
    unbind,
    unfold,
)
from dtensor_patches.patches.vocab import (
    embedding_over_nested_shards,
    gather_over_shards,
    mask_partial_reduced_first,
    nll_loss_over_classes,
    softmax_over_shards,
    topk_over_shards,
)
from dtensor_patches.patches.writes import (
    cumsum_inplace,
    inplace_writes,
    matrix_rank_out,
    out_keeps_placement,
    out_tensors_keyed,
    view_writes,
)

__all__ = ["BUILTIN_PATCHES"]


def _in_order(patches: Iterable[Patch]) -> tuple[Patch, ...]:
    """``patches`` as the registry's order, refusing a repeated name and a ``requires`` that
    names an unknown patch or one that comes later.

    Raises:
        ValueError: naming the patch and the problem.
    """
    seen: set[str] = set()
    out = []
    for patch in patches:
        if patch.name in seen:
            raise ValueError(f"patch {patch.name!r} is registered twice")
        for needed in patch.requires:
            if needed not in seen:
                raise ValueError(
                    f"patch {patch.name!r} requires {needed!r}, which is not registered before it"
                )
        seen.add(patch.name)
        out.append(patch)
    return tuple(out)


BUILTIN_PATCHES: tuple[Patch, ...] = _in_order(
    (
        alias.PATCH,
        select_spec.PATCH,
        dim_reductions.PATCH,
        unbind.PATCH,
        count_nonzero.PATCH,
        var_mean.PATCH,
        scans.PATCH,
        cumsum_inplace.PATCH,
        cumsum_negative_dim.PATCH,
        order_stats.PATCH,
        size_arguments_keyed.PATCH,
        out_tensors_keyed.PATCH,
        float_keywords_unkeyed.PATCH,
        flip_roll.PATCH,
        sdpa_cpu.PATCH,
        context_parallel_cpu.PATCH,
        grouped_mm_shards.PATCH,
        unfold.PATCH,
        elementwise_strategies.PATCH,
        isin_searchsorted.PATCH,
        inplace_writes.PATCH,
        view_writes.PATCH,
        matrix_rank_out.PATCH,
        out_keeps_placement.PATCH,
        index_put.PATCH,
        index_writes.PATCH,
        index_functional.PATCH,
        getitem.PATCH,
        masked_scatter.PATCH,
        data_dependent.PATCH,
        mean_uneven.PATCH,
        max_min_indices.PATCH,
        squeeze.PATCH,
        stack_dim.PATCH,
        argmax_all.PATCH,
        nansum.PATCH,
        is_any_true.PATCH,
        is_all_true.PATCH,
        all_over_shards.PATCH,
        all_any_dims.PATCH,
        partial_add_scalar.PATCH,
        partial_int_cast.PATCH,
        ne_glu_entr.PATCH,
        activations.PATCH,
        mv.PATCH,
        elementwise_losses.PATCH,
        nll_loss.PATCH,
        softmax_over_shards.PATCH,
        gather_over_shards.PATCH,
        nll_loss_over_classes.PATCH,
        topk_over_shards.PATCH,
        mask_partial_reduced_first.PATCH,
        embedding_over_nested_shards.PATCH,
        partial_item.PATCH,
        partial_norms.PATCH,
        empty_shard_extrema.PATCH,
        partial_divisor.PATCH,
        empty_dims_reduce_all.PATCH,
        extremum_partial_norms.PATCH,
        norm_partial_reduced_first.PATCH,
        loss_parallel_backward.PATCH,
        loss_parallel_keeps_patches.PATCH,
        tp_tied_weights.PATCH,
        as_strided.PATCH,
        conv_layouts.PATCH,
        layer_norm_backward_layouts.PATCH,
        inplace_view_shape.PATCH,
        t_of_vector.PATCH,
        full_state_dict.PATCH,
        from_local_uneven.PATCH,
        uneven_gather_layout.PATCH,
        empty_shard_padding.PATCH,
        mesh_in_lists.PATCH,
        ranks_decide_alike.PATCH,
        # Last: the validator's routed cells are those the patches above leave wrong, and an
        # op's own rule (a hand-written fix) is consulted before any any-op rule.
        *wrong_cells.PATCHES,
    )
)

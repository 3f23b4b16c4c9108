"""The strategy validator: which cells torch's registered sharding strategies and handlers get
wrong, on this release (issue 19).

``python -m tools.validate --out cells-2.13.jsonl`` runs each OpInfo of torch's ``op_db`` (its
first CPU samples, float32 where supported) with every tensor argument a DTensor on a 1-D CPU
gloo mesh, under each placement pattern of :data:`~tools.validate.layouts.PATTERNS` (``Shard``
of every dim, the first tensor sharded and the rest replicated and the reverse, ``Replicate()``,
``Partial`` of ``sum``/``avg``/``max``/``min``; uneven and empty shards arise from op_db's
sizes); with ``--mesh 2x2`` on a 2-D mesh of 4 ranks under
:data:`~tools.validate.layouts.PATTERNS_2D` (one pattern per mesh dim: ``S0/S1``, ``S0/S0``,
``S0/P.sum``...). Each runs as a function, in place and with a DTensor ``out=`` (factory ops
included), forward and, where the op has a gradient, backward. Every DTensor call is checked by
``dtensor_patches.verify`` against the same op on the full plain tensors: values, shape,
dtype, and every DTensor's local shape against its spec. What it finds wrong is a *cell*
(``dtensor_patches.cells``): the aten op and its inputs' layouts, with the call recorded for a
replay. An output or gradient that is wrong at the end while no single call was is listed as
unattributed.

A refusal (the op raises) is not a cell: the fallback takes those. The output is one JSON
line per OpInfo, appended as it finishes: a run that stops resumes where it left off. Each
OpInfo runs on a pool of long-lived ranks (``dtensor_patches.testing.RankPool``) and a hang or
dead rank is recorded and the ranks restarted. ``python -m tools.validate.table`` turns the
lines of each release into ``dtensor_patches/data/wrong_cells.json`` and ``docs/cells.md``
(``--mesh 2x2``: the 2-D runs' entry, beside the 1-D one).
"""

"""Sweep torch's op database through DTensor and find the ops that fail on this release.

``python -m tools.sweep`` enumerates
``torch.testing._internal.common_methods_invocations.op_db`` (shipped in the torch wheel; it
needs the ``expecttest`` package), and for every OpInfo runs a few of its CPU sample inputs with
every tensor argument turned into a DTensor on a 1-D CPU gloo mesh over all ranks, once per
placement (``Shard(0)``, ``Shard(-1)``, ``Replicate()``, and ``Partial()`` with ``--partial``).
The ``full_tensor()`` of each output is compared with the plain single-device result of the same
sample. Each (op, variant, placement) is classified as:

- ``ok``: every sample ran and matched;
- ``no-strategy``: ``NotImplementedError ... does not have a sharding strategy registered``;
- ``raises``: any other exception (type and first line of the message are recorded);
- ``wrong``: an output's shape, dtype or values differ from the single-device result;
- ``timeout``: the ranks did not finish the op within ``--op-timeout`` (a hang, usually ranks
  that took different collective paths); the ranks are restarted and the sweep goes on;
- ``crash``: a rank process died (gloo aborts the process on a collective size mismatch) or the
  sweep failed outside a sample; the ranks are restarted and the sweep goes on;
- ``skipped``: no sample fits the placement (every sample has a 0-d tensor, or a tensor whose
  sharded dim is smaller than the world size), the single-device reference itself fails, or
  ``distribute_tensor`` cannot make the inputs DTensors (2.9: zero-size tensors).

Sample eligibility: a sample is used for a placement only if it has no dropout (a non-zero
``dropout_p`` keyword), every tensor argument is at least 1-d and, for ``Shard(d)``, has size
``>= world_size`` on dim ``d``; the first ``--max-samples`` eligible samples are used. Integer
and bool tensors stay ``Replicate()`` under ``Partial()``. Samples are drawn with the same seed
on every rank, so every rank sees the same data.

After each sample the ranks exchange their outcomes (``all_gather_object``) and record the
worst; if they disagree the row says so (``rank_mismatch``). Random ops, ops with
nondeterministic or uninitialised outputs, and sparse/CUDA-only ops are skipped (see
:data:`SKIP`). The sweep touches no private DTensor API: it uses only the public
``torch.distributed.tensor`` names (``op_db`` itself lives in ``torch.testing._internal``).

Known artifacts of the method (read failures with them in mind): every tensor argument gets the
placement, including tensors that are really sizes or indices (``tensor_split``'s indices,
``repeat_interleave``'s repeats), which then fail for that reason; ``full_tensor()`` of int16
outputs fails on gloo (``Invalid scalar type``), so ``short`` fails when sharded; ops whose
samples are skipped by the rules above are not tested for that placement at all.

Typical use::

    python -m tools.sweep --markdown docs/sweep.md --json docs/sweep.json
    python -m tools.sweep --ops argmax,logsumexp --apply-patches
"""

from tools.sweep.catalog import (
    CATEGORIES,
    CATEGORY_ORDER,
    DEFAULT_CATEGORY,
    PLACEMENTS,
    SEVERITY,
    SKIP,
    categorize,
    skip_reason,
)
from tools.sweep.report import _print_summary, render_markdown, write_json
from tools.sweep.runner import Options, Row, _compare, list_ops, run_sweep, sweep_ops

__all__ = [
    "CATEGORIES",
    "CATEGORY_ORDER",
    "DEFAULT_CATEGORY",
    "PLACEMENTS",
    "SEVERITY",
    "SKIP",
    "Options",
    "Row",
    "_compare",
    "_print_summary",
    "categorize",
    "list_ops",
    "render_markdown",
    "run_sweep",
    "skip_reason",
    "sweep_ops",
    "write_json",
]

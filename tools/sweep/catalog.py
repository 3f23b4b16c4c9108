"""What the op sweep runs and how it groups ops: severities, skipped ops and why, categories."""

from __future__ import annotations

import fnmatch
import re

#: Outcomes, least to most severe; the worst over samples and ranks is recorded.
SEVERITY = {
    "skipped": 0,
    "ok": 1,
    "no-strategy": 2,
    "raises": 3,
    "wrong": 4,
    "timeout": 5,
    "crash": 6,
}

#: Ops never run, and why: ``fnmatch`` patterns on the OpInfo name or its ``name.variant`` key.
SKIP: dict[str, str] = {
    # random: no single-device reference to compare with
    "bernoulli": "random",
    "multinomial": "random",
    "normal*": "random",
    "uniform": "random",
    "cauchy": "random",
    "exponential": "random",
    "geometric": "random",
    "log_normal": "random",
    "rand*": "random",
    "randint*": "random",
    "randn*": "random",
    "nn.functional.dropout*": "random",
    "nn.functional.alpha_dropout": "random",
    "nn.functional.feature_alpha_dropout*": "random",
    "nn.functional.rrelu": "random",
    "nn.functional.gumbel_softmax": "random",
    "nn.functional.fractional_max_pool*": "random",
    "svd_lowrank": "random",
    "pca_lowrank": "random",
    # uninitialised memory
    "empty*": "uninitialised output",
    "new_empty*": "uninitialised output",
    "nn.functional.multi_head_attention_forward": "dropout inside; huge samples",
    # not dense CPU tensors
    "to_sparse": "sparse output",
    "sparse.*": "sparse",
    "jiterator_*": "CUDA only",
    "torch._scaled_mm": "CUDA only",
    "_segment_reduce*": "sparse-style lengths",
    # no tensor to distribute / not a tensor op
    "item": "returns a Python scalar; 0-d input",
    "arange": "factory: no tensor input",
    "linspace*": "factory: no tensor input",
    "logspace*": "factory: no tensor input",
    "full": "factory: no tensor input",
    "ones": "factory: no tensor input",
    "zeros": "factory: no tensor input",
    "eye": "factory: no tensor input",
    "scalar_tensor": "factory: no tensor input",
    "signal.windows.*": "factory: no tensor input",
    "tril_indices": "factory: no tensor input",
    "triu_indices": "factory: no tensor input",
    "nn.functional.pad.circular": "slow",
}

#: OpInfo name ``fnmatch`` pattern -> category, for the markdown report (first match wins).
CATEGORIES: dict[str, str] = {}


def _cat(category: str, *names: str) -> None:
    for name in names:
        CATEGORIES[name] = category


_cat(
    "reductions",
    "sum",
    "nansum",
    "mean",
    "nanmean",
    "prod",
    "amax",
    "amin",
    "max",
    "min",
    "aminmax",
    "argmax",
    "argmin",
    "std",
    "std_mean",
    "var",
    "var_mean",
    "logsumexp",
    "norm",
    "linalg.norm",
    "linalg.vector_norm",
    "linalg.matrix_norm",
    "all",
    "any",
    "count_nonzero",
    "dist",
    "renorm",
    "special.logsumexp",
    "_softmax_backward_data",
    "nn.functional.normalize",
)
_cat(
    "scans",
    "cumsum",
    "cumprod",
    "cummax",
    "cummin",
    "logcumsumexp",
    "cumulative_trapezoid",
    "diff",
    "trapezoid",
    "trapz",
)
_cat(
    "sorting/searching",
    "sort",
    "argsort",
    "msort",
    "topk",
    "kthvalue",
    "median",
    "nanmedian",
    "quantile",
    "nanquantile",
    "mode",
    "searchsorted",
    "bucketize",
    "isin",
    "histc",
    "histogram*",
    "unique*",
    "bincount",
)
_cat(
    "indexing and in-place writes",
    "index_*",
    "scatter*",
    "gather",
    "take*",
    "put",
    "__getitem__",
    "__setitem__",
    "fill",
    "fill_",
    "zero_",
    "copy_",
    "select_scatter",
    "slice_scatter",
    "diagonal_scatter",
    "as_strided_scatter",
    "index_put",
    "_unsafe_index*",
    "embedding*",
    "nn.functional.embedding*",
    "narrow_copy",
    "resize_",
    "resize_as_",
    "tril",
    "triu",
)
_cat(
    "masking",
    "masked_fill",
    "masked_scatter",
    "masked_select",
    "masked.*",
    "where",
    "nonzero*",
    "argwhere",
    "isnan",
    "isinf",
    "nan_to_num",
)
_cat(
    "losses",
    "nn.functional.*loss*",
    "nn.functional.cross_entropy",
    "nn.functional.nll_loss",
    "nn.functional.binary_cross_entropy*",
    "nn.functional.kl_div",
    "nn.functional.ctc_loss",
)
_cat("attention", "nn.functional.scaled_dot_product_attention", "*attention*")
_cat(
    "shape ops",
    "flip*",
    "fliplr",
    "flipud",
    "roll",
    "rot90",
    "unfold*",
    "unbind*",
    "split*",
    "chunk",
    "tensor_split",
    "hsplit",
    "vsplit",
    "dsplit",
    "stack",
    "hstack",
    "vstack",
    "dstack",
    "column_stack",
    "row_stack",
    "cat",
    "concat",
    "concatenate",
    "reshape*",
    "view*",
    "flatten",
    "unflatten",
    "squeeze*",
    "unsqueeze",
    "permute",
    "transpose",
    "swapaxes",
    "swapdims",
    "movedim",
    "moveaxis",
    "t",
    "mT",
    "mH",
    "T",
    "H",
    "expand*",
    "broadcast_*",
    "repeat*",
    "tile",
    "narrow",
    "select",
    "slice",
    "diagonal",
    "diag*",
    "as_strided*",
    "alias_copy",
    "atleast_*",
    "ravel",
    "contiguous",
    "clone",
    "pad",
    "nn.functional.pad*",
    "kron",
    "meshgrid*",
    "tril_indices",
    "triu_indices",
    "block_diag",
    "cartesian_prod",
    "combinations",
    "nn.functional.pixel_*",
    "nn.functional.channel_shuffle",
    "native_channel_shuffle",
)
_cat("data-dependent output shape", "nonzero*", "masked_select", "unique*", "bincount", "argwhere")

DEFAULT_CATEGORY = "other"
CATEGORY_ORDER = (
    "reductions",
    "scans",
    "sorting/searching",
    "indexing and in-place writes",
    "masking",
    "losses",
    "attention",
    "shape ops",
    "data-dependent output shape",
    DEFAULT_CATEGORY,
)

PLACEMENTS = ("Shard(0)", "Shard(-1)", "Replicate()")
_ATEN_RE = re.compile(r"aten\.[A-Za-z0-9_]+\.[A-Za-z0-9_]+")
_NO_STRATEGY = "does not have a sharding strategy registered"
RTOL = 1e-4
ATOL = 1e-5


def _match(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern)


def skip_reason(name: str, variant: str = "") -> str | None:
    """Why the op ``name`` (OpInfo ``variant_test_name`` ``variant``) is not swept, or None."""
    full = f"{name}.{variant}" if variant else name
    for pattern, reason in SKIP.items():
        if _match(full, pattern) or _match(name, pattern):
            return reason
    return None


def categorize(name: str) -> str:
    """The report category of an op name; data-dependent-shape ops win over their family."""
    if any(_match(name, p) for p, c in CATEGORIES.items() if c == "data-dependent output shape"):
        return "data-dependent output shape"
    for pattern, category in CATEGORIES.items():
        if _match(name, pattern):
            return category
    return DEFAULT_CATEGORY

"""A real HF Qwen2ForCausalLM under TP=2 with sequence parallelism, called with ``logits_to_keep``.

Two CPU ranks (gloo), a tiny random Qwen2 built from its config in-process (no downloads). Every
rank builds the same weights from one seed, keeps a plain single-device copy as the reference,
and parallelises the other copy with an explicit TP + SP plan (torchtitan style: SP regions stay
DTensors, see docs/design.md §3). On torch 2.9 the forward fails without ``apply_all()``:
``hidden_states[:, slice_indices, :]`` on the sequence-sharded hidden states becomes
``aten.alias.default`` when the slice spans the whole sequence (``logits_to_keep=0``, every
position: the training and value paths), which has no sharding strategy there
(pytorch/pytorch#170427). ``logits_to_keep=1`` slices part of the sharded dim and runs on
stock 2.9 too.

Sequence parallelism shards the sequence dim evenly or not at all: an odd length on TP=2 aborts
the forward in a gloo collective. :func:`pad_for_sequence_parallel` right-pads the batch to a
multiple of the TP degree; under causal attention the real positions' logits do not depend on
the padding, which is trimmed off again (``--seq-len 7`` exercises it).

Usage::

    python examples/qwen2_tp_sp_logits.py               # apply_all(), compare with single device
    python examples/qwen2_tp_sp_logits.py --no-patches  # stock torch
    python examples/qwen2_tp_sp_logits.py --only alias  # only these patches
    dtensor-patches scan examples/qwen2_tp_sp_logits.py:scan_step --apply-all

Prints one JSON line with the outcome per ``logits_to_keep``; exit code 0 when every run's
logits match the single-device model within ``--atol``, 1 when one differs or raised.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from typing import Any

import torch

from dtensor_patches.testing import RankPool

SEQ_LEN = 8
BATCH = 2
PAD_TOKEN_ID = 0


def tiny_qwen2_config() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )


def tp_sp_plan() -> dict[str, Any]:
    """Qwen2/Llama TP + SP plan: column/row-wise linears, norms and embeddings sequence-sharded."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        ),
        "model.norm": SequenceParallel(use_local_output=False),
        "lm_head": ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=True
        ),
    }
    layer = {
        "input_layernorm": SequenceParallel(use_local_output=False),
        # Gather the sequence once per block, before the column-parallel projections.
        "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=False,
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "post_attention_layernorm": SequenceParallel(use_local_output=False),
        "mlp": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=False
        ),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    for suffix, style in layer.items():
        plan[f"model.layers.*.{suffix}"] = style
    return plan


def pad_for_sequence_parallel(
    input_ids: torch.Tensor, multiple: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Right-pad ``[B, S]`` int64 ids to a length divisible by ``multiple`` (the TP degree).

    Returns ``(ids [B, S'], attention_mask [B, S'] int64 with 0 on padding, pad)`` where
    ``pad = S' - S``. Causal attention keeps the first ``S`` positions' outputs independent of
    the padding, so trimming ``pad`` positions off the end restores the unpadded result.
    """
    pad = (-input_ids.shape[1]) % multiple
    mask = torch.ones_like(input_ids)
    if pad:
        input_ids = torch.nn.functional.pad(input_ids, (0, pad), value=PAD_TOKEN_ID)
        mask = torch.nn.functional.pad(mask, (0, pad), value=0)
    return input_ids, mask, pad


def _forward(model: Any, input_ids: torch.Tensor, logits_to_keep: int, tp: int = 1) -> torch.Tensor:
    """Logits ``[B, K, vocab]`` for the last ``logits_to_keep`` real positions (0: all of them).

    With ``tp > 1`` the batch is padded for SP and the padding trimmed from the logits; the
    kept window is widened by the padding so that it still ends at the last real position.
    """
    ids, mask, pad = pad_for_sequence_parallel(input_ids, tp)
    keep = logits_to_keep + pad if logits_to_keep else 0
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits
    return logits[:, : logits.shape[1] - pad] if pad else logits


def run_rank(
    use_patches: bool,
    keeps: list[int],
    seq_len: int = SEQ_LEN,
    only: list[str] | None = None,
) -> dict[str, Any]:
    """On every rank: build, parallelise, run each ``logits_to_keep``; return diffs or errors.

    ``only``: with ``use_patches``, apply only these patches (``apply_all(only=...)``), with
    the call fallback off.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers import Qwen2ForCausalLM

    import dtensor_patches

    # ``only``: exactly these patches, with the fallback off (it would hide a missing one).
    fallback = "off" if only is not None else None
    report = dtensor_patches.apply_all(only=only, fallback=fallback) if use_patches else None
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_qwen2_config()).eval()
    reference = copy.deepcopy(model)
    # Token 0 is the pad token: real tokens are drawn from 1..127.
    input_ids = torch.randint(1, 128, (BATCH, seq_len), generator=torch.Generator().manual_seed(1))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, tp_sp_plan())
    runs: dict[str, Any] = {}
    for keep in keeps:
        expected = _forward(reference, input_ids, keep)
        try:
            got = _forward(model, input_ids, keep, tp=dist.get_world_size())
        except Exception as exc:  # noqa: BLE001 - the example reports the failure as its result
            message = str(exc).splitlines()[0] if str(exc) else ""
            runs[str(keep)] = {"error": f"{type(exc).__name__}: {message}"}
            continue
        if got.shape != expected.shape:
            runs[str(keep)] = {"error": f"logits {tuple(got.shape)} != {tuple(expected.shape)}"}
            continue
        runs[str(keep)] = {"max_abs_diff": float((got - expected).abs().max())}
    return {
        "torch": torch.__version__,
        "patches": report.to_dict()["patches"] if report is not None else None,
        "logits_to_keep": runs,
    }


def scan_step() -> None:
    """The step ``dtensor-patches scan examples/qwen2_tp_sp_logits.py:scan_step`` records: both
    ``logits_to_keep`` paths (0 and 1) with the patches the caller applied (none of its own;
    ``--apply-all`` gets it past a release's gaps). Run on every rank."""
    run_rank(False, [0, 1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-patches", action="store_true", help="run on stock torch")
    parser.add_argument(
        "--logits-to-keep",
        type=int,
        nargs="+",
        default=[0, 1],
        help="values to run (0 keeps every position: the whole-dim slice that needs the patch)",
    )
    parser.add_argument(
        "--only",
        nargs="*",
        metavar="PATCH",
        help="apply only these patches, fallback off (none: stock)",
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--seq-len",
        type=int,
        default=SEQ_LEN,
        help="tokens per sequence; lengths not divisible by --world-size are padded and trimmed",
    )
    parser.add_argument("--atol", type=float, default=1e-5)
    args = parser.parse_args(argv)
    with RankPool(args.world_size) as pool:
        results = pool.run(
            run_rank, not args.no_patches, args.logits_to_keep, args.seq_len, args.only
        )
    summary: dict[str, Any] = {
        "torch": results[0]["torch"],
        "seq_len": args.seq_len,
        "patches": results[0]["patches"],
        "logits_to_keep": {},
    }
    ok = True
    for keep in map(str, args.logits_to_keep):
        per_rank = [r["logits_to_keep"][keep] for r in results]
        errors = sorted({r["error"] for r in per_rank if "error" in r})
        if errors:
            summary["logits_to_keep"][keep] = {"ok": False, "error": errors[0]}
            ok = False
            continue
        diff = max(r["max_abs_diff"] for r in per_rank)
        summary["logits_to_keep"][keep] = {"ok": diff <= args.atol, "max_abs_diff": diff}
        ok = ok and diff <= args.atol
    summary["ok"] = ok
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

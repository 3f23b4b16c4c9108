"""Patches survive ``loss_parallel()`` (and ``health()`` tells the truth when they cannot),
and tensor parallelism keeps tied embeddings tied: whole-model gradients vs single device."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dtensor_patches.testing import RankPool


def _survival(keep: bool) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import loss_parallel

    from dtensor_patches import health, registry, state
    from dtensor_patches._torch.schemas import resolve_op
    from dtensor_patches._torch.tables import custom_op_handlers

    exclude = () if keep else ("loss_parallel_keeps_patches",)
    with registry.patched(exclude=exclude):
        nll = registry.get("nll_loss")
        op = resolve_op("aten.nll_loss_forward.default")
        ours = state.LEDGER.owned(nll).get(("dispatcher._custom_op_handlers", op))
        with loss_parallel():
            pass
        after = health()
        held = custom_op_handlers().get(op)
        return {
            "nll_applied": nll.is_applied,
            "handler_back": ours is not None and held is ours,
            "intact": after.intact,
            "lost": after.lost,
        }


def test_patches_survive_loss_parallel(pool2: RankPool) -> None:
    r = pool2.run(_survival, True)[0]
    if not r["nll_applied"]:
        pytest.skip("no patch owns a loss_parallel() op on this torch (nll_loss gated out)")
    assert r["handler_back"] and r["intact"], r


def test_status_reports_the_loss_without_the_survival_patch(pool2: RankPool) -> None:
    r = pool2.run(_survival, False)[0]
    if not r["nll_applied"]:
        pytest.skip("no patch owns a loss_parallel() op on this torch (nll_loss gated out)")
    assert not r["handler_back"]
    assert not r["intact"] and r["lost"] == ["nll_loss"], r


def _tied_lm_grads(family: str, seq: int, apply_fix: bool) -> dict[str, Any]:
    import importlib.util
    from pathlib import Path

    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from dtensor_patches import registry

    path = Path(__file__).resolve().parents[1] / "examples" / "qwen2_tp_sp_logits.py"
    spec = importlib.util.spec_from_file_location("qwen2_example", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    config_class = transformers.Qwen2Config if family == "qwen2" else transformers.LlamaConfig
    model_class = (
        transformers.Qwen2ForCausalLM if family == "qwen2" else transformers.LlamaForCausalLM
    )
    config = config_class(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    with registry.patched(exclude=() if apply_fix else ("tp_tied_weights",)):
        torch.manual_seed(0)
        model = model_class(config)
        reference = copy.deepcopy(model)
        ids = torch.randint(1, 128, (2, seq), generator=torch.Generator().manual_seed(1))
        tp = dist.get_world_size()
        mesh = init_device_mesh("cpu", (1, tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], example.tp_sp_plan())
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        padded, mask, pad = example.pad_for_sequence_parallel(ids, tp)
        logits = model(input_ids=padded, attention_mask=mask).logits
        logits = logits[:, : logits.shape[1] - pad] if pad else logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1))
        loss.backward()
        ref_logits = reference(input_ids=ids).logits
        ref_loss = F.cross_entropy(ref_logits[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1))
        ref_loss.backward()
        diffs = {}
        plain = dict(reference.named_parameters(remove_duplicate=False))
        for name, p in model.named_parameters(remove_duplicate=False):
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            q = plain[name]
            diffs[name] = float((grad - q.grad).abs().max())
    return {"loss_diff": abs(float(loss) - float(ref_loss)), "grad_diffs": diffs}


@pytest.mark.slow
@pytest.mark.parametrize(("family", "seq"), [("qwen2", 7), ("llama", 5)])
def test_fsdp2_tp_tied_embeddings_match_single_device(
    pool2: RankPool, family: str, seq: int
) -> None:
    pytest.importorskip("transformers")
    fixed = pool2.run(_tied_lm_grads, family, seq, True)[0]
    assert fixed["loss_diff"] < 1e-5
    worst = max(fixed["grad_diffs"].items(), key=lambda kv: kv[1])
    assert worst[1] < 1e-4, worst
    stock = pool2.run(_tied_lm_grads, family, seq, False)[0]
    # Without the patch the embedding's gradient misses the LM head's share.
    assert stock["grad_diffs"]["model.embed_tokens.weight"] > 1e-2, stock

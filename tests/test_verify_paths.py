"""Our own paths under ``verify()`` with ``apply_all()``: the critic's train and inference
steps (FSDP2 + TP + SP, tiny Qwen2 and Llama from configs) and the Qwen2 TP + SP example
must come out clean (every DTensor op equal to the single-device op)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from dtensor_patches.testing import RankPool

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "qwen2_tp_sp_logits.py"


def _summary(report: Any) -> dict[str, Any]:
    return {
        "clean": report.clean,
        "text": str(report)[:4000],
        "calls": sum(report.calls.values()),
        "patched": dict(report.patched),
    }


def _critic_steps(family: str) -> dict[str, Any]:
    import dtensor_patches as dp
    from ppo_value.config import ValueConfig, tiny_model_config
    from ppo_value.worker import ValueWorker
    from tests.ppo_value.batches import make_batch

    torch.set_num_threads(1)
    cfg = ValueConfig(
        dp=1, tp=2, lr=1e-3, model_family=family, model_config=tiny_model_config(family)
    )
    worker = ValueWorker(cfg)  # calls apply_all()
    batch = make_batch(2, 7, seed=3)  # odd length: SP pads and trims
    with dp.verify(raise_on_mismatch=False, atol=1e-5, rtol=1e-4) as train:
        worker.train(batch, micro_batch_size=1)
    with dp.verify(raise_on_mismatch=False) as infer:
        worker.get_values(batch)
    return {"train": _summary(train), "infer": _summary(infer)}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_critic_train_and_inference_steps_are_clean(pool2: RankPool, family: str) -> None:
    for r in pool2.run(_critic_steps, family):
        for step in ("train", "infer"):
            assert r[step]["calls"] > 50, r[step]["text"]
            assert r[step]["clean"], r[step]["text"]


def _qwen2_example() -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers import Qwen2ForCausalLM

    import dtensor_patches as dp

    spec = importlib.util.spec_from_file_location("qwen2_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    dp.apply_all()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(example.tiny_qwen2_config()).eval()
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, example.tp_sp_plan())
    with dp.verify(raise_on_mismatch=False) as report:
        example._forward(model, ids, 0, tp=dist.get_world_size())
        example._forward(model, ids, 1, tp=dist.get_world_size())
    return _summary(report)


@pytest.mark.slow
def test_qwen2_tp_sp_example_is_clean(pool2: RankPool) -> None:
    for r in pool2.run(_qwen2_example):
        assert r["calls"] > 50, r["text"]
        assert r["clean"], r["text"]

"""The Ray worker group end to end on CPU (4 actors, dp=2 x tp=2 + SP)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ppo_value.config import ValueConfig
from ppo_value.model import build_value_model
from tests.ppo_value.batches import make_batch
from tests.ppo_value.reference import reference_train_step, reference_values

ray = pytest.importorskip("ray")
from ppo_value.ray_group import ValueWorkerGroup, WorkerGroupError, split_batch_for_dp  # noqa: E402

pytestmark = pytest.mark.ppo


def test_split_batch_for_dp() -> None:
    batch = {"a": torch.arange(6).view(6, 1), "b": torch.arange(6).view(6, 1) * 10}
    shards = split_batch_for_dp(batch, 3)
    assert [s["a"].flatten().tolist() for s in shards] == [[0, 1], [2, 3], [4, 5]]
    assert shards[2]["b"].flatten().tolist() == [40, 50]
    # 6 over 4 dp ranks: the first 6 % 4 = 2 shards hold one sequence more, order kept
    uneven = split_batch_for_dp(batch, 4)
    assert [s["a"].flatten().tolist() for s in uneven] == [[0, 1], [2, 3], [4], [5]]
    with pytest.raises(ValueError, match="cannot feed dp=7"):
        split_batch_for_dp(batch, 7)
    with pytest.raises(ValueError, match="disagree"):
        split_batch_for_dp({"a": torch.zeros(2, 1), "b": torch.zeros(3, 1)}, 1)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _group(cfg: ValueConfig) -> ValueWorkerGroup:
    return ValueWorkerGroup(cfg, num_cpus_per_worker=1.0, num_threads=1, timeout_s=300)


@pytest.mark.slow
def test_group_end_to_end(ray_cluster: None, tmp_path: Path) -> None:
    cfg = ValueConfig(dp=2, tp=2, lr=1e-2)
    batch = make_batch(8, 7, seed=11)
    with _group(cfg) as group:
        group.prepare_for_inference()
        values = group.get_values({k: batch[k] for k in ("input_ids", "attention_mask")})
        group.finish_inference()
        ref = reference_values(build_value_model(cfg), batch)
        mask = batch["attention_mask"].bool()
        assert values.shape == (8, 7)
        assert float((values - ref).abs()[mask].max()) < 1e-5

        group.prepare_for_training()
        metrics = group.train(batch)
        group.finish_training()
        ref_metrics = reference_train_step(build_value_model(cfg), cfg, batch)
        assert metrics["critic/loss"] == pytest.approx(ref_metrics["loss"], abs=1e-6)
        assert metrics["critic/grad_norm"] == pytest.approx(ref_metrics["grad_norm"], abs=1e-5)
        assert metrics["critic/step"] == 1.0

        trained = group.get_values(batch)
        assert float((trained - values).abs()[mask].max()) > 1e-3
        ckpt = group.save_checkpoint(tmp_path / "ckpt")

        with pytest.raises(WorkerGroupError, match="missing keys"):
            group.train({"input_ids": batch["input_ids"]})
        # a collective validation error leaves the group usable
        torch.testing.assert_close(group.get_values(batch), trained, rtol=0, atol=0)

    with _group(cfg.replace(seed=5)) as fresh:
        meta = fresh.load_checkpoint(ckpt)
        assert meta["step"] == 1
        restored = fresh.get_values(batch)
        assert float((restored - trained).abs()[mask].max()) < 1e-6


@pytest.mark.slow
def test_dead_actor_is_a_clear_error(ray_cluster: None) -> None:
    group = _group(ValueConfig(dp=2, tp=1))
    ray.kill(group.actors[1], no_restart=True)
    with pytest.raises(WorkerGroupError, match="rank 1 died"):
        group.get_values(make_batch(4, 5))
    with pytest.raises(WorkerGroupError, match="shut down"):
        group.get_values(make_batch(4, 5))


@pytest.mark.slow
def test_partial_failure_shuts_the_group_down(ray_cluster: None) -> None:
    """Issue 12 item 4: rank 1 raises before a collective that rank 0 is blocked in. The group
    used to report the error but stay up, and send the next call to the blocked actor."""
    group = ValueWorkerGroup(
        ValueConfig(dp=2, tp=1), num_cpus_per_worker=1.0, num_threads=1, failure_grace_s=3.0
    )
    batch = make_batch(4, 5)
    shard = {k: batch[k][:2] for k in ("input_ids", "attention_mask")}
    blocked = group.actors[0].call.remote("get_values", shard)  # waits for rank 1 in a collective
    failing = group.actors[1].call.remote("no_such_method")  # raises before joining it
    with pytest.raises(WorkerGroupError) as info:
        group._gather([blocked, failing])
    message = str(info.value)
    assert "rank 1 failed first" in message and "no_such_method" in message
    assert "ranks [0] were still running" in message and "shut down" in message
    assert group.actors == []
    with pytest.raises(WorkerGroupError, match="shut down"):
        group.get_values(batch)

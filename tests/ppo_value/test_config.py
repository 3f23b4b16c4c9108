"""ValueConfig: defaults, validation and unknown keys."""

from __future__ import annotations

import pytest

from ppo_value.config import ValueConfig, tiny_model_config


def test_round_trip_and_world_size() -> None:
    cfg = ValueConfig(dp=2, tp=2, value_clip=None)
    assert cfg.world_size == 4
    again = ValueConfig.from_dict(cfg.to_dict())
    assert again == cfg
    assert cfg.replace(lr=0.5).lr == 0.5


def test_unknown_keys_are_an_error() -> None:
    with pytest.raises(ValueError, match=r"unknown ValueConfig keys: \['lr_rate', 'tp_size'\]"):
        ValueConfig.from_dict({"lr_rate": 1.0, "tp_size": 2, "dp": 1})
    with pytest.raises(ValueError, match="unknown"):
        ValueConfig().replace(typo=1)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"dp": 0}, "dp"),
        ({"tp": -1}, "tp"),
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"optimizer": "adam"}, "optimizer"),
        ({"model_family": "gpt2"}, "model_family"),
        ({"value_clip": 0.0}, "value_clip"),
        ({"max_grad_norm": -1.0}, "max_grad_norm"),
        ({"backend": "mpi"}, "backend"),
        ({"lr": -1.0}, "lr"),
    ],
)
def test_validation(changes: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ValueConfig.from_dict(changes)


def test_tiny_model_config() -> None:
    cfg = tiny_model_config("llama", hidden_size=48)
    assert cfg["hidden_size"] == 48 and cfg["num_hidden_layers"] == 2
    with pytest.raises(ValueError, match="unknown model family"):
        tiny_model_config("gpt2")

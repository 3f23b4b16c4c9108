"""Model construction (config / local checkpoint), seeding, SP padding helper, single process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ppo_value.config import ValueConfig, tiny_model_config
from ppo_value.model import ValueModel, build_value_model, init_value_head
from ppo_value.parallel import pad_for_sequence_parallel


def _values(model: ValueModel, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, torch.ones_like(ids))


IDS = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_same_seed_same_model_whatever_the_global_rng(family: str) -> None:
    cfg = ValueConfig(model_family=family, model_config=tiny_model_config(family), seed=3)
    torch.manual_seed(1)
    a = build_value_model(cfg)
    torch.manual_seed(2)
    b = build_value_model(cfg)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    c = build_value_model(cfg.replace(seed=4))
    assert not torch.equal(a.score.weight, c.score.weight)
    assert (_values(a, IDS) - _values(c, IDS)).abs().max() > 1e-3


def test_build_does_not_consume_the_callers_rng() -> None:
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    build_value_model(ValueConfig())
    assert torch.equal(torch.rand(3), expected)


def test_model_outputs_float32_and_dropout_off() -> None:
    model = build_value_model(ValueConfig())
    out = _values(model, IDS)
    assert out.shape == (2, 7) and out.dtype == torch.float32
    assert model.config.attention_dropout == 0.0
    model.train()
    torch.testing.assert_close(_values(model, IDS), out, rtol=0, atol=0)  # no dropout


def test_init_value_head_is_seeded() -> None:
    head = torch.nn.Linear(8, 1)
    init_value_head(head, seed=7, std=0.5)
    expected = torch.randn((1, 8), generator=torch.Generator().manual_seed(7)) * 0.5
    torch.testing.assert_close(head.weight.data, expected)
    assert torch.equal(head.bias.data, torch.zeros(1))


def test_value_head_must_be_scalar() -> None:
    model = build_value_model(ValueConfig())
    with pytest.raises(ValueError, match="1 output feature"):
        ValueModel(model.model, torch.nn.Linear(32, 2))


def test_build_from_local_causal_lm_checkpoint(tmp_path: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    lm = Qwen2ForCausalLM(Qwen2Config(**tiny_model_config("qwen2")))
    lm.save_pretrained(tmp_path / "lm")
    cfg = ValueConfig(model_path=str(tmp_path / "lm"), seed=11)
    a = build_value_model(cfg)
    b = build_value_model(cfg)
    # backbone weights come from the checkpoint
    torch.testing.assert_close(a.model.embed_tokens.weight, lm.model.embed_tokens.weight)
    # the missing head is initialised from the seed, identically each time
    assert torch.equal(a.score.weight, b.score.weight)
    expected = torch.randn((1, 32), generator=torch.Generator().manual_seed(11)) * 0.02
    torch.testing.assert_close(a.score.weight.data, expected)


def test_build_from_token_classification_export_keeps_head(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model = build_value_model(ValueConfig(seed=5))
    with torch.no_grad():
        model.score.weight.fill_(0.125)
        model.score.bias.fill_(-1.5)
    out = tmp_path / "export"
    out.mkdir()
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors")
    )
    model.config.architectures = ["Qwen2ForTokenClassification"]
    model.config.save_pretrained(str(out))
    again = build_value_model(ValueConfig(model_path=str(out), seed=99))
    assert torch.equal(again.score.weight, torch.full((1, 32), 0.125))
    assert torch.equal(again.score.bias, torch.tensor([-1.5]))
    torch.testing.assert_close(_values(again, IDS), _values(model, IDS))


def test_build_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a local directory"):
        build_value_model(ValueConfig(model_path=str(tmp_path / "missing")))


def test_pad_for_sequence_parallel() -> None:
    ids = torch.tensor([[5, 6, 7], [8, 9, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    p_ids, p_mask, seq = pad_for_sequence_parallel(ids, mask, 2, pad_token_id=3)
    assert seq == 3
    assert p_ids.tolist() == [[5, 6, 7, 3], [8, 9, 0, 3]]
    assert p_mask.tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]
    same_ids, same_mask, seq4 = pad_for_sequence_parallel(ids, mask, 3)
    assert same_ids is ids and same_mask is mask and seq4 == 3
    assert pad_for_sequence_parallel(ids, mask, 4)[0].shape == (2, 4)
    with pytest.raises(ValueError, match="must be equal"):
        pad_for_sequence_parallel(ids, mask[:, :2], 2)
    with pytest.raises(ValueError, match="multiple"):
        pad_for_sequence_parallel(ids, mask, 0)


def test_right_padding_does_not_change_real_token_values() -> None:
    """The premise of the SP pad-and-trim: causal attention ignores later padding."""
    model = build_value_model(ValueConfig())
    ids = IDS[:, :5]
    mask = torch.ones_like(ids)
    with torch.no_grad():
        plain = model(ids, mask)
        p_ids, p_mask, seq = pad_for_sequence_parallel(ids, mask, 4)
        padded = model(p_ids, p_mask)[:, :seq]
    torch.testing.assert_close(padded, plain, rtol=0, atol=1e-6)


def test_value_head_equals_linear() -> None:
    from ppo_value.model import ValueHead

    head = ValueHead(8)
    with torch.no_grad():
        head.weight.copy_(torch.arange(8.0).view(1, 8) / 10)
        head.bias.fill_(0.5)
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    out = head(x)
    assert out.shape == (2, 3, 1)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, head.weight, head.bias))
    # one hand-checked entry: x = ones -> sum(0..7) / 10 + 0.5 = 3.3
    assert head(torch.ones(1, 1, 8)).item() == pytest.approx(3.3)
    assert set(head.state_dict()) == {"weight", "bias"}

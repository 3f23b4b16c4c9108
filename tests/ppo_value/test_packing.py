"""Sequence packing on one process against the plain padded model (float32, 1e-5)."""

from __future__ import annotations

import pytest
import torch

from ppo_value.activation_checkpointing import enable_activation_checkpointing
from ppo_value.config import ValueConfig, tiny_model_config
from ppo_value.model import ValueModel, build_value_model
from ppo_value.packing import pack_sequences
from tests.ppo_value.batches import make_batch
from tests.ppo_value.reference import shift

pytestmark = pytest.mark.ppo

TOL = 1e-5


@pytest.fixture(scope="module")
def model() -> ValueModel:
    return build_value_model(ValueConfig())


def _packed_values(
    model: ValueModel, ids: torch.Tensor, mask: torch.Tensor, **kw: object
) -> torch.Tensor:
    impl = model.config._attn_implementation
    p = pack_sequences(ids, mask, **kw)  # type: ignore[arg-type]
    return p.unpack(p.shift_values(model(p.input_ids, p.attention_mask(impl), p.position_ids)))


def test_two_sequences_in_one_row_do_not_leak(model: ValueModel) -> None:
    """A and B share one packed row. B's values equal B alone, position 0 of B is 0 (the
    shift does not carry A's last value over), and changing A's tokens leaves B unchanged."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(1, 64, (5,), generator=g)
    b = torch.randint(1, 64, (4,), generator=g)
    ids = torch.zeros(2, 5, dtype=torch.long)
    mask = torch.zeros(2, 5, dtype=torch.long)
    ids[0, :5], mask[0, :5] = a, 1
    ids[1, :4], mask[1, :4] = b, 1
    p = pack_sequences(ids, mask, multiple=2)
    assert p.shape == (1, 10)  # 9 tokens in one row, padded to a multiple of 2
    assert p.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0]
    with torch.no_grad():
        raw = model(p.input_ids, p.attention_mask("sdpa"), p.position_ids)
        values = p.unpack(p.shift_values(raw))
        alone = shift(model(b[None], torch.ones(1, 4, dtype=torch.long)))[0]
        other = ids.clone()
        other[0, :5] = torch.randint(1, 64, (5,), generator=g)
        changed = _packed_values(model, other, mask, multiple=2)
    assert values[1, 0] == 0.0
    assert raw[0, 4] != 0.0  # A's last head output exists; it must not become B's V(s_0)
    assert float((values[1, :4] - alone).abs().max()) < TOL
    assert torch.equal(changed[1], values[1])
    assert float((changed[0] - values[0]).abs().max()) > 1e-4  # A itself did change


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize(("row_tokens", "multiple"), [(None, 1), (9, 1), (12, 4), (3, 2)])
def test_packed_values_equal_padded(impl: str, row_tokens: int | None, multiple: int) -> None:
    m = build_value_model(ValueConfig(attn_implementation=impl))
    batch = make_batch(6, 9, seed=7)
    batch["attention_mask"][2] = 0  # a sequence without tokens unpacks to zeros
    with torch.no_grad():
        ref = shift(m(batch["input_ids"], batch["attention_mask"]))
        got = _packed_values(
            m, batch["input_ids"], batch["attention_mask"], row_tokens=row_tokens, multiple=multiple
        )
    valid = batch["attention_mask"].bool()
    assert float((got - ref).abs()[valid].max()) < TOL
    assert torch.equal(got[~valid], torch.zeros_like(got[~valid]))


def test_packed_gradients_equal_padded() -> None:
    batch = make_batch(4, 8, seed=3)
    grads = []
    for packed in (False, True):
        m = build_value_model(
            ValueConfig(model_config=tiny_model_config("llama"), model_family="llama")
        )
        if packed:
            v = _packed_values(
                m, batch["input_ids"], batch["attention_mask"], row_tokens=10, multiple=2
            )
        else:
            v = shift(m(batch["input_ids"], batch["attention_mask"]))
        ((v - batch["returns"]) ** 2 * batch["loss_mask"]).sum().backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=0, atol=TOL, msg=n)


def test_packing_layout_and_errors() -> None:
    ids = torch.arange(1, 13).view(3, 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    p = pack_sequences(ids, mask, row_tokens=5, pad_token_id=0)
    # first fit decreasing: [len 4] and [len 3, len 2] -> rows of 4 and 5 tokens, T = 5
    assert p.shape == (2, 5)
    assert p.num_valid_tokens == 9
    rows = sorted(p.input_ids.tolist())
    assert rows == [[1, 2, 3, 5, 6], [9, 10, 11, 12, 0]]
    mask4 = p.attention_mask("sdpa")
    assert mask4 is not None and mask4.shape == (2, 1, 5, 5)
    assert p.attention_mask("flash_attention_2") is None
    additive = p.attention_mask("eager")
    assert additive is not None and additive.dtype == torch.float32
    assert torch.equal(additive == 0, mask4)
    with pytest.raises(ValueError, match="equal"):
        pack_sequences(ids, mask[:, :3])
    with pytest.raises(ValueError, match="multiple"):
        pack_sequences(ids, mask, multiple=0)
    with pytest.raises(ValueError, match=r"\(2, 5\)"):
        p.unpack(torch.zeros(1, 5))


def test_activation_checkpointing_same_gradients_less_saved() -> None:
    batch = make_batch(4, 8, seed=5)
    grads, saved = [], []
    for ac in (False, True):
        m = build_value_model(ValueConfig())
        if ac:
            assert enable_activation_checkpointing(m.model.layers) == 2
            assert enable_activation_checkpointing(m.model.layers) == 0  # idempotent
        count = [0]

        def pack(t: torch.Tensor, count: list[int] = count) -> torch.Tensor:
            count[0] += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            v = shift(m(batch["input_ids"], batch["attention_mask"]))
        ((v - batch["returns"]) ** 2 * batch["loss_mask"]).sum().backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
        saved.append(count[0])
        assert set(m.state_dict()) == set(build_value_model(ValueConfig()).state_dict())
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=0, atol=TOL, msg=n)
    assert saved[1] < saved[0] / 2


def test_left_padded_batch_packs_to_the_same_values(model: ValueModel) -> None:
    """Left padding (prompts aligned on the right): packed positions restart at 0 while the
    padded forward uses column indices; RoPE is relative, so valid values agree, and the first
    token of each sequence gets 0."""
    batch = make_batch(4, 8, seed=13)
    right = batch["attention_mask"]
    left = right.flip(1)
    ids = batch["input_ids"]
    with torch.no_grad():
        ref = shift(model(ids, left))
        got = _packed_values(model, ids, left, multiple=2)
    valid = left.bool()
    first = valid.long().argmax(dim=1)
    rows = torch.arange(4)
    assert torch.equal(got[rows, first], torch.zeros(4))
    later = valid.clone()
    later[rows, first] = False  # the padded path shifts a padding position's value in there
    assert float((got - ref).abs()[later].max()) < TOL

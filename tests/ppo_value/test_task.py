"""The demo's verifiable arithmetic task and in-process tokenizer."""

from __future__ import annotations

import torch

from ppo_value.task import ArithmeticTask, build_tokenizer


def test_tokenizer_is_character_level() -> None:
    tok = build_tokenizer()
    assert tok.encode("12+7=19").tokens == ["1", "2", "+", "7", "=", "1", "9"]
    assert tok.token_to_id("<pad>") == 0 and tok.token_to_id("<eos>") == 1
    assert tok.get_vocab_size() == 14


def test_verify() -> None:
    assert ArithmeticTask.verify(3, 4, 7) == 1.0
    assert ArithmeticTask.verify(3, 4, 8) == 0.0
    assert ArithmeticTask.verify(9, 9, 18) == 1.0


def test_rollouts_are_consistent_and_verified() -> None:
    task = ArithmeticTask(build_tokenizer())
    roll = task.sample(200, torch.Generator().manual_seed(0))
    tok = task.tokenizer
    for i in range(200):
        n = int(roll.attention_mask[i].sum())
        ids = roll.input_ids[i, :n].tolist()
        text = "".join(tok.id_to_token(t) for t in ids[:-1])
        assert ids[-1] == task.eos_id
        prompt, answer = text.split("=")
        a, b = (int(x) for x in prompt.split("+"))
        reward = float(int(answer) == a + b)
        # reward on <eos> only, equal to an independent check of the text
        assert roll.rewards[i, n - 1].item() == reward
        assert roll.rewards[i].sum().item() == reward
        assert bool(roll.correct[i]) == (reward == 1.0)
        # the loss mask covers exactly the answer digits and <eos>
        assert roll.loss_mask[i].tolist() == [0] * (len(prompt) + 1) + [1] * (len(answer) + 1) + [
            0
        ] * (roll.input_ids.shape[1] - n)
        assert (roll.input_ids[i, n:] == task.pad_id).all()


def test_policy_accuracy_depends_on_carry_and_is_reproducible() -> None:
    task = ArithmeticTask(build_tokenizer(), p_no_carry=0.9, p_carry=0.2)
    roll = task.sample(4000, torch.Generator().manual_seed(1))
    again = task.sample(4000, torch.Generator().manual_seed(1))
    assert torch.equal(roll.input_ids, again.input_ids)
    ids = roll.input_ids
    digits = {task.tokenizer.token_to_id(str(d)): d for d in range(10)}
    a = torch.tensor([digits[int(t)] for t in ids[:, 0]])
    b = torch.tensor([digits[int(t)] for t in ids[:, 2]])
    carry = (a + b) >= 10
    acc_carry = roll.correct[carry].float().mean().item()
    acc_plain = roll.correct[~carry].float().mean().item()
    assert abs(acc_plain - 0.9) < 0.03
    assert abs(acc_carry - 0.2) < 0.03

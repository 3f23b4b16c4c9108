"""An in-process verifiable task for the demo: single-digit addition.

Prompts are ``"a+b="`` with ``a, b`` in ``0..9``; a response is the answer's digits and
``<eos>``. The reward is 1 on the ``<eos>`` token if the answer equals ``a + b``, else 0
(verifiable: checked by integer arithmetic, no model). The "policy" is a stand-in random
answer generator whose accuracy depends on the problem (good without a carry, poor with one),
so the expected reward varies across prompts and a critic has something to learn: before the
answer, ``V`` should predict the policy's accuracy on that prompt; after it, whether the
answer is right.

The tokenizer is a character-level ``tokenizers.Tokenizer`` (``WordLevel``) built in process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

__all__ = ["ArithmeticTask", "Rollouts", "build_tokenizer"]

PAD, EOS = "<pad>", "<eos>"
_SYMBOLS = [PAD, EOS, *[str(d) for d in range(10)], "+", "="]


def build_tokenizer() -> Tokenizer:
    """Character-level tokenizer: ``<pad>`` = 0, ``<eos>`` = 1, digits 2..11, ``+``, ``=``."""
    vocab = {s: i for i, s in enumerate(_SYMBOLS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[0-9+=]"), behavior="isolated")
    return tok


@dataclass
class Rollouts:
    """A right-padded batch of episodes, all tensors ``[B, S]``.

    Attributes:
        input_ids: int64 prompt + response + ``<eos>`` token ids, ``<pad>`` after.
        attention_mask: int64 1 on real tokens.
        loss_mask: int64 1 on response tokens (answer digits and ``<eos>``).
        rewards: float32, the episode reward (0/1) on the ``<eos>`` token, 0 elsewhere.
        correct: ``[B]`` bool, whether the answer was right.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    rewards: torch.Tensor
    correct: torch.Tensor


class ArithmeticTask:
    """Samples problems and policy answers; verifies them.

    Args:
        tokenizer: from :func:`build_tokenizer`.
        p_no_carry: policy accuracy when ``a + b < 10``.
        p_carry: policy accuracy when ``a + b >= 10``.
    """

    def __init__(
        self, tokenizer: Tokenizer, *, p_no_carry: float = 0.9, p_carry: float = 0.2
    ) -> None:
        self.tokenizer = tokenizer
        self.p_no_carry = p_no_carry
        self.p_carry = p_carry
        self.pad_id = tokenizer.token_to_id(PAD)
        self.eos_id = tokenizer.token_to_id(EOS)

    @property
    def vocab_size(self) -> int:
        """Number of token ids."""
        return self.tokenizer.get_vocab_size()

    @staticmethod
    def verify(a: int, b: int, answer: int) -> float:
        """The reward: 1.0 if ``answer == a + b`` else 0.0."""
        return 1.0 if answer == a + b else 0.0

    def sample(self, n: int, generator: torch.Generator) -> Rollouts:
        """``n`` episodes from the random policy, reproducible from ``generator``."""
        ab = torch.randint(0, 10, (n, 2), generator=generator)
        u = torch.rand(n, generator=generator)
        wrong = torch.randint(0, 18, (n,), generator=generator)
        seqs: list[list[int]] = []
        prompt_lens: list[int] = []
        rewards: list[float] = []
        for i in range(n):
            a, b = int(ab[i, 0]), int(ab[i, 1])
            p = self.p_no_carry if a + b < 10 else self.p_carry
            answer = a + b if float(u[i]) < p else int(wrong[i]) + int(int(wrong[i]) >= a + b)
            prompt = self.tokenizer.encode(f"{a}+{b}=").ids
            response = [*self.tokenizer.encode(str(answer)).ids, self.eos_id]
            seqs.append(prompt + response)
            prompt_lens.append(len(prompt))
            rewards.append(self.verify(a, b, answer))
        seq = max(len(s) for s in seqs)
        ids = torch.full((n, seq), self.pad_id, dtype=torch.long)
        attn = torch.zeros(n, seq, dtype=torch.long)
        loss_mask = torch.zeros(n, seq, dtype=torch.long)
        rew = torch.zeros(n, seq)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            attn[i, : len(s)] = 1
            loss_mask[i, prompt_lens[i] : len(s)] = 1
            rew[i, len(s) - 1] = rewards[i]
        return Rollouts(ids, attn, loss_mask, rew, torch.tensor(rewards) > 0)

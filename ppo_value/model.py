"""The value model: a ``transformers`` decoder backbone plus a float32 scalar head.

:class:`ValueModel` keeps the attribute names of ``transformers``' ``*ForTokenClassification``
classes (``model`` for the backbone, ``score`` for the head), so its state dict is a
``Qwen2ForTokenClassification`` / ``LlamaForTokenClassification`` state dict with
``num_labels = 1`` and :meth:`ppo_value.worker.ValueWorker.export_hf` output loads with
``AutoModelForTokenClassification.from_pretrained``.

Initialisation is seeded: the backbone from ``torch.manual_seed(seed)`` inside a forked RNG
(so the caller's RNG is untouched) and the head from its own generator seeded with ``seed``.
Every rank and every launch with the same seed therefore builds identical weights, which
tensor/data parallel sharding of a rank-local full model relies on (design notes §4).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from ppo_value.config import SUPPORTED_FAMILIES, ValueConfig

log = logging.getLogger(__name__)

__all__ = ["ValueHead", "ValueModel", "build_value_model", "init_value_head"]

#: Config keys that enable dropout in the supported families; forced to 0.
_DROPOUT_KEYS: tuple[str, ...] = ("attention_dropout", "hidden_dropout", "classifier_dropout")


class ValueHead(nn.Linear):
    """``nn.Linear(H, 1)`` computed as a dot product over the hidden dimension.

    Same parameters and state-dict keys as the ``score`` layer of ``*ForTokenClassification``,
    but the forward is ``(x * weight).sum(-1, keepdim=True) + bias`` instead of
    ``F.linear``: a pointwise product and a reduction over ``H`` keep a sequence-sharded
    ``[B, S, H]`` DTensor sharded without flattening ``[B, S]``. (``F.linear`` views the input
    as ``[B * S, H]``, which DTensor cannot do for a sharded ``S`` before torch 2.10.)
    """

    def __init__(self, hidden_size: int, bias: bool = True) -> None:
        """Args: hidden_size: ``H``; bias: whether the head has a bias."""
        super().__init__(hidden_size, 1, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` -> ``[..., 1]`` in the parameters' dtype."""
        out = (x * self.weight).sum(dim=-1, keepdim=True)  # [1, H] broadcasts over [B, S, H]
        if self.bias is not None:
            out = out + self.bias
        return out


class ValueModel(nn.Module):
    """Backbone plus scalar value head.

    Args:
        backbone: a ``transformers`` base model (``Qwen2Model``, ``LlamaModel``) returning
            ``last_hidden_state`` of shape ``[B, S, H]``.
        score: ``nn.Linear(H, 1)`` value head, kept in float32.
    """

    def __init__(self, backbone: nn.Module, score: nn.Linear) -> None:
        super().__init__()
        if score.out_features != 1:
            raise ValueError(f"value head must have 1 output feature, got {score.out_features}")
        self.model = backbone
        self.score = score

    @property
    def config(self) -> Any:
        """The backbone's ``transformers`` config."""
        return self.model.config

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **attention_kwargs: Any,
    ) -> torch.Tensor:
        """Raw (unshifted) token values.

        Args:
            input_ids: ``[B, S]`` int64 token ids.
            attention_mask: ``[B, S]`` 0/1 (1 = real token), ``None`` for all ones, or a 4-D
                mask that ``transformers`` uses as-is (packed rows, :mod:`ppo_value.packing`).
            position_ids: ``[B, S]`` int64 positions; ``None`` means ``0..S-1``.
            attention_kwargs: passed to every attention layer (``cp_shard`` under context
                parallelism, :mod:`ppo_value.context_parallel`); ``attention_mask`` may then
                be ``transformers``' per-layer-type mapping of ready masks.

        Returns:
            ``[B, S]`` float32 plain tensor; ``out[:, t]`` is the value of the state after
            token ``t``. Under sequence parallelism the head's ``[B, S, 1]`` DTensor output is
            redistributed to ``Replicate`` (the only redistribution of the head).
        """
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **attention_kwargs,
        )
        hidden = out.last_hidden_state.float()
        values = self.score(hidden)
        if isinstance(values, DTensor):
            values = values.redistribute(
                values.device_mesh, [Replicate()] * values.device_mesh.ndim
            ).to_local()
        return values.squeeze(-1)


@torch.no_grad()
def init_value_head(score: nn.Linear, *, seed: int, std: float) -> None:
    """Initialise ``score`` in place: weight ``N(0, std^2)`` from a generator seeded with
    ``seed``, bias 0. Independent of the global RNG, so identical on every rank and launch."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    weight = torch.randn(score.weight.shape, generator=gen, dtype=torch.float32) * std
    score.weight.copy_(weight)
    if score.bias is not None:
        score.bias.zero_()


def _config_class(family: str) -> type:
    from transformers import LlamaConfig, Qwen2Config

    classes: dict[str, type] = {"qwen2": Qwen2Config, "llama": LlamaConfig}
    return classes[family]


def build_value_model(cfg: ValueConfig) -> ValueModel:
    """Build a float32 :class:`ValueModel` on CPU from ``cfg`` (no parallelism applied).

    With ``cfg.model_path`` the weights come from that local directory (a causal-LM or base
    checkpoint gets a fresh seeded head; a token-classification export keeps its head).
    Otherwise the backbone is ``cfg.model_family`` built from ``cfg.model_config`` with seeded
    random weights. Dropout is set to 0 and the model is left in eval mode (no dropout).

    Raises:
        ValueError: unknown family, unsupported ``model_type`` in a checkpoint, or a
            ``model_path`` that is not a directory.
    """
    from transformers import AutoConfig, AutoModelForTokenClassification

    dropout_off = dict.fromkeys(_DROPOUT_KEYS, 0.0)
    if cfg.model_path is not None:
        if not os.path.isdir(cfg.model_path):
            raise ValueError(f"model_path {cfg.model_path!r} is not a local directory")
        hf_config = AutoConfig.from_pretrained(cfg.model_path, num_labels=1, **dropout_off)
        if hf_config.model_type not in SUPPORTED_FAMILIES:
            raise ValueError(
                f"checkpoint model_type {hf_config.model_type!r} not supported; "
                f"supported: {SUPPORTED_FAMILIES}"
            )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            tc_model, info = AutoModelForTokenClassification.from_pretrained(
                cfg.model_path,
                config=hf_config,
                dtype=torch.float32,
                attn_implementation=cfg.attn_implementation,
                output_loading_info=True,
            )
        head_missing = any(k.startswith("score.") for k in info.get("missing_keys", ()))
    else:
        config_cls = _config_class(cfg.model_family)
        kwargs = {**dict(cfg.model_config), **dropout_off, "num_labels": 1, "use_cache": False}
        hf_config = config_cls(**kwargs)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            tc_model = AutoModelForTokenClassification.from_config(
                hf_config, attn_implementation=cfg.attn_implementation, dtype=torch.float32
            )
        head_missing = True
    if head_missing:
        std = float(getattr(tc_model.config, "initializer_range", 0.02))
        init_value_head(tc_model.score, seed=cfg.seed, std=std)
        log.info("value head initialised from seed %d (std %.3g)", cfg.seed, std)
    with torch.random.fork_rng(devices=[]):  # nn.Linear's own init must not use the caller's RNG
        score = ValueHead(tc_model.score.in_features, bias=tc_model.score.bias is not None)
    score.load_state_dict(tc_model.score.state_dict())
    model = ValueModel(tc_model.model, score).float()
    model.config.use_cache = False
    model.eval()  # dropout is 0 anyway; eval() also makes intent explicit
    return model

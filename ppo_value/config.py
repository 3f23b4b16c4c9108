"""Typed configuration of the value worker.

One frozen dataclass, :class:`ValueConfig`, with documented defaults. Build it from a plain
mapping (e.g. parsed YAML or JSON) with :meth:`ValueConfig.from_dict`, which rejects unknown
keys instead of silently ignoring them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SUPPORTED_FAMILIES", "ValueConfig", "tiny_model_config"]

#: Model families with a TP + SP plan in :mod:`ppo_value.parallel` (``config.model_type``).
SUPPORTED_FAMILIES: tuple[str, ...] = ("qwen2", "llama")


def tiny_model_config(family: str = "qwen2", **overrides: Any) -> dict[str, Any]:
    """Keyword arguments for a tiny random-weight ``transformers`` config of ``family``.

    Sized for CPU tests: hidden 32, 2 layers, 4 attention heads, 2 key/value heads,
    vocabulary 64, float32. ``overrides`` replace any key.

    Raises:
        ValueError: if ``family`` is not in :data:`SUPPORTED_FAMILIES`.
    """
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(f"unknown model family {family!r}; supported: {SUPPORTED_FAMILIES}")
    cfg: dict[str, Any] = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    }
    cfg.update(overrides)
    return cfg


@dataclass(frozen=True)
class ValueConfig:
    """Configuration of :class:`ppo_value.worker.ValueWorker`.

    Attributes:
        model_family: ``"qwen2"`` or ``"llama"``; used with ``model_config`` to build a random
            initialised backbone. Ignored when ``model_path`` is set (the checkpoint's
            ``config.json`` decides).
        model_config: keyword arguments for the family's ``transformers`` config class
            (``Qwen2Config`` / ``LlamaConfig``). Dropout is always forced to 0.
        model_path: local directory with a ``transformers`` checkpoint (causal LM, base model
            or a token-classification export from :meth:`ValueWorker.export_hf`). No downloads.
        dp: data-parallel degree (FSDP2 sharding); ``dp * cp * tp`` must equal the world size.
        cp: context-parallel degree: each micro-batch's sequence is split over ``cp`` ranks
            (head-tail load balanced, :mod:`ppo_value.context_parallel`); attention gathers keys
            and values over them. Needs ``attn_implementation="sdpa"``. With ``cp > 1`` FSDP2
            shards parameters over cp and replicates them over dp (HSDP on ``(dp, cp)``).
        tp: tensor-parallel degree; must divide the attention and key/value head counts.
        sequence_parallel: with ``tp > 1``, shard activations along the sequence between TP
            blocks (sequence lengths that are not a multiple of ``tp`` are padded and trimmed);
            ``False`` keeps them replicated over TP (all-reduces instead of reduce-scatters
            and all-gathers, no padding). Ignored with ``tp == 1``.
        micro_batch_size: sequences per forward/backward on each dp rank.
        optimizer: ``"adamw"`` or ``"sgd"``.
        lr: learning rate (peak, after warm-up).
        weight_decay: decoupled weight decay (AdamW) or L2 (SGD).
        adam_betas: AdamW betas.
        adam_eps: AdamW epsilon.
        warmup_steps: linear warm-up from ``lr / (warmup_steps + 1)`` to ``lr``, then constant.
        max_grad_norm: clip the global gradient 2-norm to this value; ``None`` disables clipping
            (the norm is still computed and reported).
        value_clip: PPO value clip range ``c`` (values clipped to ``old ± c``); ``None`` disables.
        mixed_precision: FSDP2 mixed precision, bf16 parameters with fp32 gradient reduction;
            the value head always runs in float32.
        seed: seeds the whole model initialisation (identical on every rank and launch).
        backend: process-group backend; ``None`` picks ``"nccl"`` with CUDA, else ``"gloo"``.
        attn_implementation: ``transformers`` attention implementation (``"sdpa"``/``"eager"``;
            ``"flash_attention_2"`` on GPU gives packed rows the varlen kernel).
        sequence_packing: pack the sequences of each micro-batch into rows (per-sequence
            positions, block-diagonal causal attention; :mod:`ppo_value.packing`). Values are
            unpacked to ``[B, S]``; results equal the padded path.
        pack_row_tokens: most tokens per packed row (bounds the ``T x T`` attention mask of
            ``sdpa``/``eager``, whose cost is quadratic in ``T``); ``None`` uses the longest
            sequence of the micro-batch. Varlen attention (``flash_attention_*``) always packs a
            micro-batch into one row. Ignored without ``sequence_packing``.
        max_tokens_per_micro_batch: token budget per micro-batch: sequences are grouped by
            length instead of ``micro_batch_size`` at a time (:mod:`ppo_value.batching`; packed
            tokens with packing, ``sequences * longest`` without). ``None`` disables.
        activation_checkpointing: recompute each decoder layer in backward instead of keeping
            its activations (:mod:`ppo_value.activation_checkpointing`); same gradients.
        numa_binding: on GPU, pin each worker's CPU threads to its GPU's NUMA node
            (:mod:`ppo_value.numa`); no effect on CPU.
    """

    model_family: str = "qwen2"
    model_config: Mapping[str, Any] = field(default_factory=tiny_model_config)
    model_path: str | None = None
    dp: int = 1
    cp: int = 1
    tp: int = 1
    sequence_parallel: bool = True
    micro_batch_size: int = 4
    optimizer: str = "adamw"
    lr: float = 1e-4
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    warmup_steps: int = 0
    max_grad_norm: float | None = 1.0
    value_clip: float | None = 0.2
    mixed_precision: bool = False
    seed: int = 0
    backend: str | None = None
    attn_implementation: str = "sdpa"
    sequence_packing: bool = False
    pack_row_tokens: int | None = None
    max_tokens_per_micro_batch: int | None = None
    activation_checkpointing: bool = False
    numa_binding: bool = True

    def __post_init__(self) -> None:
        """Validate field values.

        Raises:
            ValueError: on a non-positive degree or batch size, an unknown family or
                optimizer, a negative learning rate / clip range / warm-up.
        """
        if self.model_path is None and self.model_family not in SUPPORTED_FAMILIES:
            raise ValueError(
                f"model_family must be one of {SUPPORTED_FAMILIES}, got {self.model_family!r}"
            )
        for name in ("dp", "cp", "tp", "micro_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {self.optimizer!r}")
        if self.lr < 0:
            raise ValueError(f"lr must be >= 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.value_clip is not None and self.value_clip <= 0:
            raise ValueError(f"value_clip must be > 0 or None, got {self.value_clip}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}")
        for name in ("pack_row_tokens", "max_tokens_per_micro_batch"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if self.cp > 1 and self.attn_implementation != "sdpa":
            raise ValueError(
                f"cp={self.cp} needs attn_implementation='sdpa' (context parallelism gathers keys "
                f"and values and runs SDPA with a mask), got {self.attn_implementation!r}"
            )
        if self.backend not in (None, "gloo", "nccl"):
            raise ValueError(f"backend must be None, 'gloo' or 'nccl', got {self.backend!r}")
        object.__setattr__(self, "model_config", dict(self.model_config))
        object.__setattr__(self, "adam_betas", tuple(self.adam_betas))

    @property
    def world_size(self) -> int:
        """Number of ranks the config needs: ``dp * cp * tp``."""
        return self.dp * self.cp * self.tp

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ValueConfig:
        """Build a config from a mapping.

        Raises:
            ValueError: if ``data`` has keys that are not fields (all unknown keys are listed),
                or if a value fails validation.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ValueConfig keys: {unknown}; known keys: {sorted(known)}")
        return cls(**dict(data))

    def to_dict(self) -> dict[str, Any]:
        """A plain-``dict`` copy of every field (round-trips through :meth:`from_dict`)."""
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> ValueConfig:
        """A copy with ``changes`` applied (same validation and unknown-key check)."""
        data = self.to_dict()
        data.update(changes)
        return ValueConfig.from_dict(data)

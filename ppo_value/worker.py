""":class:`ValueWorker`: the PPO critic on one rank of a ``(dp, tp)`` mesh.

Each rank holds one worker. Ranks with the same dp index form a TP group and must receive the
same data; :class:`~ppo_value.ray_group.ValueWorkerGroup` (or the caller) splits the global batch
along dp. Every method is collective: call it on all ranks with their dp shard.

Batches are mappings of ``[B, S]`` CPU tensors:

- ``get_values``: ``input_ids`` (int64), ``attention_mask`` (0/1).
- ``train``: additionally ``loss_mask`` (0/1 valid response tokens, never shifted),
  ``old_values`` (float, from ``get_values``) and ``returns`` (float, e.g. from
  :func:`ppo_value.gae.compute_gae`).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import dtensor_patches
from ppo_value import batching
from ppo_value import checkpoint as ckpt
from ppo_value._agree import agree
from ppo_value._batch import INFER_KEYS, TRAIN_KEYS, check_batch, check_micro_batch_size
from ppo_value.activation_checkpointing import enable_activation_checkpointing
from ppo_value.alignment import RightShiftLossWrapper, right_shift_values
from ppo_value.config import ValueConfig
from ppo_value.context_parallel import SequenceShard, gather_sequence, register_attention
from ppo_value.grad_norm import clip_grad_norm_flat
from ppo_value.losses import ClippedValueLoss
from ppo_value.metrics import ValueStats
from ppo_value.model import ValueModel, build_value_model
from ppo_value.numa import bind_to_gpu_numa_node
from ppo_value.packing import VARLEN_IMPLEMENTATIONS, pack_sequences
from ppo_value.parallel import build_mesh, pad_for_sequence_parallel, parallelize_value_model
from ppo_value.patch_needs import check_patch_report

log = logging.getLogger(__name__)

__all__ = ["ValueWorker"]


class ValueWorker:
    """A PPO value model sharded with FSDP2 over dp and TP + SP over tp.

    Calls :func:`dtensor_patches.apply_all` before building the model and checks its report
    (:func:`ppo_value.patch_needs.check_patch_report`). Initialises the default process group
    from the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...) if it is not
    initialised yet.

    Args:
        config: :class:`~ppo_value.config.ValueConfig`; ``dp * tp`` must equal the world size.

    Raises:
        ValueError: world size mismatch, unsupported model, or TP degree not dividing heads.
        PatchRequirementError: a patch the critic needs failed to apply (named, with why);
            other failed patches are one warning on rank 0.
    """

    def __init__(self, config: ValueConfig) -> None:
        report = dtensor_patches.apply_all()
        self.config = config
        backend = config.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if not dist.is_initialized():
            dist.init_process_group(backend)
        check_patch_report(report, warn=dist.get_rank() == 0)
        if dist.get_backend() == "nccl":
            local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
            if config.numa_binding:
                bind_to_gpu_numa_node(self.device)
        else:
            self.device = torch.device("cpu")
        self.mesh = build_mesh(config.dp, config.tp, self.device.type, cp=config.cp)
        self.cp_group = self.mesh["cp"].get_group() if config.cp > 1 else None
        self.dp_rank = self.mesh["dp"].get_local_rank()
        self.tp_rank = self.mesh["tp"].get_local_rank()
        self.dp_group = self.mesh["dp"].get_group()
        model = build_value_model(config).to(self.device)
        self.hf_config = model.config
        self.pad_token_id = int(model.config.pad_token_id or 0)
        self.vocab_size = int(model.config.vocab_size)
        if config.cp > 1:
            self._use_cp_attention(model)
        if config.activation_checkpointing:
            enable_activation_checkpointing(model.model.layers)
        self.model: ValueModel = parallelize_value_model(
            model,
            self.mesh,
            mixed_precision=config.mixed_precision,
            sequence_parallel=config.sequence_parallel,
        )
        params = list(self.model.parameters())
        if config.optimizer == "adamw":
            self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(
                params,
                lr=config.lr,
                betas=config.adam_betas,
                eps=config.adam_eps,
                weight_decay=config.weight_decay,
            )
        else:
            self.optimizer = torch.optim.SGD(params, lr=config.lr, weight_decay=config.weight_decay)
        warmup = config.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1))
        )
        self.loss_fn = RightShiftLossWrapper(ClippedValueLoss(config.value_clip))
        self.step = 0
        log.info(
            "value worker rank %d: dp %d/%d tp %d/%d, %d params",
            dist.get_rank(),
            self.dp_rank,
            config.dp,
            self.tp_rank,
            config.tp,
            sum(p.numel() for p in params),
        )

    # ----------------------------------------------------------------- helpers
    def _dp_all_reduce(self, values: list[float], op: dist.ReduceOp.RedOpType) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op, group=self.dp_group)
        return t.tolist()

    def _checked(
        self, batch: Mapping[str, torch.Tensor], keys: tuple[str, ...], micro: int | None, what: str
    ) -> tuple[int, int]:
        """``(B, micro-batch size)`` after every rank checked its batch; raises the same
        ``ValueError`` on every rank if any rank's batch or argument is bad."""
        error: ValueError | None = None
        sizes = (0, 0)
        try:
            size = check_micro_batch_size(micro, self.config.micro_batch_size)
            packed = self.config.sequence_packing
            sizes = (check_batch(batch, keys, self.vocab_size, packed=packed), size)
        except ValueError as exc:
            error = exc
        agree(error, what=what, exc_type=ValueError)
        return sizes

    @property
    def _length_multiple(self) -> int:
        """Sequence lengths must be a multiple of this: the TP degree under SP, else 1; under
        CP ``2 * cp`` times that (``2 * cp`` equal chunks, each rank's two a multiple of it)."""
        sp = self.config.tp if self.config.sequence_parallel else 1
        return sp * 2 * self.config.cp if self.config.cp > 1 else sp

    @staticmethod
    def _use_cp_attention(model: ValueModel) -> None:
        """Switch every attention layer to the CP attention (:mod:`ppo_value.context_parallel`).

        Raises:
            ValueError: a layer type other than full causal attention (a sliding window would
                need its own mask).
        """
        kinds = set(getattr(model.config, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"}:
            raise ValueError(f"cp > 1 supports full causal attention layers only, got {kinds}")
        model.model.set_attn_implementation(register_attention())

    def _cp_values(
        self,
        input_ids: torch.Tensor,
        valid: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Raw values ``[b, T]`` of ``[b, T]`` rows computed context-parallel: this rank runs
        its head-tail columns, attention sees every rank's keys through the mask of
        ``valid`` keys (and ``segment_ids`` documents), and the values come back in the global
        order on every CP rank (so the shift reads across CP chunks)."""
        dtype = torch.bfloat16 if self.config.mixed_precision else torch.float32
        shard = SequenceShard.build(self.cp_group, valid, segment_ids, dtype)
        if position_ids is None:
            position_ids = torch.arange(shard.length, device=self.device).expand_as(input_ids)
        local = self.model(
            shard.local(input_ids),
            {"full_attention": None},  # the CP attention builds its masks (per layer, per chunk)
            shard.local(position_ids),
            cp_shard=shard,
        )
        return gather_sequence(local, shard, dim=1)

    def _micro_batches(self, batch: Mapping[str, torch.Tensor], micro: int) -> list[list[int]]:
        """Sequence indices of each micro-batch; the same count on every dp rank.

        Fixed size (``micro`` sequences) unless ``config.max_tokens_per_micro_batch`` is set;
        token-budget plans are split or padded with empty micro-batches to the dp maximum. dp
        ranks may hold different numbers of sequences (a batch that dp does not divide): the
        ranks with fewer micro-batches run empty ones (zero-weight passes that keep FSDP2's
        collectives in step); the loss is normalised by the global token count either way.
        """
        batch_size = int(batch["input_ids"].shape[0])
        budget = self.config.max_tokens_per_micro_batch
        if budget is None:
            fixed = batching.fixed_size_micro_batches(batch_size, micro)
            (target,) = self._dp_all_reduce([len(fixed)], dist.ReduceOp.MAX)
            return fixed + [[] for _ in range(int(target) - len(fixed))]
        packed = self.config.sequence_packing
        lengths = batching.sequence_lengths(batch["attention_mask"], packed=packed)
        try:
            groups = batching.token_budget_micro_batches(lengths, budget, packed=packed)
            error = None
        except ValueError as exc:  # raise on every dp rank, not only here (no hang)
            groups, error = [], exc
        target, failed = self._dp_all_reduce([len(groups), error is not None], dist.ReduceOp.MAX)
        if error is not None:
            raise error
        if failed:
            raise ValueError(
                "another data-parallel rank has a sequence longer than "
                f"max_tokens_per_micro_batch={budget}"
            )
        return batching.equalise_micro_batches(groups, lengths, int(target), packed=packed)

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Raw values ``[b, S]`` float32 for one micro-batch.

        Trailing columns that no sequence uses are cut off (causal attention: the other
        positions do not depend on them) and come back as 0; the rest is padded for SP and
        trimmed."""
        width = int(input_ids.shape[1])
        extent = max(1, *batching.sequence_lengths(attention_mask, packed=False))
        ids, mask, seq = pad_for_sequence_parallel(
            input_ids[:, :extent].to(self.device),
            attention_mask[:, :extent].to(self.device),
            self._length_multiple,
            self.pad_token_id,
        )
        raw = (self._cp_values(ids, mask) if self.cp_group is not None else self.model(ids, mask))[
            :, :seq
        ]
        return torch.nn.functional.pad(raw, (0, width - extent)) if extent < width else raw

    def _packed_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``V(s_t)`` ``[b, S]`` of one micro-batch through packed rows (already shifted, per
        sequence); 0 at masked positions."""
        impl = self.config.attn_implementation
        if impl in VARLEN_IMPLEMENTATIONS:
            row_tokens = None  # varlen kernels skip the other sequences: one row is cheapest
        else:
            # a dense T x T mask costs T^2: rows no longer than the longest sequence keep the
            # attention within what the padded forward computes
            # (at least 1: a micro-batch of fully masked sequences is one row of padding; 0
            # raised in pack_sequences on this rank only, inside FSDP2's collectives)
            row_tokens = self.config.pack_row_tokens or max(
                [1, *batching.sequence_lengths(attention_mask, packed=True)]
            )
        packed = pack_sequences(
            input_ids,
            attention_mask,
            row_tokens=row_tokens,
            multiple=self._length_multiple,
            pad_token_id=self.pad_token_id,
        ).to(self.device)
        if self.cp_group is not None:
            valid = torch.ones_like(packed.input_ids)  # a padding tail is a segment of its own
            raw = self._cp_values(packed.input_ids, valid, packed.position_ids, packed.segment_ids)
        else:
            raw = self.model(packed.input_ids, packed.attention_mask(impl), packed.position_ids)
        return packed.unpack(packed.shift_values(raw))

    def _empty_forward(self) -> torch.Tensor:
        """A forward on ``tp`` pad tokens for an empty micro-batch: keeps the FSDP2 and TP
        collectives of every rank in step. Returns its raw ``[1, tp]`` output."""
        tp = self.config.tp
        ids = torch.full((1, tp), self.pad_token_id, dtype=torch.long)
        return self._forward(ids, torch.ones(1, tp, dtype=torch.long))

    # ------------------------------------------------------------------ public
    @torch.no_grad()
    def get_values(
        self, batch: Mapping[str, torch.Tensor], micro_batch_size: int | None = None
    ) -> torch.Tensor:
        """Values ``V(s_t)`` of this rank's dp shard.

        Args:
            batch: ``input_ids`` ``[B, S]`` int64 and ``attention_mask`` ``[B, S]`` 0/1.
            micro_batch_size: sequences per forward (default ``config.micro_batch_size``);
                ignored with ``config.max_tokens_per_micro_batch`` (token-budget groups).

        Returns:
            ``[B, S]`` float32 CPU tensor in the order of ``batch``, right-shifted once per
            sequence (``out[:, 0] = 0``; packed: 0 at the first token of every sequence).
            Positions whose ``attention_mask`` is 0 hold meaningless values (0 where packing or
            trimming skipped them); mask them downstream.

        Raises:
            ValueError: on every rank when any rank has missing keys, a shape mismatch, an
                empty batch, token ids outside ``[0, vocab_size)``, a non-0/1 mask, with
                ``config.sequence_packing`` an ``attention_mask`` that is not right-padded (a
                hole or left padding), or a ``micro_batch_size`` that is not a positive int;
                a sequence longer than ``max_tokens_per_micro_batch`` on any dp rank. Sequences without any
                token are allowed (their values are 0 packed, meaningless padded).
        """
        _, micro = self._checked(batch, INFER_KEYS, micro_batch_size, "get_values")
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
        for group in self._micro_batches(batch, micro):
            if not group:
                self._empty_forward()
                continue
            idx = torch.tensor(group)
            ids, mask = batch["input_ids"][idx], batch["attention_mask"][idx]
            if self.config.sequence_packing:
                values = self._packed_values(ids, mask)
            else:
                values = right_shift_values(self._forward(ids, mask))
            out[idx] = values.float().cpu()
        return out

    def train(
        self, batch: Mapping[str, torch.Tensor], micro_batch_size: int | None = None
    ) -> dict[str, float]:
        """One optimiser step on this rank's dp shard with gradient accumulation.

        The loss of each micro-batch is normalised by the number of valid ``loss_mask`` tokens
        summed over all micro-batches and dp ranks, so the update equals a single-process step
        on the whole global batch whatever the micro-batch size and dp degree. FSDP2 averages
        gradients over dp, so the loss is scaled by the dp size to turn that mean into a sum.
        The gradient 2-norm over the whole mesh (one all-reduce over the flattened mesh) is
        clipped to ``config.max_grad_norm``; a non-finite norm skips the optimiser and
        scheduler step (logged, and reported as ``critic/skipped_step = 1``). With
        ``config.max_tokens_per_micro_batch`` sequences are grouped by length and every dp
        rank runs the same number of micro-batches (empty ones run a zero-weight dummy pass);
        with ``config.sequence_packing`` each micro-batch runs as packed rows. Neither changes
        the update: the normalisation by global valid tokens makes it grouping-independent.

        Returns:
            Global metrics (identical on every rank): ``critic/loss``, ``critic/clip_fraction``,
            ``critic/values_mean|min|max``, ``critic/returns_mean``, ``critic/explained_var``,
            ``critic/num_tokens``, ``critic/grad_norm``, ``critic/lr``, ``critic/skipped_step``,
            ``critic/step``.

        ``old_values`` and ``returns`` may hold anything (NaN, inf) where ``loss_mask`` is 0:
        those positions influence neither the update nor the metrics.

        Raises:
            ValueError: on every rank when any rank has missing keys, a shape mismatch, an
                empty batch, token ids outside ``[0, vocab_size)``, a non-0/1 mask, a
                ``loss_mask`` of 1 where ``attention_mask`` is 0, with
                ``config.sequence_packing`` an ``attention_mask`` that is not right-padded, a
                NaN/inf ``old_values`` or ``returns`` where ``loss_mask`` is 1 (key and position
                named), or a ``micro_batch_size`` that is not a positive int; an all-zero
                ``loss_mask`` over the global batch; a sequence longer than
                ``max_tokens_per_micro_batch`` on any dp rank. Nothing is changed then.
        """
        _, micro = self._checked(batch, TRAIN_KEYS, micro_batch_size, "train")
        groups = self._micro_batches(batch, micro)
        (global_tokens,) = self._dp_all_reduce([float(batch["loss_mask"].sum())], dist.ReduceOp.SUM)
        if global_tokens == 0:
            raise ValueError("loss_mask has no valid tokens in the whole batch")
        dp_size = self.config.dp
        stats = ValueStats()
        self.optimizer.zero_grad(set_to_none=True)
        for i, group in enumerate(groups):
            self.model.set_requires_gradient_sync(i == len(groups) - 1)
            if not group:  # padding micro-batch: same collectives, zero gradient
                (self._empty_forward().sum() * 0.0).backward()
                continue
            sl = torch.tensor(group)
            mask = batch["loss_mask"][sl].to(self.device)
            returns = batch["returns"][sl].to(self.device)
            old_values = batch["old_values"][sl].to(self.device)
            ids, attention = batch["input_ids"][sl], batch["attention_mask"][sl]
            if self.config.sequence_packing:
                # shifted per sequence inside the packed rows, so the inner (unshifted) loss
                out = self.loss_fn.inner(
                    self._packed_values(ids, attention),
                    old_values,
                    returns,
                    mask,
                    num_valid_tokens=global_tokens,
                )
            else:
                out = self.loss_fn(
                    self._forward(ids, attention),
                    old_values,
                    returns,
                    mask,
                    num_valid_tokens=global_tokens,
                )
            (out.loss * dp_size).backward()
            stats.update(values=out.values, returns=returns, mask=mask)
            stats.add_loss(out.loss_sum, out.clipped_tokens)
        # one all-reduce over the flattened (dp, tp) mesh, not one per mesh dimension
        grad_norm = clip_grad_norm_flat(self.model.parameters(), self.config.max_grad_norm)
        lr = float(self.scheduler.get_last_lr()[0])
        skipped = not math.isfinite(grad_norm)
        if skipped:
            log.warning(
                "non-finite gradient norm %s at step %d: skipping update", grad_norm, self.step
            )
        else:
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
        self.optimizer.zero_grad(set_to_none=True)
        stats.all_reduce(self.dp_group)
        metrics = stats.as_metrics()
        metrics.update(
            {
                "critic/grad_norm": grad_norm,
                "critic/lr": lr,
                "critic/skipped_step": float(skipped),
                "critic/step": float(self.step),
            }
        )
        return metrics

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Consolidated float CPU state dict (``ForTokenClassification`` keys); collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        return {k: v.detach().cpu().clone() for k, v in sd.items()}

    def save_checkpoint(self, path: str | Path) -> Path:
        """Atomically save model, optimizer, scheduler, step and RNG (DCP); collective.
        See :mod:`ppo_value.checkpoint`. Returns the checkpoint path.

        Raises:
            CheckpointError: on every rank when any rank failed a step (the previous
                checkpoint at ``path`` stays valid)."""
        meta = {
            "dp": self.config.dp,
            "tp": self.config.tp,
            "config": self.config.to_dict(),
            "model": ckpt.model_architecture(self.hf_config),
        }
        return ckpt.save_checkpoint(
            path,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            step=self.step,
            meta=meta,
        )

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Load a checkpoint saved at any ``(dp, tp)``; collective. Returns its metadata.

        Raises:
            FileNotFoundError: no complete checkpoint at ``path``.
            CheckpointError: a missing, unreadable, unsafe or invalid file, or a checkpoint of
                another model (architecture, parameter names or shapes); names the file and
                the problem. The worker is then unchanged.
        """
        meta = ckpt.load_checkpoint(
            path,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            architecture=ckpt.model_architecture(self.hf_config),
        )
        self.step = int(meta["step"])
        return meta

    def export_hf(self, path: str | Path) -> Path:
        """Write consolidated safetensors + config loadable by
        ``AutoModelForTokenClassification.from_pretrained``; collective."""
        return ckpt.export_hf(path, model=self.model, hf_config=self.hf_config)

    # --------------------------------------------------------------- lifecycle
    def prepare_for_training(self) -> None:
        """Called by the RL loop before :meth:`train` (gradients are enabled per call)."""
        log.debug("prepare_for_training")

    def prepare_for_inference(self) -> None:
        """Called before :meth:`get_values`: frees gradients left from training."""
        self.optimizer.zero_grad(set_to_none=True)

    def finish_training(self) -> None:
        """Called after a round of :meth:`train`: frees gradients."""
        self.optimizer.zero_grad(set_to_none=True)

    def finish_inference(self) -> None:
        """Called after a round of :meth:`get_values`; nothing to release on this backend."""
        log.debug("finish_inference")

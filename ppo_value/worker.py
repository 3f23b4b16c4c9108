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
from ppo_value import checkpoint as ckpt
from ppo_value._agree import agree
from ppo_value._batch import INFER_KEYS, TRAIN_KEYS, check_batch, check_micro_batch_size
from ppo_value.alignment import RightShiftLossWrapper, right_shift_values
from ppo_value.config import ValueConfig
from ppo_value.losses import ClippedValueLoss
from ppo_value.metrics import ValueStats
from ppo_value.model import ValueModel, build_value_model
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
        else:
            self.device = torch.device("cpu")
        self.mesh = build_mesh(config.dp, config.tp, self.device.type)
        self.dp_rank = self.mesh["dp"].get_local_rank()
        self.tp_rank = self.mesh["tp"].get_local_rank()
        self.dp_group = self.mesh["dp"].get_group()
        model = build_value_model(config).to(self.device)
        self.hf_config = model.config
        self.pad_token_id = int(model.config.pad_token_id or 0)
        self.vocab_size = int(model.config.vocab_size)
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
            sizes = (check_batch(batch, keys, self.vocab_size), size)
        except ValueError as exc:
            error = exc
        agree(error, what=what, exc_type=ValueError)
        return sizes

    def _check_dp_batch(self, batch_size: int, micro: int) -> None:
        n_micro = math.ceil(batch_size / micro)
        hi, neg_lo = self._dp_all_reduce([n_micro, -n_micro], dist.ReduceOp.MAX)
        if hi != -neg_lo:
            raise ValueError(
                "data-parallel ranks got different numbers of micro-batches "
                f"({int(-neg_lo)}..{int(hi)}); give every dp rank the same batch size"
            )

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Raw values ``[b, S]`` float32 for one micro-batch; pads for SP and trims."""
        ids, mask, seq = pad_for_sequence_parallel(
            input_ids.to(self.device),
            attention_mask.to(self.device),
            self.config.tp if self.config.sequence_parallel else 1,
            self.pad_token_id,
        )
        return self.model(ids, mask)[:, :seq]

    # ------------------------------------------------------------------ public
    @torch.no_grad()
    def get_values(
        self, batch: Mapping[str, torch.Tensor], micro_batch_size: int | None = None
    ) -> torch.Tensor:
        """Values ``V(s_t)`` of this rank's dp shard.

        Args:
            batch: ``input_ids`` ``[B, S]`` int64 and ``attention_mask`` ``[B, S]`` 0/1.
            micro_batch_size: sequences per forward (default ``config.micro_batch_size``).

        Returns:
            ``[B, S]`` float32 CPU tensor, right-shifted once (``out[:, 0] = 0``). Positions
            whose ``attention_mask`` is 0 hold meaningless values; mask them downstream.

        Raises:
            ValueError: on every rank when any rank has missing keys, a shape mismatch, an
                empty batch, token ids outside ``[0, vocab_size)``, a non-0/1 mask, or a
                ``micro_batch_size`` that is not a positive int; or dp ranks with different
                numbers of micro-batches.
        """
        batch_size, micro = self._checked(batch, INFER_KEYS, micro_batch_size, "get_values")
        self._check_dp_batch(batch_size, micro)
        out = []
        for start in range(0, batch_size, micro):
            sl = slice(start, start + micro)
            raw = self._forward(batch["input_ids"][sl], batch["attention_mask"][sl])
            out.append(right_shift_values(raw).float().cpu())
        return torch.cat(out)

    def train(
        self, batch: Mapping[str, torch.Tensor], micro_batch_size: int | None = None
    ) -> dict[str, float]:
        """One optimiser step on this rank's dp shard with gradient accumulation.

        The loss of each micro-batch is normalised by the number of valid ``loss_mask`` tokens
        summed over all micro-batches and dp ranks, so the update equals a single-process step
        on the whole global batch whatever the micro-batch size and dp degree. FSDP2 averages
        gradients over dp, so the loss is scaled by the dp size to turn that mean into a sum.
        The gradient 2-norm over the whole mesh is clipped to ``config.max_grad_norm``; a
        non-finite norm skips the optimiser and scheduler step (logged, and reported as
        ``critic/skipped_step = 1``).

        Returns:
            Global metrics (identical on every rank): ``critic/loss``, ``critic/clip_fraction``,
            ``critic/values_mean|min|max``, ``critic/returns_mean``, ``critic/explained_var``,
            ``critic/num_tokens``, ``critic/grad_norm``, ``critic/lr``, ``critic/skipped_step``,
            ``critic/step``.

        ``old_values`` and ``returns`` may hold anything (NaN, inf) where ``loss_mask`` is 0:
        those positions influence neither the update nor the metrics.

        Raises:
            ValueError: on every rank when any rank has missing keys, a shape mismatch, an
                empty batch, token ids outside ``[0, vocab_size)``, a non-0/1 mask, a NaN/inf
                ``old_values`` or ``returns`` where ``loss_mask`` is 1 (key and position
                named), or a ``micro_batch_size`` that is not a positive int; an all-zero
                ``loss_mask`` over the global batch; dp ranks with different numbers of
                micro-batches. Nothing is changed then.
        """
        batch_size, micro = self._checked(batch, TRAIN_KEYS, micro_batch_size, "train")
        self._check_dp_batch(batch_size, micro)
        (global_tokens,) = self._dp_all_reduce([float(batch["loss_mask"].sum())], dist.ReduceOp.SUM)
        if global_tokens == 0:
            raise ValueError("loss_mask has no valid tokens in the whole batch")
        dp_size = self.config.dp
        stats = ValueStats()
        starts = list(range(0, batch_size, micro))
        self.optimizer.zero_grad(set_to_none=True)
        for i, start in enumerate(starts):
            sl = slice(start, start + micro)
            self.model.set_requires_gradient_sync(i == len(starts) - 1)
            raw = self._forward(batch["input_ids"][sl], batch["attention_mask"][sl])
            mask = batch["loss_mask"][sl].to(self.device)
            returns = batch["returns"][sl].to(self.device)
            out = self.loss_fn(
                raw,
                batch["old_values"][sl].to(self.device),
                returns,
                mask,
                num_valid_tokens=global_tokens,
            )
            (out.loss * dp_size).backward()
            stats.update(values=out.values, returns=returns, mask=mask)
            stats.add_loss(out.loss_sum, out.clipped_tokens)
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=True)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
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

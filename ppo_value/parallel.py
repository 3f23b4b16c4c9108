"""Parallelism for :class:`~ppo_value.model.ValueModel`: a 2-D ``(dp, tp)`` device mesh, a
tensor + sequence parallel plan for the supported families, FSDP2 over ``dp``, and padding of
the sequence to a multiple of the TP degree.

Conventions (design notes §3):

- Sequence-parallel outputs stay DTensors (``use_local_output=False`` on the embedding,
  ``o_proj``, ``down_proj`` and the final norm), so the rotary embedding and the causal mask
  see the global sequence length.
- The scalar value head is replicated over TP (not ``ColwiseParallel``: one output feature
  would leave an empty shard and FSDP2's backward fails); only its ``[B, S, 1]`` output is
  redistributed (in :meth:`ValueModel.forward`).
- With ``tp > 1`` every parameter is a DTensor on the tp mesh before FSDP2 shards it over dp,
  so all parameters end up on the same 2-D mesh and ``clip_grad_norm_`` works across it.
- Sequence parallelism reduce-scatters along the sequence, which needs the length to be a
  multiple of the TP degree (otherwise gloo aborts on a size mismatch; issue 5 item 7).
  :func:`pad_for_sequence_parallel` pads on the right with masked tokens; causal attention
  means the real tokens' outputs are unchanged, and callers trim the padding off.

Only public APIs are used: ``init_device_mesh``, ``torch.distributed.tensor.parallel`` styles,
``distribute_module`` and ``torch.distributed.fsdp.fully_shard``.
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ppo_value.config import SUPPORTED_FAMILIES
from ppo_value.model import ValueModel

log = logging.getLogger(__name__)

# FSDP2 warns when a wrapped module returns a view (nn.Linear on [B, S, H] does); the warning is
# about in-place ops on such outputs, which this package never does.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

__all__ = [
    "apply_fsdp",
    "apply_tp_sp",
    "build_mesh",
    "pad_for_sequence_parallel",
    "parallelize_value_model",
]


def build_mesh(dp: int, tp: int, device_type: str = "cpu", *, cp: int = 1) -> DeviceMesh:
    """A 2-D mesh named ``("dp", "tp")`` over the default process group, or with ``cp > 1`` a
    3-D mesh ``("dp", "cp", "tp")``.

    Rank ``r`` sits at ``(r // tp, r % tp)`` (``(r // (cp * tp), r // tp % cp, r % tp)``):
    consecutive ranks form a TP group, then CP groups, then dp.

    Raises:
        ValueError: if the process group is not initialised or ``dp * cp * tp`` differs from
            its world size.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialised; call init_process_group first")
    world = dist.get_world_size()
    if dp * cp * tp != world:
        raise ValueError(
            f"dp * cp * tp = {dp} * {cp} * {tp} = {dp * cp * tp} does not match world size {world}"
        )
    if cp == 1:
        return init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))
    return init_device_mesh(device_type, (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))


def _check_tp_divisibility(model: ValueModel, tp: int) -> None:
    cfg = model.config
    if cfg.model_type not in SUPPORTED_FAMILIES:
        raise ValueError(f"no TP plan for model_type {cfg.model_type!r}; have {SUPPORTED_FAMILIES}")
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    for name, n in (
        ("num_attention_heads", cfg.num_attention_heads),
        ("num_key_value_heads", kv_heads),
        ("intermediate_size", cfg.intermediate_size),
    ):
        if n % tp:
            raise ValueError(f"tp={tp} must divide {name}={n}")


def _replicated_inputs(
    _module: torch.nn.Module, inputs: tuple[object, ...], mesh: DeviceMesh
) -> tuple[object, ...]:
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
        else x
        for x in inputs
    )


def _local_outputs(_module: torch.nn.Module, output: object, _mesh: DeviceMesh) -> object:
    return output.to_local() if isinstance(output, DTensor) else output


def apply_tp_sp(model: ValueModel, tp_mesh: DeviceMesh, *, sequence_parallel: bool = True) -> None:
    """Apply the TP plan, with or without sequence parallelism, in place (Qwen2 / Llama).

    q/k/v and gate/up column-wise, o_proj and down_proj row-wise, the value head replicated.
    With ``sequence_parallel`` the embedding and the row-wise layers reduce-scatter to
    sequence-sharded DTensor outputs, the RMSNorms run sequence parallel, and activations
    between blocks are ``Shard(1)`` DTensors ``[B, S, H]`` (``S`` must be a multiple of the TP
    degree). Without it the row-wise layers all-reduce to full plain ``[B, S, H]`` tensors on
    every TP rank and the RMSNorm weights are replicated over TP; any ``S`` works.

    Raises:
        ValueError: unsupported family or a head / intermediate size not divisible by tp.
    """
    _check_tp_divisibility(model, tp_mesh.size())
    backbone = model.model
    layer_plan: dict[str, ParallelStyle] = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
    }
    if sequence_parallel:
        parallelize_module(
            backbone,
            tp_mesh,
            {
                "embed_tokens": RowwiseParallel(
                    input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
                ),
                "norm": SequenceParallel(use_local_output=False),
            },
        )
        layer_plan.update(
            {
                "input_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()},
                ),
                "self_attn.o_proj": RowwiseParallel(
                    output_layouts=Shard(1), use_local_output=False
                ),
                "post_attention_layernorm": SequenceParallel(),
                "mlp": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            }
        )
    else:
        # Megatron-style TP: the residual stream is plain full tensors, each column-wise layer
        # all-reduces its input gradient and each row-wise layer its output. The RMSNorm
        # weights are replicated DTensors (one 2-D mesh for every parameter, design §3), so the
        # norms wrap their plain input as Replicate() and unwrap the output; the final norm
        # hands a DTensor to the replicated head.
        parallelize_module(
            backbone, tp_mesh, {"embed_tokens": RowwiseParallel(input_layouts=Replicate())}
        )
        layer_plan.update(
            {"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()}
        )
        distribute_module(backbone.norm, tp_mesh, input_fn=_replicated_inputs)
    for layer in backbone.layers:
        parallelize_module(layer, tp_mesh, layer_plan)
        if not sequence_parallel:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                distribute_module(
                    norm, tp_mesh, input_fn=_replicated_inputs, output_fn=_local_outputs
                )
    # Replicated head: params become Replicate DTensors; its input is the final norm's output.
    distribute_module(model.score, tp_mesh)


def apply_fsdp(model: ValueModel, dp_mesh: DeviceMesh, *, mixed_precision: bool) -> None:
    """FSDP2 ``fully_shard`` per decoder layer, on the head, and at the root, over ``dp_mesh``.

    With ``mixed_precision`` the backbone computes with bf16 parameters and reduces gradients
    in fp32; the head keeps fp32 parameters (its own ``fully_shard`` with an fp32 policy).
    """
    if mixed_precision:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        policy = MixedPrecisionPolicy()
    head_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model.score, mesh=dp_mesh, mp_policy=head_policy)
    # The root must reshard after forward too (FSDP2 keeps the root unsharded by default):
    # after a no-grad get_values the registered parameters would otherwise be the unsharded
    # ones, which are not the optimizer's, and state-dict / checkpoint calls fail.
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=True)


def parallelize_value_model(
    model: ValueModel,
    mesh: DeviceMesh,
    *,
    mixed_precision: bool = False,
    sequence_parallel: bool = True,
) -> ValueModel:
    """TP over ``mesh["tp"]`` when its size is > 1 (with sequence parallelism unless
    ``sequence_parallel=False``), then FSDP2 over ``mesh["dp"]``; on a mesh with a ``"cp"`` dim,
    HSDP over ``mesh["dp", "cp"]`` (parameters sharded over cp, replicated over dp: every cp
    rank computes gradients of the whole model from its part of the sequence).

    Returns the same (now sharded) module. ``tp == 1`` skips TP; ``dp == 1`` still wraps with
    FSDP2 (a no-op shard) so the code path is uniform.
    """
    if mesh["tp"].size() > 1:
        apply_tp_sp(model, mesh["tp"], sequence_parallel=sequence_parallel)
    names = mesh.mesh_dim_names or ()
    fsdp_mesh = mesh["dp", "cp"] if "cp" in names else mesh["dp"]
    apply_fsdp(model, fsdp_mesh, mixed_precision=mixed_precision)
    return model


def pad_for_sequence_parallel(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, multiple: int, pad_token_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Right-pad ``[B, S]`` ids and mask to a sequence length that is a multiple of ``multiple``.

    Padded positions get ``pad_token_id`` and mask 0. Under causal attention the outputs at the
    original positions do not depend on them; trim results with ``out[:, :S]``.

    Returns:
        ``(input_ids, attention_mask, S)``: padded ``[B, S']`` tensors and the original ``S``.

    Raises:
        ValueError: on mismatched shapes or ``multiple < 1``.
    """
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)} must be equal [B, S] shapes"
        )
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    seq = input_ids.shape[1]
    pad = (-seq) % multiple
    if pad == 0:
        return input_ids, attention_mask, seq
    ids = torch.nn.functional.pad(input_ids, (0, pad), value=pad_token_id)
    mask = torch.nn.functional.pad(attention_mask, (0, pad), value=0)
    return ids, mask, seq

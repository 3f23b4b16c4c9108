"""A plain tensor beside DTensors in an op: taken as ``Replicate()`` once the ranks are found to
hold the same values, or as the full value where the op says so (issue 18).

torch refuses every such call (``got mixed torch.Tensor and DTensor``) unless the plain tensor
has one element or the user wrapped the call in ``implicit_replication()``, which trusts it
blindly. What a plain tensor beside a DTensor means in a single-device program:

- **certain** (``copy_``, either direction): the plain side holds the full value. Into a DTensor
  each rank keeps its part of it (``p.copy_(full)``, ``p.data.copy_(full)``: a checkpoint
  load); into a plain tensor it gets the DTensor's full value (``plain.copy_(p)``: a weight
  sync to a rollout engine, an EMA or reference copy). No check.
- **conventionally the same on every rank** (an attention mask beside head-sharded scores,
  positions, rotary tables, an EMA kept whole on every rank): taken as ``Replicate()`` after a
  check that it is: every rank hashes its values on its device and the hashes are compared on
  a side gloo group with the call's fingerprint (:func:`~dtensor_patches.dispatch.
  scalar_reads.gather_if_same_call`). Values that differ are this rank's own data
  (data-parallel inputs beside an FSDP2 parameter): a :class:`~dtensor_patches.errors.
  MixedTensorError` names the op, both readings and the one line that says which is meant,
  on every rank alike, before anything is computed.

Where it runs: torch asks ``OpDispatcher._try_replicate_spec_for_scalar_tensor`` what a plain
argument means. On 2.9 (Python dispatch) it asks on every such call; from 2.10 the C++ dispatch
asks only while its implicit-replication flag is on, which the library keeps on
(:mod:`dtensor_patches._torch.implicit_replication`), and the dispatch hook never lets a
decision for such a call into the C++ cache (:mod:`dtensor_patches._torch.uncached`), so each
call is asked again. Calls without a plain tensor are untouched.

Cost, for these calls only: one pass over the plain tensor on its device (two int64 sums), a
host sync for the two numbers, one all-gather of three 8-byte numbers per rank on the side
group; a tensor checked once is not checked again until it is written (its version counter),
so a mask used by every layer is checked once per forward. From 2.10 such a call also runs
torch's propagation in Python (it is never cached).

Not reached (known gaps): threads that never called ``apply_all()`` or entered
``implicit_replication()`` (the C++ flag is per thread), and, from 2.10, a call whose signature
torch has already cached for a call with a ``Replicate()`` DTensor in the plain tensor's place
and that needs no redistribution of it: the C++ fast path then runs it without asking, as
under ``implicit_replication()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from dtensor_patches._torch.dtensors import version_of
from dtensor_patches._torch.implicit_replication import asked_for, user_asked
from dtensor_patches.dispatch import scalar_reads
from dtensor_patches.errors import MixedTensorError

__all__ = ["checked_reading", "readings_error", "same_on_every_rank", "value_code"]

_CERTAIN = frozenset({"aten.copy_.default"})
_CHUNK = 1 << 22  # elements hashed at a time (bounds the int64 temporaries)
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MULTIPLIER = 2654435761  # Knuth's multiplicative hash; position weights below 2**31

# tensor -> (version, ranks) of its last check that found every rank alike.
_ALIKE: WeakIdKeyDictionary = WeakIdKeyDictionary()


def value_code(tensor: torch.Tensor) -> tuple[int, int]:
    """Two 64-bit numbers of ``tensor``'s bytes (a plain sum and a position-weighted sum of its
    elements as integers), computed on its device; equal values give equal codes on every
    rank. Any dtype and shape (complex as pairs of reals, bool as bytes)."""
    flat = tensor.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    words = flat.contiguous().view(_INT_OF_SIZE[flat.element_size()])
    total = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, words.numel(), _CHUNK):
        chunk = words[start : start + _CHUNK].to(torch.int64)
        position = torch.arange(start, start + chunk.numel(), device=flat.device) % (1 << 31)
        weight = position * _MULTIPLIER % ((1 << 31) - 1) + 1
        total[0] += chunk.sum()
        total[1] += (chunk * weight).sum()
    first, second = total.tolist()
    return int(first), int(second)


def _version(tensor: torch.Tensor) -> int | None:
    try:
        return version_of(tensor)
    except RuntimeError:  # inference tensors keep no version counter
        return None


def _checkable(tensor: torch.Tensor) -> bool:
    """Real values to hash: not a tensor subclass (fake tensors while tracing), not meta, not
    under ``torch.compile``."""
    return (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and not tensor.is_meta
        and not torch.compiler.is_compiling()
    )


def readings_error(op: Any, tensor: torch.Tensor, mesh: Any, why: str) -> MixedTensorError:
    """The :class:`MixedTensorError` for the plain ``tensor`` passed to ``op`` beside DTensors
    on ``mesh``, saying ``why`` it is not taken as they are, with both readings and the one line
    that chooses each."""
    mesh_shape = "x".join(str(s) for s in getattr(mesh, "shape", ())) or "?"
    return MixedTensorError(
        f"{op}: a plain torch.Tensor of shape {list(tensor.shape)} is passed beside DTensors "
        f"(mesh {mesh_shape}), and {why}. Say which reading is meant:\n"
        "  - the same values on every rank (a causal mask beside sharded attention scores, a "
        "constant): make them the same, or wrap the call in "
        "`with torch.distributed.tensor.experimental.implicit_replication():` (it is taken "
        "as Replicate() unchecked);\n"
        "  - this rank's own data, with the DTensor's full value wanted (an FSDP2 parameter "
        "used outside its module, e.g. `hidden @ lm_head.weight.T`): wrap it in "
        "`with dtensor_patches.gathered_locally():` (the DTensors are gathered, "
        "differentiably, and the call runs on plain tensors);\n"
        "  - or make it a DTensor yourself: `DTensor.from_local(t, mesh, placements)`.",
        op=str(op),
        shape=tuple(tensor.shape),
    )


_ADVICE = (
    "A plain tensor beside DTensors is checked on every rank of the DTensors' mesh, so every "
    "rank must make the call (not only `if rank == 0:`). The ranks now disagree on which "
    "calls happened: stop the program."
)


def same_on_every_rank(op: Any, tensor: torch.Tensor, mesh: Any) -> None:
    """Check that the plain ``tensor`` passed to ``op`` beside DTensors on ``mesh`` holds the
    same values on every rank of ``mesh``. Collective over the mesh's ranks (on a side gloo
    group); a tensor found alike is not checked again until it is written.

    Raises:
        MixedTensorError: the values differ between ranks (on every rank alike), naming the
            op, both readings and the one-line fix.
        RankLocalCallError: another rank made another call, or none within
            ``DTENSOR_PATCHES_RANK_CHECK_TIMEOUT`` seconds.
    """
    ranks = scalar_reads.mesh_ranks(mesh)
    if len(ranks) < 2 or not dist.is_initialized():
        return
    version = _version(tensor)
    if version is not None and _ALIKE.get(tensor) == (version, ranks):
        return
    codes = value_code(tensor)
    parts = [str(op), str(tuple(tensor.shape)), str(tensor.dtype), str(mesh.mesh.tolist())]
    rows = scalar_reads.gather_if_same_call(
        ranks,
        parts,
        list(codes),
        what=f"{op} with a plain tensor beside DTensors",
        advice=_ADVICE,
    )
    if any(row != rows[0] for row in rows):
        raise readings_error(
            op,
            tensor,
            mesh,
            f"its values differ between the ranks {list(ranks)}: it is not the same on every "
            "rank, so it is not taken as Replicate()",
        )
    if version is not None:
        _ALIKE[tensor] = (version, ranks)


def checked_reading(original: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper of ``OpDispatcher._try_replicate_spec_for_scalar_tensor(op_call,
    tensor_arg, compute_mesh)`` (torch's ``original``): torch's ``Replicate()`` spec for a
    plain tensor whose reading is certain or checked (module doc); torch's answer for one
    element or inside ``implicit_replication()``; a :class:`MixedTensorError` naming both
    readings where neither holds or the values cannot be checked (fake tensors under
    ``torch.compile``, meta tensors)."""

    def plain_tensor_spec(self: Any, op_call: Any, tensor_arg: torch.Tensor, mesh: Any) -> Any:
        if tensor_arg.numel() == 1 or user_asked():
            return original(self, op_call, tensor_arg, mesh)
        if str(op_call) not in _CERTAIN:
            if not _checkable(tensor_arg):
                raise readings_error(op_call, tensor_arg, mesh, "its values cannot be checked here")
            same_on_every_rank(op_call, tensor_arg, mesh)
        with asked_for():
            return original(self, op_call, tensor_arg, mesh)

    return plain_tensor_spec

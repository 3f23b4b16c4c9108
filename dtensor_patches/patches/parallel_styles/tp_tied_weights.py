"""Tensor parallelism unties tied weights: the input embedding and the LM head train apart.

``parallelize_module`` replaces each parallelised module's parameters with new DTensor
parameters, one module at a time. A weight shared by two modules (``tie_word_embeddings=True``:
``lm_head.weight is embed_tokens.weight``, as Qwen2-0.5B/1.5B, Llama-3.2-1B/3B, Gemma ship)
becomes two parameters: the forward is unchanged at first, but the embedding's gradient lacks
the LM head's contribution (and the other way round), the optimizer steps two copies, and the
model drifts from the single-device one with no error. Measured on 2 ranks with
``RowwiseParallel`` embedding + ``ColwiseParallel`` head: the embedding gradient differs from
the single-device one on every release 2.9.1 to 2.15.0 (see the gate).

Fix: ``distribute_module`` (which every parallel style calls, looked up in
``torch.distributed.tensor.parallel.style``) is wrapped: a parameter that was already
distributed through another module gets that module's DTensor parameter back, so the tie
holds. When the two styles shard it differently (a ``ColwiseParallel`` embedding and a
``ColwiseParallel`` head shard different dims), one parameter cannot hold both: that raises
``ValueError`` naming the parameter instead of training two copies.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.dtensors import module_parameters
from dtensor_patches.patch import Patch, WrappedFunction
from dtensor_patches.reproducers import compare, failure_of, randn

OPS = ("aten.embedding.default",)  # the op whose weight is typically tied


def _retying(distribute: Callable[..., Any]) -> Callable[..., Any]:
    # id(original parameter) -> (weak reference to it, the DTensor parameter it became).
    # Keyed by id: a WeakKeyDictionary compares tensors with ``==`` (elementwise).
    done: dict[int, tuple[weakref.ref[torch.nn.Parameter], torch.nn.Parameter]] = {}

    def distribute_module(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        before = [
            (owner, name, param)
            for owner in module.modules()
            for name, param in module_parameters(owner).items()
            if param is not None
        ]
        out = distribute(module, *args, **kwargs)
        for owner, name, old in before:
            new = module_parameters(owner).get(name)
            if new is None or new is old:
                continue
            entry = done.get(id(old))
            if entry is None or entry[0]() is not old:
                done[id(old)] = (weakref.ref(old), new)
                continue
            first = entry[1]
            same = (
                first.device_mesh == new.device_mesh
                and tuple(first.placements) == tuple(new.placements)
                and first.shape == new.shape
            )
            if not same:
                raise ValueError(
                    f"{type(owner).__name__}.{name} is tied to a parameter that another parallel "
                    f"style already placed {tuple(first.placements)}; this one places it "
                    f"{tuple(new.placements)}. One parameter cannot hold both: use styles that "
                    "shard the tied weight alike (RowwiseParallel embedding with ColwiseParallel "
                    "head), or untie it in the model config"
                )
            module_parameters(owner)[name] = first
        return out

    distribute_module.__wrapped__ = distribute  # type: ignore[attr-defined]
    return distribute_module


def _registrations() -> list[WrappedFunction]:
    return [WrappedFunction("distribute_module", _retying)]


class _TiedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight
        with torch.no_grad():
            self.embed.weight.copy_(randn(8, 4))


def reproduce(mesh: object) -> str | None:
    """A tied embedding / LM head under RowwiseParallel / ColwiseParallel: the tie and the
    tied weight's gradient vs single-device."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    ids = torch.tensor([[1, 5, 2, 7, 0, 3]])
    plain = _TiedLM()
    torch.nn.functional.cross_entropy(plain.head(plain.embed(ids))[0], ids[0]).backward()
    model = _TiedLM()
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Replicate()),
    }

    def run() -> torch.Tensor:
        parallelize_module(model, mesh, plan)
        logits = model.head(model.embed(ids))
        torch.nn.functional.cross_entropy(logits[0], ids[0]).backward()
        return model.embed.weight.grad.full_tensor()

    grad, error = failure_of(run)
    if error is not None:
        return f"tied embedding under TP: {error}"
    if model.head.weight is not model.embed.weight:
        untied = "embed.weight and head.weight are two parameters after parallelize_module; "
    else:
        untied = ""
    problem = compare(grad, plain.embed.weight.grad, what="tied embedding weight grad")
    return None if problem is None else untied + problem


PATCH = Patch(
    name="tp_tied_weights",
    summary="parallelize_module keeps tied weights tied (input embedding / LM head)",
    ops=OPS,
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    reproduce=reproduce,
    overrides_existing=True,
    communication="none",
)

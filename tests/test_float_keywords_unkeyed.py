"""Optimizer steps whose float keywords change every step (``float_keywords_unkeyed``): AdamW
under an LR schedule and SGD's ``add_(grad, alpha=-lr)`` on a tensor-parallel model, against the
same optimizer on plain tensors, on a 2-rank gloo mesh; how often torch re-runs the sharding
strategy of those updates once every layout has been decided (2.10 to 2.12 stock: on every call); and a
decision that redistributes an operand, served to other values.
"""

from __future__ import annotations

from typing import Any

import torch

from dtensor_patches.testing import RankPool


def _steps(optimizer_name: str, steps: int = 5) -> dict[str, Any]:
    """A column-then-row TP pair of linear layers (``Shard(0)`` / ``Shard(1)`` weights, a
    replicated bias) trained ``steps`` steps with a warm-up LR schedule, beside the same model on
    plain tensors: the largest parameter difference, and the strategy runs of the update op
    from the third step on (the second makes SGD's first momentum updates)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from dtensor_patches._torch.tables import counting_strategy_calls
    from dtensor_patches.testing import world_mesh

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 6))
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 6))
    model.load_state_dict(plain.state_dict())
    parallelize_module(model, world_mesh(), {"0": ColwiseParallel(), "2": RowwiseParallel()})

    def optimizer(params: Any) -> torch.optim.Optimizer:
        if optimizer_name == "adamw":
            return torch.optim.AdamW(params, lr=1e-2, foreach=False)
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=False)

    pairs = []
    for m in (plain, model):
        opt = optimizer(m.parameters())
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: (step + 1) / steps)
        pairs.append((m, opt, schedule))
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    update = (
        torch.ops.aten.addcdiv_.default if optimizer_name == "adamw" else torch.ops.aten.add_.Tensor
    )
    runs = 0
    for step in range(steps):
        for m, opt, schedule in pairs:
            loss = m(x).pow(2).sum()
            loss.backward()
            if step >= 2 and m is model:
                with counting_strategy_calls(update) as calls:
                    opt.step()
                runs += len(calls)
            else:
                opt.step()
            opt.zero_grad()
            schedule.step()
    diff = max(
        float((p.full_tensor() - q).abs().max())
        for p, q in zip(model.parameters(), plain.parameters(), strict=True)
    )
    return {"diff": diff, "runs": runs}


def _optimizers() -> dict[str, Any]:
    import dtensor_patches

    dtensor_patches.revert_all()
    try:
        stock = {name: _steps(name) for name in ("adamw", "sgd")}
        dtensor_patches.apply_all()
        patched = {name: _steps(name) for name in ("adamw", "sgd")}
    finally:
        dtensor_patches.revert_all()
    applies = dtensor_patches.get("float_keywords_unkeyed").applies_to()
    return {"stock": stock, "patched": patched, "applies": applies}


def test_optimizer_steps_reuse_their_decisions(pool2: RankPool) -> None:
    for result in pool2.run(_optimizers):
        for name, r in result["patched"].items():
            assert r["diff"] < 1e-5, (name, r)
            assert r["runs"] == 0, (name, r)  # every later step: torch's cached decision
        for name, r in result["stock"].items():
            assert r["diff"] < 1e-5, (name, r)
            # The bug the gate is for: stock re-runs the strategy where the patch applies.
            assert (r["runs"] > 0) == result["applies"], (name, r, result["applies"])


def _other_values_through_a_redistribution() -> list[bool]:
    """``p.addcdiv_(a, b, value=v)`` with ``p`` ``Shard(0)``, ``a`` ``Replicate()`` (torch's
    decision redistributes it) and ``b`` ``Shard(1)``, and ``p.add_(q, alpha=v)`` with ``q``
    replicated, for several ``v``, after ``apply_all()``: each against plain tensors."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import dtensor_patches
    from dtensor_patches.testing import world_mesh

    mesh = world_mesh()
    g = torch.Generator().manual_seed(2)
    full_p, full_a, full_q = (torch.randn(4, 6, generator=g) for _ in range(3))
    full_b = torch.rand(4, 6, generator=g) + 1
    dtensor_patches.revert_all()
    dtensor_patches.apply_all()
    try:
        p = distribute_tensor(full_p.clone(), mesh, [Shard(0)])
        a = distribute_tensor(full_a, mesh, [Replicate()])
        b = distribute_tensor(full_b, mesh, [Shard(1)])
        q = distribute_tensor(full_q, mesh, [Replicate()])
        out = []
        for v in (-0.5, 0.25, 2.0, -3.0):
            p.addcdiv_(a, b, value=v)
            full_p.addcdiv_(full_a, full_b, value=v)
            out.append(torch.allclose(p.full_tensor(), full_p, atol=1e-6))
            p.add_(q, alpha=v)
            full_p.add_(full_q, alpha=v)
            out.append(torch.allclose(p.full_tensor(), full_p, atol=1e-6))
        out.append(p.placements == (Shard(0),))
    finally:
        dtensor_patches.revert_all()
    return out


def test_a_redistributing_decision_serves_other_values(pool2: RankPool) -> None:
    for result in pool2.run(_other_values_through_a_redistribution):
        assert all(result), result

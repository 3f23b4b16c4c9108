"""torch's own parallel styles and ``local_map`` on sequence lengths the TP degree does not
divide (issue 18): a torchtitan-style TP + SP model (``RowwiseParallel`` embedding to
``Shard(1)``, ``SequenceParallel`` norms, ``ColwiseParallel(input_layouts=Shard(1))`` /
``RowwiseParallel(output_layouts=Shard(1))`` with local outputs and residual adds between them,
a ``PrepareModuleInputOutput`` sub-module), the user's own local shards fed to a
``SequenceParallel`` block, and a ``local_map`` function on an odd-length sequence. Values and
gradients are compared with the single device over steps of varying lengths (odd, even,
shorter than the mesh), on 2 ranks, 4 ranks and the tp dim of a 2x2 mesh; stock torch gives
wrong values or aborts the process in gloo there."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dtensor_patches.testing import RankPool

V, H = 16, 8


class _Mix(torch.nn.Module):
    """A whole-sequence op (a running mean over positions) between two local shards."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype)[None, :, None]
        return self.proj(x.cumsum(1) / steps)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(H)
        self.up = torch.nn.Linear(H, 4 * H)
        self.down = torch.nn.Linear(4 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(V, H)
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])
        self.mix = _Mix()
        self.norm = torch.nn.LayerNorm(H)
        self.head = torch.nn.Linear(H, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        x = x + self.mix(x)
        return self.head(self.norm(x))


def _plan(blocks: bool = True) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, Any] = {
        "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "mix": PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
            use_local_output=True,
        ),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(2):
        plan[f"blocks.{i}.norm"] = SequenceParallel()
        plan[f"blocks.{i}.up"] = ColwiseParallel(input_layouts=Shard(1))
        plan[f"blocks.{i}.down"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def _ids(length: int) -> torch.Tensor:
    return (torch.arange(2 * length).reshape(2, length) * 5 + 3) % V


def _reference(lengths: list[int], grad: bool) -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = _Model()
    return [_step(model, _ids(n), grad) for n in lengths]


def _step(model: torch.nn.Module, ids: torch.Tensor, grad: bool) -> dict[str, torch.Tensor]:
    def full(t: Any) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    with torch.set_grad_enabled(grad):
        logits = full(model(ids))
    out = {"logits": logits.detach()}
    if grad:
        logits.square().mean().backward()
        for name in ("emb.weight", "blocks.0.up.weight", "mix.proj.weight", "head.weight"):
            param = model.get_parameter(name)
            out[name] = full(param.grad).clone()
            param.grad = None
    return out


def _tp_model(tp_mesh: Any, problems: list[str]) -> torch.nn.Module:
    """The model under the TP + SP plan; every module's DTensor output is checked for the
    ranks' agreement on its global spec (``spec_disagreement``, collective), into
    ``problems``."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from dtensor_patches.testing import spec_disagreement

    def check(module: torch.nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, DTensor):
            problem = spec_disagreement(output)
            if problem is not None:
                problems.append(f"{type(module).__name__}: {problem}")

    torch.manual_seed(0)
    model = parallelize_module(_Model(), tp_mesh, _plan())
    for module in model.modules():
        module.register_forward_hook(check)
    return model


def _model_case(mesh_shape: tuple[int, ...], lengths: list[int], grad: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    import dtensor_patches
    from dtensor_patches.patches.edges import from_local_uneven

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp")[-len(mesh_shape) :])
    exchanges: list[int] = []
    exchange = from_local_uneven.global_shape_and_stride

    def counted(*args: Any) -> Any:
        exchanges[-1] += 1
        return exchange(*args)

    problems: list[str] = []
    with dtensor_patches.patched():
        model = _tp_model(mesh["tp"], problems)
        from_local_uneven.global_shape_and_stride = counted
        try:
            steps = []
            for n in lengths:
                exchanges.append(0)
                steps.append(_step(model, _ids(n), grad))
        finally:
            from_local_uneven.global_shape_and_stride = exchange
    return {"steps": steps, "exchanges": exchanges, "problems": problems}


def _check(rows: list[dict[str, Any]], lengths: list[int], grad: bool) -> None:
    expected = _reference(lengths, grad)
    for row in rows:
        assert row["problems"] == [], row["problems"]
        for n, got, want in zip(lengths, row["steps"], expected, strict=True):
            for key in want:
                torch.testing.assert_close(got[key], want[key], msg=f"length {n}: {key}")


@pytest.mark.parametrize("grad", [True, False], ids=["train", "no_grad"])
def test_sequence_parallel_model_on_odd_lengths(pool2: RankPool, grad: bool) -> None:
    lengths = [6, 5, 7, 4, 5]
    rows = pool2.run(_model_case, (2,), lengths, grad)
    _check(rows, lengths, grad)
    for row in rows:
        # While autograd records, every boundary's input carries its global shape (tags follow
        # the residual stream): nothing is exchanged. Under no_grad the residual sums are
        # untagged: once a length was odd, those boundaries exchange.
        if grad:
            assert row["exchanges"] == [0] * len(lengths), row["exchanges"]
        else:
            assert max(row["exchanges"]) <= 5, row["exchanges"]  # at most each boundary


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["tp4", "dp2xtp2"])
def test_sequence_parallel_model_on_four_ranks(
    pool4: RankPool, mesh_shape: tuple[int, ...]
) -> None:
    lengths = [8, 5, 3, 7] if mesh_shape == (4,) else [6, 5, 1]  # 3 over 4 ranks: one is empty
    _check(pool4.run(_model_case, mesh_shape, lengths, True), lengths, True)


def _even_program_case() -> list[int]:
    """Lengths all divisible by the TP degree: every boundary's input carries its global shape
    from the embedding's output on, so nothing is exchanged (torch's own reading is right)."""
    return _model_case((2,), [6, 4, 8], True)["exchanges"]


def test_even_lengths_exchange_nothing(pool2: RankPool) -> None:
    for exchanges in pool2.run(_even_program_case):
        assert exchanges == [0, 0, 0], exchanges


def _user_fed_case(lengths: list[int]) -> list[Any]:
    """The user's own local shards of hidden states (``torch.chunk`` of each sequence) fed to a
    ``SequenceParallel`` block; the block's output gathered and its input gradient."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import dtensor_patches

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = {k.removeprefix("blocks.0."): v for k, v in _plan().items() if k.startswith("blocks.0")}
    out = []
    with dtensor_patches.patched():
        torch.manual_seed(1)
        block = parallelize_module(_Block(), mesh, plan)
        for n in lengths:
            full = torch.linspace(-1, 1, 2 * n * H).reshape(2, n, H)
            parts = torch.chunk(full, dist.get_world_size(), 1)
            rank = dist.get_rank()
            local = (parts[rank] if rank < len(parts) else full[:, :0]).clone().requires_grad_()
            y = block(local)
            y.square().sum().backward()
            out.append((y.detach(), local.grad))
    return out


def test_user_fed_local_shards_into_sequence_parallel(pool2: RankPool) -> None:
    lengths = [6, 5, 7, 4]
    torch.manual_seed(1)
    ref = _Block()
    expected = []
    for n in lengths:
        full = torch.linspace(-1, 1, 2 * n * H).reshape(2, n, H).requires_grad_()
        y = ref(full)
        y.square().sum().backward()
        expected.append((y.detach(), full.grad))
    rows = pool2.run(_user_fed_case, lengths)
    for rank, row in enumerate(rows):
        for (y, g), (want_y, want_g), n in zip(row, expected, lengths, strict=True):
            part = torch.chunk(torch.arange(n), 2)[rank]
            torch.testing.assert_close(y, want_y[:, part], msg=f"length {n}")
            # summed over the sequence in another order: float32 rounding of gradients ~50
            torch.testing.assert_close(g, want_g[:, part], rtol=1e-5, atol=1e-4)


def _local_map_case(length: int) -> dict[str, Any]:
    """A per-rank function (token log-probs of each rank's positions) run with ``local_map``
    on a sequence-sharded DTensor of odd length, its ``Shard(1)`` output re-wrapped."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.experimental import local_map

    import dtensor_patches
    from dtensor_patches.testing import spec_disagreement

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    logits = torch.linspace(-2, 2, 2 * length * V).reshape(2, length, V)
    with dtensor_patches.patched():
        token_logp = local_map(
            lambda x: x.log_softmax(-1).amax(-1),
            out_placements=[Shard(1)],
            in_placements=([Shard(1)],),
            device_mesh=mesh,
        )
        got = token_logp(distribute_tensor(logits, mesh, [Shard(1)]))
        return {"spec": spec_disagreement(got), "full": got.full_tensor()}


@pytest.mark.parametrize("length", [5, 6])
def test_local_map_output_of_odd_length(pool2: RankPool, length: int) -> None:
    logits = torch.linspace(-2, 2, 2 * length * V).reshape(2, length, V)
    for row in pool2.run(_local_map_case, length):
        assert row["spec"] is None, row["spec"]
        torch.testing.assert_close(row["full"], logits.log_softmax(-1).amax(-1))


def _uneven_features_case() -> dict[str, Any]:
    """A ``ColwiseParallel`` linear of 5 output features feeding a ``RowwiseParallel`` one on
    2 ranks (local widths 3 and 2): torch took the rowwise input to be 6 wide and failed in
    ``mm``; its width is the linear's ``in_features``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import dtensor_patches

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    with dtensor_patches.patched():
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        y = model(_features())
        y.square().sum().backward()
        return {
            "y": y.detach(),
            "grads": [p.grad.full_tensor() for p in model.parameters()],
        }


def _features() -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(1))


def test_rowwise_after_colwise_of_uneven_width(pool2: RankPool) -> None:
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    y = ref(_features())
    y.square().sum().backward()
    for row in pool2.run(_uneven_features_case):
        torch.testing.assert_close(row["y"], y.detach())
        for got, param in zip(row["grads"], ref.parameters(), strict=True):
            torch.testing.assert_close(got, param.grad)

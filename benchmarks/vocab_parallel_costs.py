"""Token log-probs, per-token cross entropy and entropy of TP vocab-sharded logits: plain PyTorch
on DTensors after ``apply_all()``, the same code on stock torch, and a hand-written
vocab-parallel version on local tensors (the kind RL stacks carry), side by side in one run.

On 2 CPU gloo ranks (``torchrun --nproc-per-node 2 benchmarks/vocab_parallel_costs.py``):
``Shard(-1)`` float32 logits ``[batch, seq, vocab]`` (default ``[2, 256, 8192]``), forward and
backward of each computation, blocks of 5 steps after 2 warm-up steps, the three versions in a
random interleaved order, 7 blocks each; the median per step of wall time and process CPU time,
and the bytes each rank receives per step (``CommBytes``) against the lower bound: the
``[batch, seq]`` all-reduces the hand-written version issues. Every version's values and
logit gradients are checked against the hand-written one before timing.

    torchrun --nproc-per-node 2 benchmarks/vocab_parallel_costs.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def _shifted_exp(local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The shard's logits minus the global max, their exponentials, and the global sum of
    those: two ``[batch, seq]`` all-reduces."""
    peak = local.amax(-1)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    shifted = local - peak.unsqueeze(-1)
    exp = shifted.exp()
    total = exp.sum(-1)
    dist.all_reduce(total)
    return shifted, exp, total


class _HandLogprobs(torch.autograd.Function):
    """Hand-written vocab-parallel token log-probs on this rank's vocab shard: three
    ``[batch, seq]`` all-reduces forward (max, sum of exponentials, picked logit), none
    backward."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, ids: torch.Tensor, offset: int) -> torch.Tensor:
        shifted, exp, total = _shifted_exp(local)
        local_ids = ids - offset
        inside = (local_ids >= 0) & (local_ids < local.shape[-1])
        picked = shifted.gather(-1, local_ids.clamp(0, local.shape[-1] - 1).unsqueeze(-1))
        picked = picked.squeeze(-1).masked_fill(~inside, 0)
        dist.all_reduce(picked)
        ctx.save_for_backward(exp, total, local_ids, inside)
        return picked - total.log()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        exp, total, local_ids, inside = ctx.saved_tensors
        out = -(exp / total.unsqueeze(-1)) * grad.unsqueeze(-1)
        onehot = torch.zeros_like(out).scatter_(
            -1,
            local_ids.clamp(0, out.shape[-1] - 1).unsqueeze(-1),
            inside.unsqueeze(-1).to(out.dtype),
        )
        return out + onehot * grad.unsqueeze(-1), None, None


class _HandEntropy(torch.autograd.Function):
    """Hand-written vocab-parallel entropy: three ``[batch, seq]`` all-reduces forward (max,
    sum of exponentials, sum of ``p * x``), one backward."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor) -> torch.Tensor:
        shifted, exp, total = _shifted_exp(local)
        p = exp / total.unsqueeze(-1)
        weighted = (p * shifted).sum(-1)
        dist.all_reduce(weighted)
        ctx.save_for_backward(p, shifted, total, weighted)
        return total.log() - weighted

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        p, shifted, total, weighted = ctx.saved_tensors
        logp = shifted - total.log().unsqueeze(-1)
        h = total.log() - weighted  # the entropy, -sum(p * logp)
        # dH/dx = -p * (logp + H)
        return -p * (logp + h.unsqueeze(-1)) * grad.unsqueeze(-1)


def _plain(name: str) -> Callable[[Any, Any], Any]:
    import torch.nn.functional as F

    if name == "logprobs_gather":
        return lambda x, ids: torch.gather(x.log_softmax(-1), -1, ids.unsqueeze(-1)).squeeze(-1)
    if name == "logprobs_logsumexp":
        return lambda x, ids: x.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - x.logsumexp(-1)
    if name == "cross_entropy_none":
        return lambda x, ids: F.cross_entropy(
            x.flatten(0, 1), ids.flatten(), reduction="none"
        ).view(ids.shape)
    if name == "entropy":

        def entropy(x: Any, ids: Any) -> Any:
            logp = x.log_softmax(-1)
            return -(logp.exp() * logp).sum(-1)

        return entropy
    raise ValueError(name)


def _hand(name: str, offset: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if name in ("logprobs_gather", "logprobs_logsumexp"):
        return lambda x, ids: _HandLogprobs.apply(x, ids, offset)
    if name == "cross_entropy_none":
        return lambda x, ids: -_HandLogprobs.apply(x, ids, offset)
    return lambda x, ids: _HandEntropy.apply(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the table here")
    parser.add_argument("--shape", type=int, nargs=3, default=(2, 256, 8192))
    parser.add_argument("--blocks", type=int, default=7)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    import dtensor_patches
    from dtensor_patches.comm_bytes import CommBytes

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    batch, seq, vocab = args.shape
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, seq, vocab, generator=gen)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    weights = torch.linspace(0.5, 1.5, batch * seq).reshape(batch, seq)
    dist_logits = distribute_tensor(logits, mesh, [Shard(2)])
    dist_ids = distribute_tensor(ids, mesh, [Replicate()])
    dist_weights = distribute_tensor(weights, mesh, [Replicate()])
    local = dist_logits.to_local()
    offset = dist.get_rank() * -(-vocab // dist.get_world_size())

    def step(version: str, name: str) -> tuple[torch.Tensor, torch.Tensor, CommBytes]:
        with CommBytes() as comm:
            if version == "hand":
                x = local.detach().requires_grad_()
                y = _hand(name, offset)(x, ids)
                (y * weights).sum().backward()
                grad = x.grad
            else:
                x = dist_logits.detach().requires_grad_()
                y = _plain(name)(x, dist_ids)
                (y * dist_weights).sum().backward()
                grad = x.grad
        if isinstance(grad, DTensor):
            # Stock torch leaves the gradient replicated; compare this rank's shard of it.
            grad = grad.redistribute(mesh, [Shard(2)]).to_local()
        value = y.full_tensor() if isinstance(y, DTensor) else y
        return value.detach(), grad, comm

    def switch(version: str) -> None:
        dtensor_patches.apply_all() if version == "apply_all" else dtensor_patches.revert_all()

    table: dict[str, Any] = {"torch": torch.__version__, "shape": [batch, seq, vocab], "rows": {}}
    names = ["logprobs_gather", "logprobs_logsumexp", "cross_entropy_none", "entropy"]
    versions = ["hand", "apply_all", "stock"]
    for name in names:
        checks: dict[str, Any] = {}
        raised: dict[str, str] = {}
        for version in versions:
            switch(version)
            try:
                value, grad, comm = step(version, name)
            except Exception as exc:  # noqa: BLE001 - stock torch may refuse; the table says so
                raised[version] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                continue
            checks[version] = (value, grad, comm.received, dict(comm.calls))
        reference = checks["hand"]
        running = [v for v in versions if v in checks]
        for version in running:
            torch.testing.assert_close(checks[version][0], reference[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(checks[version][1], reference[1], rtol=1e-4, atol=1e-5)
        times: dict[str, list[tuple[float, float]]] = {v: [] for v in running}
        order = running * args.blocks
        random.Random(len(name)).shuffle(order)
        for version in order:
            switch(version)
            for _ in range(2):
                step(version, name)
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(5):
                step(version, name)
            times[version].append(
                ((time.perf_counter() - wall) / 5 * 1e3, (time.process_time() - cpu) / 5 * 1e3)
            )
        lower_bound = reference[2]
        table["rows"][name] = {
            version: {
                "wall_ms": round(statistics.median(t[0] for t in times[version]), 3),
                "cpu_ms": round(statistics.median(t[1] for t in times[version]), 3),
                "bytes_per_rank": checks[version][2],
                "bytes_vs_hand": round(checks[version][2] / lower_bound, 2),
                "collectives": checks[version][3],
            }
            for version in running
        }
        for version, error in raised.items():
            table["rows"][name][version] = {"raises": error}
    dtensor_patches.revert_all()
    if dist.get_rank() == 0:
        print(json.dumps(table, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(table, f, indent=1)
    # gloo can abort a rank (SIGABRT, "terminate called without an active exception") when
    # one rank tears its process group down while another is still finishing: wait for all.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Find the DTensor op that is silently wrong in a training step: ``dtensor_patches.verify()``.

A tiny tensor-parallel policy head (vocab-sharded logits) with a PPO-style loss: cross entropy
plus an entropy bonus inside ``loss_parallel()``, and the loss logged with ``.item()``. Run on
a 2-rank CPU gloo mesh::

    python examples/verify_training_step.py             # apply_all(): verify() is clean
    python examples/verify_training_step.py --unfixed   # without the two patches: verify()
                                                        # names both wrong ops and their lines
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

UNFIXED = ("partial_item", "loss_parallel_backward")


def step(unfixed: bool) -> str:
    """One training step under ``verify()`` on this rank; returns the report as text."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

    import dtensor_patches

    dtensor_patches.apply_all(exclude=UNFIXED if unfixed else ())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 16)
    parallelize_module(head, mesh, ColwiseParallel(output_layouts=Shard(1), use_local_output=False))
    hidden, actions = torch.randn(6, 8), torch.randint(0, 16, (6,))
    with dtensor_patches.verify(raise_on_mismatch=False) as report:
        logits = head(hidden)
        with loss_parallel():
            logp = torch.log_softmax(logits, -1)
            entropy = -(logp.exp() * logp).sum(-1).mean()
            loss = F.nll_loss(logp, actions) - 0.01 * entropy
            loss.backward()
        per_token = (logits.detach() ** 2).sum()  # Partial(sum) over the sharded vocab
        print(f"rank {dist.get_rank()}: logged penalty {per_token.item():.4f}")
    return str(report)


def main() -> None:
    from dtensor_patches.testing import run_on_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unfixed", action="store_true", help=f"exclude {', '.join(UNFIXED)}")
    args = parser.parse_args()
    print(run_on_ranks(step, 2, args.unfixed)[0])


if __name__ == "__main__":
    main()

"""The README's first example: a DTensor op that fails on stock torch and works after
``dtensor_patches.apply_all()``.

``torch.searchsorted`` (here: which packed document each token position belongs to) has no
DTensor sharding strategy on any torch release from 2.9 to 2.15. Run on two CPU ranks::

    torchrun --nproc-per-node 2 examples/quickstart.py

(``python examples/quickstart.py`` runs it on one rank.) Rank 0 prints what happened; the
script exits 1 if the patched result differs from the same call on plain tensors.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import dtensor_patches


def main() -> int:
    """Run the example; returns the exit status (0: the patched result is right)."""
    if "RANK" not in os.environ:  # plain `python examples/quickstart.py`: one rank
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29511", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    say = print if dist.get_rank() == 0 else (lambda *_: None)

    # Four documents packed into one stream start at these positions; which one does each
    # token position of a [batch, seq] block belong to? (RL stacks pack rollouts like this.)
    doc_starts = torch.tensor([0, 5, 9, 14])
    positions = torch.arange(16).reshape(4, 4)
    pos = distribute_tensor(positions, mesh, [Shard(0)])  # batch-sharded
    starts = distribute_tensor(doc_starts, mesh, [Replicate()])

    def doc_of(p: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(s, p, right=True) - 1

    try:
        doc_of(pos, starts)
    except NotImplementedError as exc:
        say(f"stock torch {torch.__version__}: {str(exc).splitlines()[0]}")

    report = dtensor_patches.apply_all()
    say(
        f"apply_all(): {len(report.applied)} of {len(report)} patches applied, "
        f"isin_searchsorted: {report['isin_searchsorted'].status.value}"
    )
    doc = doc_of(pos, starts)
    same = torch.equal(doc.full_tensor(), doc_of(positions, doc_starts))
    say(f"patched: placements {doc.placements}, equal to plain tensors: {same}")
    say(doc.full_tensor().tolist())
    # gloo can abort a rank (SIGABRT, "terminate called without an active exception") when
    # one rank tears its process group down while another is still finishing: wait for all.
    dist.barrier()
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    status = main()
    # torch's own teardown at interpreter exit can abort a gloo rank after all the work is
    # done ("terminate called without an active exception", SIGABRT: about 1 run in 10 on
    # torch 2.11.0, even after a barrier and destroy_process_group()). Nothing is left to
    # clean up but the standard streams, so leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

"""Record which patches the critic's own path needs: ``ppo_value.patch_needs.CRITIC_PATCHES``.

    python -m tools.critic_patch_needs            # print the recorded set and the ops behind it
    python -m tools.critic_patch_needs --check    # exit 1 if CRITIC_PATCHES differs from it

On a 4-rank CPU gloo pool, a ``TorchDispatchMode`` records every aten op that receives a
DTensor while a :class:`~ppo_value.worker.ValueWorker` runs ``get_values``, two ``train`` steps
(AdamW with clipping), ``save_checkpoint``, ``load_checkpoint`` and ``full_state_dict`` on each
layout in :data:`LAYOUTS` (TP + SP, TP without SP, dp only, mixed precision, packing,
activation checkpointing, token budgets, context parallelism with and without TP). A patch is
needed when its ``ops`` include a recorded op (whatever its gate: the set is the same on every
release). ``tests/ppo_value/test_patch_needs.py`` runs the check in CI.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import Any

LAYOUTS: tuple[dict[str, Any], ...] = (
    {"dp": 2, "tp": 2},
    {"dp": 2, "tp": 2, "sequence_parallel": False},
    {"dp": 4},
    {"dp": 2, "tp": 2, "mixed_precision": True},
    {"dp": 2, "tp": 2, "sequence_packing": True},
    {"dp": 2, "tp": 2, "activation_checkpointing": True, "max_tokens_per_micro_batch": 24},
    {"dp": 1, "cp": 2, "tp": 2, "sequence_packing": True},
    {"dp": 2, "cp": 2},
)
"""The worker layouts recorded (4 ranks each)."""


def _record_on_rank(layouts: tuple[dict[str, Any], ...], directory: str) -> list[str]:
    """Run the worker on every layout under a recording mode; the sorted DTensor ops."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from ppo_value.config import ValueConfig
    from ppo_value.worker import ValueWorker
    from tests.ppo_value.batches import make_batch

    seen: set[str] = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            kwargs = kwargs or {}
            if any(isinstance(x, DTensor) for x in tree_leaves((args, kwargs))):
                seen.add(str(func))
            return func(*args, **kwargs)

    torch.set_num_threads(1)
    for i, layout in enumerate(layouts):
        worker = ValueWorker(ValueConfig(lr=1e-3, **layout))
        batch = make_batch(4, 9, seed=i)
        path = f"{directory}/layout-{i}"
        with Record():
            values = worker.get_values(batch)
            batch["old_values"] = values
            worker.train(batch, micro_batch_size=2)
            worker.train(batch, micro_batch_size=2)
            worker.save_checkpoint(path)
            worker.load_checkpoint(path)
            worker.full_state_dict()
    return sorted(seen)


def record(layouts: tuple[dict[str, Any], ...] = LAYOUTS) -> tuple[set[str], set[str]]:
    """``(needed patch names, recorded DTensor ops)`` over ``layouts`` on 4 CPU ranks."""
    import dtensor_patches
    from dtensor_patches.testing import RankPool

    with (
        tempfile.TemporaryDirectory() as directory,
        RankPool(4, timeout=900, env={"OMP_NUM_THREADS": "1"}) as pool,
    ):
        ops = set(pool.run(_record_on_rank, layouts, directory)[0])
    needed = {p.name for p in dtensor_patches.all_patches() if ops & set(p.ops)}
    return needed, ops


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if CRITIC_PATCHES differs")
    args = parser.parse_args(argv)
    from ppo_value.patch_needs import CRITIC_PATCHES

    needed, ops = record()
    print("recorded DTensor ops:", ", ".join(sorted(ops)))
    print("needed patches:", ", ".join(sorted(needed)))
    if args.check and needed != CRITIC_PATCHES:
        print(
            f"CRITIC_PATCHES is stale: missing {sorted(needed - CRITIC_PATCHES)}, "
            f"not needed {sorted(CRITIC_PATCHES - needed)}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The value worker as a Ray actor, and a group of them forming one process group.

:class:`ValueWorkerGroup` starts ``dp * cp * tp`` actors on a Ray cluster (a local one started with
``ray.init()`` unless an address is given), sets up the torch process group among them (gloo
on CPU, nccl on GPU; rank 0's node address and a free port found there), splits a batch along
dp (every CP and TP rank of a dp group gets the same shard), and gathers results in rank order.

A dead actor is reported as :class:`WorkerGroupError` naming the rank; the group is then shut
down, since the surviving ranks may be blocked in a collective. The same holds for a partial
failure: when one actor raises and the others do not all raise too within
``failure_grace_s``, they are blocked in a collective the failed rank never joined (or they
went on without it), so the group is shut down and the error says which rank failed first and
why. An error every rank raises (the worker's validation and checkpoint errors are agreed
among all ranks) leaves the group usable.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from ppo_value.config import ValueConfig

log = logging.getLogger(__name__)

__all__ = ["RayValueWorker", "ValueWorkerGroup", "WorkerGroupError", "split_batch_for_dp"]


class WorkerGroupError(RuntimeError):
    """An actor of a :class:`ValueWorkerGroup` died, failed, or did not answer in time."""


class RayValueWorker:
    """Actor body: one :class:`~ppo_value.worker.ValueWorker` per actor process.

    Decorated with ``ray.remote`` by :class:`ValueWorkerGroup`; usable directly in tests.
    """

    def __init__(self, rank: int, world_size: int, num_threads: int | None = None) -> None:
        """Args: rank / world_size of this actor; num_threads: torch intra-op threads."""
        self.rank = rank
        self.world_size = world_size
        if num_threads:
            torch.set_num_threads(num_threads)
        self.worker: Any = None

    def address(self) -> tuple[str, int]:
        """This node's IP address and a free TCP port on it (for the rendezvous)."""
        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return ip, port

    def setup(
        self, config: dict[str, Any], master_addr: str, master_port: int, log_level: str = "INFO"
    ) -> int:
        """Join the process group and build the worker (collective across the group)."""
        from ppo_value.worker import ValueWorker

        gpu_ids = ray.get_gpu_ids()
        os.environ.update(
            {
                "RANK": str(self.rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": "0" if gpu_ids else str(self.rank),
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
            }
        )
        logging.basicConfig(level=log_level)
        if logging.getLevelName(log_level) > logging.INFO:
            # DTensor's "N sequential collectives" performance hints (grad-norm and
            # full-state-dict redistributions on the 2-D mesh) are shown at INFO and below.
            logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        self.worker = ValueWorker(ValueConfig.from_dict(config))
        return self.rank

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``ValueWorker.<method>(*args, **kwargs)`` and return its result."""
        if self.worker is None:
            raise RuntimeError("setup() has not been called on this actor")
        return getattr(self.worker, method)(*args, **kwargs)


def split_batch_for_dp(batch: Mapping[str, torch.Tensor], dp: int) -> list[dict[str, torch.Tensor]]:
    """Split every ``[B, ...]`` tensor of ``batch`` into ``dp`` contiguous shards in order.

    Shards differ in size by at most one sequence when ``dp`` does not divide ``B`` (the first
    ``B % dp`` shards hold one more); the worker evens out the micro-batch counts itself, and
    its loss is normalised by the global token count, so the update equals the single device.

    Raises:
        ValueError: if tensors disagree on ``B``, ``dp < 1``, or ``B < dp`` (a dp rank would
            get no sequence at all).
    """
    sizes = {k: int(v.shape[0]) for k, v in batch.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"batch tensors disagree on the batch dimension: {sizes}")
    (n,) = set(sizes.values())
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    if n < dp:
        raise ValueError(f"batch of {n} sequence(s) cannot feed dp={dp} ranks (each needs one)")
    per, extra = divmod(n, dp)
    bounds = [0]
    for i in range(dp):
        bounds.append(bounds[-1] + per + (1 if i < extra else 0))
    return [{k: v[bounds[i] : bounds[i + 1]] for k, v in batch.items()} for i in range(dp)]


class ValueWorkerGroup:
    """``config.dp * config.cp * config.tp`` :class:`RayValueWorker` actors acting as one critic.

    Args:
        config: the worker config (its ``dp * cp * tp`` is the number of actors).
        address: address of an existing Ray cluster; ``None`` starts or joins a local one.
        num_cpus_per_worker: Ray CPUs reserved per actor.
        num_gpus_per_worker: Ray GPUs per actor; ``None`` means 1 if CUDA is available, else 0.
        num_threads: torch threads per actor (``None`` leaves torch's default).
        timeout_s: seconds to wait for any group call before declaring it hung.
        failure_grace_s: after one actor raised, seconds to wait for the others to raise as
            well (a collective error, the group stays up) before treating it as a partial
            failure and shutting the group down.
        worker_log_level: ``logging`` level name inside the actors.

    Raises:
        WorkerGroupError: an actor failed to start or to join the process group.
    """

    def __init__(
        self,
        config: ValueConfig,
        *,
        address: str | None = None,
        num_cpus_per_worker: float = 1.0,
        num_gpus_per_worker: float | None = None,
        num_threads: int | None = None,
        timeout_s: float = 1800.0,
        failure_grace_s: float = 15.0,
        worker_log_level: str = "INFO",
    ) -> None:
        self.config = config
        self.timeout_s = timeout_s
        self.failure_grace_s = failure_grace_s
        world = config.world_size
        if num_gpus_per_worker is None:
            num_gpus_per_worker = 1.0 if torch.cuda.is_available() else 0.0
        if not ray.is_initialized():
            if address is None:
                cpus = max(os.cpu_count() or 1, int(world * num_cpus_per_worker + 0.999))
                ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=True)
            else:
                ray.init(address=address)
        actor_cls = ray.remote(num_cpus=num_cpus_per_worker, num_gpus=num_gpus_per_worker)(
            RayValueWorker
        )
        self.actors: list[Any] = [
            actor_cls.remote(rank, world, num_threads) for rank in range(world)
        ]
        try:
            master_addr, master_port = self._gather([self.actors[0].address.remote()])[0]
            cfg = config.to_dict()
            self._gather(
                [
                    a.setup.remote(cfg, master_addr, master_port, worker_log_level)
                    for a in self.actors
                ]
            )
        except BaseException:
            self.shutdown()
            raise
        log.info(
            "value worker group up: %d actors (dp=%d, cp=%d, tp=%d)",
            world,
            config.dp,
            config.cp,
            config.tp,
        )

    # ------------------------------------------------------------------ plumbing
    def _gather(self, refs: Sequence[Any], timeout_s: float | None = None) -> list[Any]:
        """Wait for ``refs`` (one per rank, in rank order); fail fast on a dead actor."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        index = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        succeeded: list[int] = []
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready:
                self.shutdown()
                raise WorkerGroupError(
                    f"value workers {sorted(index[r] for r in pending)} did not answer within "
                    f"{timeout} s; the group was shut down"
                )
            ref = ready[0]
            rank = index[ref]
            try:
                results[rank] = ray.get(ref)
                succeeded.append(rank)
            except RayActorError as exc:
                self.shutdown()
                raise WorkerGroupError(
                    f"value worker rank {rank} died ({type(exc).__name__}); the group was shut "
                    "down because the other ranks may be stuck in a collective"
                ) from exc
            except RayTaskError as exc:
                self._after_task_error(rank, exc, pending, index, succeeded)
        return results

    def _after_task_error(
        self,
        rank: int,
        exc: RayTaskError,
        pending: list[Any],
        index: dict[Any, int],
        succeeded: list[int],
    ) -> None:
        """Rank ``rank`` raised first. Keep the group only if every other rank raises too."""
        ready, blocked = ray.wait(pending, num_returns=len(pending), timeout=self.failure_grace_s)
        went_on = list(succeeded)
        died: list[int] = []
        for ref in ready:
            try:
                ray.get(ref)
                went_on.append(index[ref])
            except RayTaskError:
                pass
            except RayActorError:
                died.append(index[ref])
        stuck = sorted(index[r] for r in blocked)
        if not (stuck or went_on or died):
            raise WorkerGroupError(f"value worker rank {rank} raised:\n{exc}") from exc
        self.shutdown()
        states = []
        if stuck:
            states.append(
                f"ranks {stuck} were still running after {self.failure_grace_s} s (blocked in "
                "a collective it never joined)"
            )
        if went_on:
            states.append(f"ranks {sorted(went_on)} finished without it")
        if died:
            states.append(f"ranks {sorted(died)} died")
        raise WorkerGroupError(
            f"value worker rank {rank} failed first; {'; '.join(states)}, so the group was "
            f"shut down (its actors killed). Rank {rank} raised:\n{exc}"
        ) from exc

    def _call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        if not self.actors:
            raise WorkerGroupError("the value worker group is shut down")
        return self._gather([a.call.remote(method, *args, **kwargs) for a in self.actors])

    def _call_sharded(
        self, method: str, batch: Mapping[str, torch.Tensor], **kwargs: Any
    ) -> list[Any]:
        if not self.actors:
            raise WorkerGroupError("the value worker group is shut down")
        shards = split_batch_for_dp(batch, self.config.dp)
        refs = [ray.put(s) for s in shards]
        per_dp = self.config.cp * self.config.tp  # ranks of one dp index: its CP and TP groups
        calls = [
            a.call.remote(method, refs[rank // per_dp], **kwargs)
            for rank, a in enumerate(self.actors)
        ]
        return self._gather(calls)

    # -------------------------------------------------------------------- API
    def get_values(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``V(s_t)`` ``[B, S]`` float32 for the whole batch (any ``B >= dp``), in order."""
        results = self._call_sharded("get_values", batch)
        per_dp = self.config.cp * self.config.tp
        return torch.cat([results[d * per_dp] for d in range(self.config.dp)])

    def train(self, batch: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """One optimiser step on the whole batch; returns rank 0's (global) metrics."""
        return self._call_sharded("train", batch)[0]

    def save_checkpoint(self, path: str | Path) -> Path:
        """Atomic sharded checkpoint (see :mod:`ppo_value.checkpoint`). Returns its path."""
        return self._call_all("save_checkpoint", str(path))[0]

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Load a checkpoint saved at any mesh shape; returns its metadata."""
        return self._call_all("load_checkpoint", str(path))[0]

    def export_hf(self, path: str | Path) -> Path:
        """Consolidated safetensors + config for ``transformers``."""
        return self._call_all("export_hf", str(path))[0]

    def prepare_for_training(self) -> None:
        """Lifecycle hook, forwarded to every worker."""
        self._call_all("prepare_for_training")

    def prepare_for_inference(self) -> None:
        """Lifecycle hook, forwarded to every worker."""
        self._call_all("prepare_for_inference")

    def finish_training(self) -> None:
        """Lifecycle hook, forwarded to every worker."""
        self._call_all("finish_training")

    def finish_inference(self) -> None:
        """Lifecycle hook, forwarded to every worker."""
        self._call_all("finish_inference")

    def shutdown(self) -> None:
        """Kill the actors (the Ray cluster itself is left running). Safe to call twice."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []

    def __enter__(self) -> ValueWorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

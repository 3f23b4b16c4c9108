"""Long-lived multi-rank CPU process groups for tests and tripwires.

Spawning a process group costs seconds (each rank imports torch), so a test session should
pay it once. :class:`RankPool` starts ``world_size`` spawned processes, initialises a gloo
process group among them, and then runs any number of functions on every rank.

Functions are sent by reference (pickled as ``module.qualname``), so they must be defined at
module level in an importable module. The parent's ``sys.path`` is handed to the ranks, so
test modules that pytest can import are importable there too.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing as mp
import os
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = [
    "STARTUP_TIMEOUT",
    "RankError",
    "RankPool",
    "grid_mesh",
    "layout_agrees",
    "raised_on_any_rank",
    "run_on_ranks",
    "spec_disagreement",
    "world_mesh",
]


STARTUP_TIMEOUT = 300.0
"""Seconds a fresh :class:`RankPool` that runs calls with a short ``timeout`` may give its
ranks to import torch and join the process group (``startup_timeout``): on 2 busy cores four
ranks of a CUDA build of torch take over a minute."""

_GRACE_AFTER_EXIT = 15.0
"""Seconds the other ranks get to answer once a rank of a :class:`RankPool` exited without a
reply (they may be waiting in a collective with it)."""


class RankError(RuntimeError):
    """A function raised on one or more ranks of a :class:`RankPool`.

    ``failures`` maps each failing rank to the formatted remote traceback.
    """

    def __init__(self, failures: Mapping[int, str]) -> None:
        self.failures = dict(failures)
        first = min(self.failures)
        super().__init__(
            f"{len(self.failures)} rank(s) failed ({sorted(self.failures)}); "
            f"rank {first}:\n{self.failures[first]}"
        )


def _rank_main(
    rank: int,
    world_size: int,
    init_file: str,
    backend: str,
    sys_path: list[str],
    env: dict[str, str],
    quiet: bool,
    conn: Connection,
) -> None:
    # Runs in a fresh interpreter (spawn): import torch here, not at module import time.
    sys.path[:] = sys_path
    # Ranks write to stderr only: the parent's stdout may carry machine-readable output
    # (``--json``), and gloo prints connection lines on stdout in some releases.
    sys.stdout.flush()
    os.dup2(2, 1)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size)})
    # Quiet ranks keep start-up warnings for the parent (``startup_warnings``) instead of
    # printing them: torch's import-time notes (a missing NumPy) are noise to whoever only
    # wants the ranks' results.
    recorder = warnings.catch_warnings(record=True) if quiet else contextlib.nullcontext()
    with recorder as caught:
        if quiet:
            warnings.simplefilter("always")
        import torch.distributed as dist

        # gloo prints "[Gloo] Rank 0 is connected to 1 peer ranks" on stdout (2.10): a quiet
        # rank keeps that for the parent too.
        printed = tempfile.TemporaryFile() if quiet else None
        if printed is not None:
            os.dup2(printed.fileno(), 1)
        try:
            dist.init_process_group(
                backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size
            )
        except BaseException:  # noqa: BLE001 - sent to the parent instead of hanging it
            conn.send(("init-error", traceback.format_exc()))
            return
        finally:
            if printed is not None:
                sys.stdout.flush()
                os.dup2(2, 1)
    notes = [f"{w.category.__name__}: {w.message}" for w in caught or ()]
    if printed is not None:
        printed.seek(0)
        text = printed.read().decode("utf-8", errors="replace")
        notes += [f"[rank {rank}] {line}" for line in text.splitlines() if line.strip()]
        printed.close()
    conn.send(("ready", notes))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        if message is None:
            break
        fn, args, kwargs = message
        try:
            result = fn(*args, **kwargs)
        except BaseException:  # noqa: BLE001 - the traceback is the result; rank stays alive
            conn.send(("error", traceback.format_exc()))
        else:
            try:  # pickling happens before anything is written: a refusal leaves the pipe clean
                conn.send(("ok", result))
            except Exception:  # noqa: BLE001 - e.g. a tensor that requires grad; rank stays alive
                conn.send(("error", "the result cannot be sent back:\n" + traceback.format_exc()))
    dist.destroy_process_group()
    # Skip the interpreter's teardown of torch (about a second per rank): nothing is left to
    # flush but the standard streams.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class RankPool:
    """``world_size`` long-lived spawned processes sharing one process group.

    Args:
        world_size: number of ranks (>= 1).
        backend: ``torch.distributed`` backend, ``"gloo"`` for CPU.
        env: extra environment variables set on every rank before torch is imported there
            (e.g. ``{"DTENSOR_PATCHES_DISABLE": "all"}``).
        timeout: seconds to wait for one :meth:`run` (or for start-up) before failing.
        startup_timeout: seconds to wait for start-up instead (default ``timeout``): a short
            per-call ``timeout`` should not also bound every rank's import of torch, which on
            a loaded machine takes longer.
        wait: wait here until every rank has joined the process group. With ``False`` the
            constructor returns once the processes are spawned, so the caller can work while
            the ranks import torch; the first :meth:`run` (or :meth:`wait_ready`) waits, and
            raises the start-up errors below.
        quiet: record the warnings the ranks raise while starting (``startup_warnings``, one
            ``"Category: message"`` per warning) instead of printing them.
        hash_seeds: each rank's ``PYTHONHASHSEED`` (one per rank). Default: inherited from
            this process; where it is unset, every rank draws its own, as under ``torchrun``.
            Seeds that differ on purpose show what depends on the order of a set or a dict.

    Raises:
        ValueError: ``world_size < 1``, or ``hash_seeds`` not one per rank.
        RankError: a rank failed to join the process group.
        TimeoutError: the ranks did not answer within ``timeout``.
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "gloo",
        env: Mapping[str, str] | None = None,
        timeout: float = 600.0,
        startup_timeout: float | None = None,
        wait: bool = True,
        quiet: bool = False,
        hash_seeds: Sequence[int] | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if hash_seeds is not None and len(hash_seeds) != world_size:
            raise ValueError(f"hash_seeds: {len(hash_seeds)} seeds for {world_size} ranks")
        self.world_size = world_size
        self.timeout = timeout
        self.startup_timeout = startup_timeout
        self.startup_warnings: list[str] = []
        self._ready = False
        ctx = mp.get_context("spawn")
        self._tmpdir = tempfile.TemporaryDirectory(prefix="dtensor-patches-pg-")
        init_file = os.path.join(self._tmpdir.name, "init")
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_rank_main,
                args=(
                    rank,
                    world_size,
                    init_file,
                    backend,
                    list(sys.path),
                    dict(env or {}),
                    quiet,
                    child,
                ),
                daemon=True,
                name=f"rank{rank}",
            )
            # The seed is read when the interpreter starts: the spawned process inherits it
            # from this process's environment, set only around the start.
            inherited = os.environ.get("PYTHONHASHSEED")
            if hash_seeds is not None:
                os.environ["PYTHONHASHSEED"] = str(hash_seeds[rank])
            try:
                proc.start()
            finally:
                if hash_seeds is not None:
                    if inherited is None:
                        del os.environ["PYTHONHASHSEED"]
                    else:
                        os.environ["PYTHONHASHSEED"] = inherited
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait until every rank has joined the process group (at once if it has already).

        Raises:
            RuntimeError: the pool is closed.
            RankError: a rank failed to start or join; the pool is then closed.
            TimeoutError: a rank did not answer within ``startup_timeout`` (or ``timeout``).
        """
        if self._ready:
            return
        if not self._conns:
            raise RuntimeError("RankPool is closed")
        try:
            replies = self._collect(self.startup_timeout)
            failures = {r: tb for r, (kind, tb) in enumerate(replies) if kind != "ready"}
            if failures:
                raise RankError(failures)
        except BaseException:
            self.close()
            raise
        for _, notes in replies:
            for note in notes or ():
                if note not in self.startup_warnings:
                    self.startup_warnings.append(note)
        self._ready = True

    def _collect(self, timeout: float | None = None) -> list[tuple[str, Any]]:
        """Every rank's reply, waiting on all ranks at once: a rank that exits without one
        (a crash in a collective) is seen at once, and the others, which may be stuck in a
        collective with it, get :data:`_GRACE_AFTER_EXIT` seconds to answer before the pool is
        closed (instead of the whole ``timeout``, or ``timeout`` given here)."""
        import time
        from multiprocessing.connection import wait

        timeout = self.timeout if timeout is None else timeout
        replies: dict[int, tuple[str, Any]] = {}
        pending = dict(enumerate(self._conns))
        deadline = time.monotonic() + timeout
        exited = False
        while pending:
            left = deadline - time.monotonic()
            ready = wait(list(pending.values()), timeout=max(left, 0)) if left > 0 else []
            if not ready:
                self.close()
                if exited:
                    for rank in pending:
                        replies[rank] = ("error", f"rank {rank} did not answer after a rank exited")
                    break
                raise TimeoutError(f"rank {min(pending)} did not answer within {timeout} s")
            for rank in [r for r, conn in pending.items() if conn in ready]:
                try:
                    replies[rank] = pending.pop(rank).recv()
                except EOFError:
                    replies[rank] = (
                        "error",
                        f"rank {rank} exited (exit code {self._procs[rank].exitcode})",
                    )
                    exited = True
                    deadline = min(deadline, time.monotonic() + _GRACE_AFTER_EXIT)
        return [replies[rank] for rank in sorted(replies)]

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> list[T]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order.

        Raises:
            RuntimeError: the pool is closed.
            RankError: ``fn`` raised on any rank (carries every failing rank's traceback).
            TimeoutError: a rank did not finish within ``timeout``; the pool is then closed,
                because its ranks may be stuck inside a collective.
        """
        if not self._conns:
            raise RuntimeError("RankPool is closed")
        self.wait_ready()
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        replies = self._collect()
        failures = {r: payload for r, (kind, payload) in enumerate(replies) if kind != "ok"}
        if failures:
            raise RankError(failures)
        return [payload for _, payload in replies]

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (also after a timeout or a failed start)."""
        return not self._conns

    def close(self) -> None:
        """Stop the ranks and remove the rendezvous directory. Safe to call twice."""
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._conns = []
        self._procs = []
        self._tmpdir.cleanup()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_on_ranks(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> list[T]:
    """Start a :class:`RankPool`, run ``fn`` once on every rank, close the pool."""
    with RankPool(world_size, env=env) as pool:
        return pool.run(fn, *args, **kwargs)


def layout_agrees(dtensor: Any) -> bool:
    """Whether a DTensor's local tensor is laid out in memory the way its spec says.

    DTensor gives a result the global strides that shape propagation computed; the local kernel
    may have produced another layout (a gathered, contiguous input where the global input was a
    transposed view). Then ``.transpose(...).contiguous()`` is a no-op on the DTensor while its
    local tensor stays non-contiguous, and a later ``view`` fails. Compares the order of the
    dims by stride (outermost first) over the dims longer than 1 in both.
    """
    local = dtensor.to_local()
    dims = [d for d in range(dtensor.ndim) if local.shape[d] > 1 and dtensor.shape[d] > 1]
    by_global = sorted(dims, key=lambda d: (-dtensor.stride(d), d))
    by_local = sorted(dims, key=lambda d: (-local.stride(d), d))
    return by_global == by_local


def spec_disagreement(dtensor: Any) -> str | None:
    """``None`` when every rank of the default process group holds ``dtensor`` with the same
    global shape, stride and placements, and this rank's local tensor has the shape DTensor's
    layout gives this rank (uneven and empty last shards included); else what differs.

    Collective over the default group: call it on every rank, for a DTensor on a mesh over
    all of them.
    """
    import torch.distributed as dist

    from dtensor_patches._torch.dtensors import local_shape_and_offset

    mine = (tuple(dtensor.shape), tuple(dtensor.stride()), tuple(map(str, dtensor.placements)))
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    if len(set(seen)) > 1:
        return f"the ranks disagree on the global (shape, stride, placements): {seen}"
    expected, _ = local_shape_and_offset(dtensor.shape, dtensor.device_mesh, dtensor.placements)
    local = tuple(dtensor.to_local().shape)
    if local != expected:
        return (
            f"rank {dist.get_rank()}: local shape {local}, but global shape "
            f"{tuple(dtensor.shape)} placed {dtensor.placements} gives it {expected}"
        )
    return None


@functools.cache
def world_mesh() -> Any:
    """One 1-D CPU mesh over every rank of this process group, built on first use and reused
    by every later call (the tripwires and the op sweep run many functions on one pool)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


@functools.cache
def grid_mesh(shape: tuple[int, ...]) -> Any:
    """A CPU mesh of ``shape`` (``(2, 2)``: a 2-D mesh, FSDP2 over TP) over every rank of this
    process group, built on first use and reused (a 2-D mesh makes a process group per mesh
    dim: building one per call would leak them).

    Raises:
        ValueError: the product of ``shape`` is not the world size.
    """
    import math

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if math.prod(shape) != dist.get_world_size():
        raise ValueError(
            f"a mesh of shape {shape} needs {math.prod(shape)} ranks, not {dist.get_world_size()}"
        )
    if len(shape) == 1:
        return world_mesh()
    return init_device_mesh("cpu", shape)


def raised_on_any_rank(fn: Callable[[], T]) -> tuple[T | None, str | None]:
    """``fn()`` on every rank, then ``(its result, None)``, or ``(None, the first failing
    rank's error)`` on every rank when any rank raised. The errors are exchanged (an object
    all-gather every rank reaches) before anyone reads a result, so code where one rank raises
    while the others would go on into a collective fails on every rank instead of hanging.
    Call it collectively, on every rank of the default process group."""
    import torch.distributed as dist

    result: T | None = None
    error: str | None = None
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        error = f"{type(exc).__name__}: {exc}"
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    raised = next((e for e in errors if e is not None), None)
    return (None, raised) if raised is not None else (result, None)

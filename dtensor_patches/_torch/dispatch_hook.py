"""Where a call meets sharding propagation without a cached decision (a *miss*), for each of the
two dispatch designs, and torch's own decision for it.

DTensor decides how to run a call (its ``OutputSharding``) once per distinct op schema and
caches the decision; cached calls never reach Python on 2.10+ (C++ fast path) and reach only a
cache lookup on 2.9. The hook replaces, as attributes of the process-wide dispatcher and
propagator objects (:func:`replacements`; the ledger installs and restores them):

- 2.10+: ``OpDispatcher._propagate_op_sharding_dispatch_slow_path(op_call, args, kwargs,
  op_info, try_cache)``, which the C++ dispatcher calls on a cache miss; a result that is not
  an ``OutputSharding`` is returned to the caller as the op's output (torch itself does this
  for CompositeImplicitAutograd decompositions), and is not cached. A call with a plain tensor
  beside DTensors that no rule diverts runs by torch's decision uncached
  (:mod:`.uncached`), so that every such call asks Python what the plain tensor is.
- 2.9: ``OpDispatcher.dispatch`` is Python. The propagator's ``propagate_op_sharding_non_cached``
  is wrapped (the cache that :func:`~dtensor_patches._torch.tables.clear_sharding_caches`
  rebuilds over it then caches only torch's decisions); a diverting decision raises
  :class:`Divert` (a ``BaseException``, so torch's ``except Exception`` re-wrapping lets it
  through) and a thin wrapper around ``dispatch`` catches it and runs the call. 2.9 also
  flattens list arguments only for ops with a strategy, so an op without one whose DTensors all
  sit in a list (``block_diag``, ``_chunk_cat``) is refused before propagation
  (``found no DeviceMesh from dtensor args``): that refusal goes to ``take_refusal``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dtensor_patches import state
from dtensor_patches._torch.access import attribute
from dtensor_patches._torch.dtensors import dtensor_types
from dtensor_patches._torch.implicit_replication import user_asked
from dtensor_patches._torch.tables import (
    DISPATCHER_ATTRIBUTES,
    PROPAGATOR_ATTRIBUTES,
    op_dispatcher,
    sharding_propagator,
)
from dtensor_patches._torch.uncached import has_plain_tensor, run_uncached
from dtensor_patches._torch.versions import dispatches_in_cpp

if TYPE_CHECKING:
    from torch._ops import OpOverload
    from torch.distributed.tensor._op_schema import OpSchema, OutputSharding

__all__ = ["DivertedCall", "NativeDecision", "replacements"]

DivertedCall = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]
"""Runs a diverted call: ``(op_call, args, kwargs) -> output``."""

Decide = Callable[["OpOverload", "OpSchema", "NativeDecision"], "DivertedCall | None"]
TakeRefusal = Callable[[Any, tuple[Any, ...], dict[str, Any], BaseException], Any]


class NativeDecision:
    """torch's own decision for the call at hand, computed at most once and only if asked."""

    __slots__ = ("_compute", "_done", "_error", "_result")

    def __init__(self, compute: Callable[[], Any]) -> None:
        self._compute = compute
        self._done = False
        self._result: Any = None
        self._error: Exception | None = None

    def _run(self) -> None:
        if not self._done:
            self._done = True
            try:
                self._result = self._compute()
            except Exception as exc:  # noqa: BLE001 - re-raised by get(); rules inspect it
                self._error = exc

    def get(self) -> Any:
        """torch's result: an ``OutputSharding`` (or, 2.10+, an already computed output).

        Raises:
            Whatever torch's propagation raised for this call.
        """
        self._run()
        if self._error is not None:
            raise self._error
        return self._result

    def error(self) -> Exception | None:
        """The exception torch's propagation raised for this call, or ``None``."""
        self._run()
        return self._error

    def release(self) -> None:
        """Forget where torch's error was raised, once a diverted call makes it moot.

        The error's traceback holds the frame that asked (through ``f_back``, every caller's
        frame up to the user's code, with their local tensors), and that frame holds this
        decision: a reference cycle. It kept every tensor of those frames alive until the next
        garbage collection, and on torch 2.9 the collection cleared the slots of DTensors that
        autograd had saved (``'DTensor' object has no attribute '_local_tensor'`` in a later
        backward). The error itself (type, message) stays for the diverted call to use.
        """
        if self._error is not None:
            self._error.__traceback__ = None

    def sharding(self) -> OutputSharding | None:
        """torch's ``OutputSharding``, or ``None`` when propagation raised or torch already
        produced the output itself (a CompositeImplicitAutograd decomposition, 2.10+)."""
        self._run()
        if self._error is not None or not isinstance(self._result, dtensor_types().OutputSharding):
            return None
        return self._result

    def output_specs(self) -> tuple[Any, ...] | None:
        """The output specs of :meth:`sharding`, one per output (a non-tensor output's is
        ``None``), or ``None`` when torch decided no sharding for the call."""
        sharding = self.sharding()
        spec = None if sharding is None else sharding.output_spec
        if spec is None:
            return None
        return tuple(spec) if isinstance(spec, list | tuple) else (spec,)


def _active() -> bool:
    return bool(state.MISS_RULES) or state.FALLBACK.get("call") is not None


class Divert(BaseException):
    """2.9 only: carries a diverted call from propagation up to the dispatch wrapper."""

    def __init__(self, op: Any, run: DivertedCall) -> None:
        super().__init__(str(op))
        self.op = op
        self.run = run


def _dispatching_op() -> Any:
    """2.9: the op of the innermost ``hooked_dispatch`` on this thread's stack, or ``None``.

    Propagation is re-entered for nested ops (torch's own, inside a dispatch): only the call
    a dispatch is running may be diverted by its own propagation. Read from the frames, on a
    miss only, so that the dispatch wrapper itself does nothing on every call. A dispatch that
    is running a diverted call (its ``diverted`` is bound) is not the one propagating: the search
    goes on outwards, as if that dispatch had returned."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code is _HOOKED_CODE[0] and "diverted" not in frame.f_locals:
            return frame.f_locals.get("op_call")
        frame = frame.f_back
    return None


# The code object of every hooked_dispatch closure (set when the first one is built).
_HOOKED_CODE: list[Any] = [None]


def _slow_path(decide: Decide) -> tuple[str, str, Any]:
    name = "_propagate_op_sharding_dispatch_slow_path"
    original = attribute(op_dispatcher(), name, f"OpDispatcher.{name}")

    def slow_path(op_call: Any, args: Any, kwargs: Any, op_info: Any, try_cache: bool) -> Any:
        if not _active():
            return original(op_call, args, kwargs, op_info, try_cache)
        native = NativeDecision(lambda: original(op_call, args, kwargs, op_info, try_cache))
        run = decide(op_call, op_info.schema, native)
        if run is not None:
            native.release()
            return run(op_call, args, kwargs)
        if (
            state.FALLBACK.get("plain_checked")
            and not user_asked()
            and has_plain_tensor(args, kwargs)
        ):
            # Checked plain tensors: never cached, so every such call is checked again.
            return run_uncached(op_call, args, kwargs, op_info, native.get())
        return native.get()

    return (DISPATCHER_ATTRIBUTES, name, slow_path)


def _python_dispatch(decide: Decide, take_refusal: TakeRefusal) -> list[tuple[str, str, Any]]:
    dispatcher, propagator = op_dispatcher(), sharding_propagator()
    dispatch = attribute(dispatcher, "dispatch", "OpDispatcher.dispatch")
    non_cached = attribute(
        propagator,
        "propagate_op_sharding_non_cached",
        "ShardingPropagator.propagate_op_sharding_non_cached",
    )
    attribute(propagator, "propagate_op_sharding", "ShardingPropagator.propagate_op_sharding")

    def propagate(op_schema: OpSchema) -> Any:
        op = op_schema.op
        if not _active() or _dispatching_op() is not op:
            return non_cached(op_schema)
        native = NativeDecision(lambda: non_cached(op_schema))
        run = decide(op, op_schema, native)
        if run is not None:
            native.release()
            raise Divert(op, run)
        return native.get()

    def hooked_dispatch(op_call: Any, args: Any, kwargs: Any) -> Any:
        # Every DTensor call passes here on 2.9: nothing but the try (free when nothing is
        # raised). Which op a propagation belongs to is found from this frame, on a miss only.
        try:
            return dispatch(op_call, args, kwargs)
        except Divert as divert:
            if divert.op is not op_call:
                raise
            run = divert.run
            diverted = True  # this frame now runs a diverted call: _dispatching_op skips it
        except AssertionError as error:
            if "found no DeviceMesh from dtensor args" not in str(error):
                raise
            diverted = True  # noqa: F841 - read from this frame by _dispatching_op
            return take_refusal(op_call, args, kwargs, error)
        # Outside the handler: the diverted call must not run with the Divert (whose
        # traceback holds every frame of the propagation) as the context of its exceptions.
        return run(op_call, args, kwargs)

    _HOOKED_CODE[0] = hooked_dispatch.__code__
    return [
        (PROPAGATOR_ATTRIBUTES, "propagate_op_sharding_non_cached", propagate),
        (DISPATCHER_ATTRIBUTES, "dispatch", hooked_dispatch),
    ]


def replacements(decide: Decide, take_refusal: TakeRefusal) -> list[tuple[str, str, Any]]:
    """``(table, attribute, value)`` for every attribute the hook replaces on this release.

    ``decide(op, op_schema, native)`` is asked on every miss while the library has a miss rule
    or the fallback; it returns a :data:`DivertedCall` to run the call instead of torch (never
    cached), or ``None`` to keep torch's decision (cached as usual). ``take_refusal`` gets
    2.9's refusals of list-only ops (raise the error to keep it).

    Raises:
        PatchError: an internal the hook wraps is missing.
    """
    if dispatches_in_cpp():
        return [_slow_path(decide)]
    return _python_dispatch(decide, take_refusal)

"""Verify a whole run, or its first optimizer steps, without changing its code:
``DTENSOR_PATCHES_VERIFY=sample,steps=3 torchrun train.py`` (read by ``apply_all()``).

The run's calls are checked by a sampling :func:`~dtensor_patches.verify.verify` mode entered
on the thread that called ``apply_all()`` (backward passes it starts are covered too), with
``raise_on_mismatch=False``: each mismatch is logged as a warning when it is found, the summary
when the verification stops (after ``steps`` optimizer steps, at :func:`stop_run_verification`,
or at exit).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from dtensor_patches.verify import Mismatch, VerifyReport, _Checker, _mode_class
from dtensor_patches.verify_sampling import fraction_of

log = logging.getLogger(__name__)

__all__ = [
    "ENV",
    "RunVerification",
    "parse_setting",
    "run_verification",
    "start_from_env",
    "start_run_verification",
    "stop_run_verification",
]

ENV = "DTENSOR_PATCHES_VERIFY"
"""``full`` (or ``1``): every call; ``sample``: each signature once; ``sample=F``: a fraction
``F`` of the signatures; add ``,steps=N`` to stop after ``N`` optimizer steps; ``atol=``,
``rtol=`` set the tolerances. Empty or ``0``: off."""


@dataclass(frozen=True)
class RunSetting:
    """What :data:`ENV` asks for."""

    sample: bool | float
    steps: int | None = None
    atol: float = 1e-5
    rtol: float = 1e-4


def parse_setting(text: str) -> RunSetting | None:
    """The setting in a :data:`ENV` value, or ``None`` for off (empty, ``0``, ``off``).

    Raises:
        ValueError: an unknown word or a bad number, naming it.
    """
    words = [w.strip() for w in text.split(",") if w.strip()]
    if not words or words[0].lower() in ("0", "off", "false", "no"):
        return None
    sample: bool | float = False
    options: dict[str, Any] = {}
    for word in words:
        name, _, value = word.partition("=")
        name = name.lower()
        try:
            if name in ("1", "full", "on", "true"):
                sample = False
            elif name == "sample":
                sample = float(value) if value else True
                if not isinstance(sample, bool) and not 0.0 < sample <= 1.0:
                    raise ValueError("a fraction in (0, 1]")
            elif name == "steps":
                options["steps"] = int(value)
                if options["steps"] < 1:
                    raise ValueError("at least 1")
            elif name in ("atol", "rtol"):
                options[name] = float(value)
            else:
                raise ValueError("unknown")
        except ValueError as exc:
            raise ValueError(
                f"{ENV}={text!r}: {word!r} is not understood ({exc}); expected 'full', "
                "'sample' or 'sample=0.1', optionally ',steps=N', ',atol=X', ',rtol=X'"
            ) from None
    return RunSetting(sample=sample, **options)


class RunVerification:
    """A verification mode held open across a run (see the module doc).

    Attributes:
        report: the :class:`VerifyReport` it fills.
        steps_left: optimizer steps until it stops, or ``None`` (until stopped).
    """

    def __init__(self, setting: RunSetting) -> None:
        self.setting = setting
        self.steps_left = setting.steps
        self._checker = _Checker(
            setting.atol,
            setting.rtol,
            raise_on_mismatch=False,
            fraction=fraction_of(setting.sample),
            on_mismatch=_log_mismatch,
        )
        self.report: VerifyReport = self._checker.report
        self._mode = _mode_class()(self._checker)
        self._hook: Any = None
        self._stopped = False
        self._thread = threading.current_thread()

    def start(self) -> None:
        import torch.optim.optimizer as optimizer

        self._mode.__enter__()
        if self.steps_left is not None:
            self._hook = optimizer.register_optimizer_step_post_hook(self._after_step)

    def _after_step(self, *args: Any, **kwargs: Any) -> None:
        if self.steps_left is None:
            return
        self.steps_left -= 1
        if self.steps_left <= 0:
            self.stop()

    def stop(self) -> VerifyReport:
        """Stop checking (idempotent) and log the summary; returns the report."""
        from dtensor_patches._torch.modes import current_dispatch_mode

        if self._stopped:
            return self.report
        self._stopped = True
        self._checker.active = False
        if self._hook is not None:
            self._hook.remove()
        # Leave the mode only when it is on top of this thread's stack: another mode entered
        # after it (and still open) would be popped instead. Otherwise it stays, inactive.
        if threading.current_thread() is self._thread and current_dispatch_mode() is self._mode:
            with contextlib.suppress(Exception):
                self._mode.__exit__(None, None, None)
        level = logging.WARNING if self.report.mismatches else logging.INFO
        log.log(level, "%s", self.report)
        return self.report


def _log_mismatch(mismatch: Mismatch) -> None:
    log.warning("dtensor_patches.verify (%s): %s", ENV, mismatch)


_CURRENT: dict[str, RunVerification] = {}


def run_verification() -> RunVerification | None:
    """The run verification in progress (started by :data:`ENV` or
    :func:`start_run_verification`), or ``None``."""
    return _CURRENT.get("run")


def start_run_verification(
    *, sample: bool | float = True, steps: int | None = None, atol: float = 1e-5, rtol: float = 1e-4
) -> RunVerification:
    """Start verifying every DTensor call of this thread, sampled like
    ``verify(sample=...)``, until ``steps`` optimizer steps have run (all optimizers count) or
    :func:`stop_run_verification`. One at a time: a second start returns the first.

    Raises:
        ValueError: ``sample`` or ``steps`` out of range.
        PatchError: an internal the verification needs moved.
    """
    current = run_verification()
    if current is not None:
        return current
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    run = RunVerification(RunSetting(sample=sample, steps=steps, atol=atol, rtol=rtol))
    run.start()
    _CURRENT["run"] = run
    return run


def stop_run_verification() -> VerifyReport | None:
    """Stop the run verification in progress; its report, or ``None`` if none ran."""
    run = _CURRENT.pop("run", None)
    return None if run is None else run.stop()


def start_from_env() -> RunVerification | None:
    """Start a run verification as :data:`ENV` asks (``apply_all()`` calls this).

    Raises:
        ValueError: the variable's value is not understood.
    """
    setting = parse_setting(os.environ.get(ENV, ""))
    if setting is None:
        return None
    return start_run_verification(
        sample=setting.sample, steps=setting.steps, atol=setting.atol, rtol=setting.rtol
    )


atexit.register(stop_run_verification)

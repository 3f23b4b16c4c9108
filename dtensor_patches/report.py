"""What ``apply_all()`` did, patch by patch."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Outcome", "Report", "Status"]


class Status(str, enum.Enum):
    """The result for one patch."""

    APPLIED = "applied"
    WOULD_APPLY = "would apply"  # dry run (plan()) only
    ALREADY_APPLIED = "already applied"
    GATED_OUT = "gated out"
    EXCLUDED = "excluded"
    DISABLED = "disabled"  # by the DTENSOR_PATCHES_DISABLE environment variable
    SKIPPED_NATIVE = "skipped: already supported"
    FAILED = "failed"


@dataclass(frozen=True)
class Outcome:
    """One patch's status and why."""

    name: str
    status: Status
    reason: str = ""


@dataclass(frozen=True)
class Report:
    """Per-patch outcomes of one ``apply_all()`` (or ``plan()``) call, in registry order."""

    torch_version: str
    outcomes: tuple[Outcome, ...]

    def __iter__(self) -> Iterator[Outcome]:
        return iter(self.outcomes)

    def __len__(self) -> int:
        return len(self.outcomes)

    def __getitem__(self, name: str) -> Outcome:
        for outcome in self.outcomes:
            if outcome.name == name:
                return outcome
        raise KeyError(name)

    def names(self, status: Status) -> list[str]:
        """Names of the patches with ``status``."""
        return [o.name for o in self.outcomes if o.status is status]

    @property
    def applied(self) -> list[str]:
        return self.names(Status.APPLIED)

    @property
    def failed(self) -> list[str]:
        return self.names(Status.FAILED)

    @property
    def changed(self) -> bool:
        """Whether this call changed torch's registry."""
        return bool(self.applied)

    def to_dict(self) -> dict[str, object]:
        return {
            "torch_version": self.torch_version,
            "patches": [
                {"name": o.name, "status": o.status.value, "reason": o.reason}
                for o in self.outcomes
            ],
        }

    def __str__(self) -> str:
        if not self.outcomes:
            return f"dtensor_patches on torch {self.torch_version}: no patches registered"
        width = max(len(o.name) for o in self.outcomes)
        lines = [f"dtensor_patches on torch {self.torch_version}:"]
        for o in self.outcomes:
            reason = f" ({o.reason})" if o.reason else ""
            lines.append(f"  {o.name:<{width}}  {o.status.value}{reason}")
        return "\n".join(lines)

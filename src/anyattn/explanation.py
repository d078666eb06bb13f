"""The selector's verdict as data: one `BackendVerdict` per backend, the `Explanation` of a
whole selection, and `NoBackendError`, which carries it (re-exported by `anyattn.selector`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from anyattn.config import AttentionSelectorConfig
from anyattn.types import DeviceInfo

__all__ = ["BackendVerdict", "Explanation", "NoBackendError"]


class NoBackendError(ValueError):
    """No backend fits, or the requested one does not; the message lists every reason."""

    def __init__(self, message: str, explanation: Explanation) -> None:
        super().__init__(message)
        self.explanation = explanation


@dataclass(frozen=True)
class BackendVerdict:
    """One backend's verdict for one config: its registry `name`, `priority` (position in the
    platform's order, 0 first), capability `reasons` (for the requested device), why it is
    `unavailable` on this machine, and why it is `not_automatic` (taken only on request)."""

    name: str
    priority: int
    reasons: tuple[str, ...]
    unavailable: str | None
    not_automatic: str | None = None

    @property
    def fits(self) -> bool:
        return not self.reasons and self.unavailable is None

    def why_not(self) -> list[str]:
        """The capability reasons, then the availability one."""
        unavailable = [f"not available here: {self.unavailable}"] if self.unavailable else []
        return [*self.reasons, *unavailable]

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "priority": self.priority,
            "fits": self.fits,
            "reasons": list(self.reasons),
            "unavailable": self.unavailable,
            "not_automatic": self.not_automatic,
        }


@dataclass(frozen=True)
class Explanation:
    """The selector's whole verdict for one config on one device: the `chosen` name (None:
    nothing fits), the `requested` name and who asked (`requested_by`: "argument" or the
    environment variable), every backend's verdict in priority order, and `hints`: settings
    that would make a backend fit (when nothing does)."""

    config: AttentionSelectorConfig
    device: DeviceInfo
    chosen: str | None
    requested: str | None
    requested_by: str | None
    verdicts: tuple[BackendVerdict, ...]
    hints: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, object]:
        config = {name: getattr(self.config, name) for name in self.config.__dataclass_fields__}
        config["dtype"] = str(config["dtype"]).removeprefix("torch.")
        config["attn_type"] = self.config.attn_type.value
        return {
            "device": str(self.device),
            "config": config,
            "chosen": self.chosen,
            "requested": self.requested,
            "requested_by": self.requested_by,
            "backends": [v.to_dict() for v in self.verdicts],
            "hints": list(self.hints),
        }

    def format_reasons(self) -> str:
        """One line per backend with its reasons, for error messages and logs."""
        lines = []
        for v in self.verdicts:
            verdict = "; ".join(v.why_not()) or "fits"
            if v.fits and v.not_automatic:
                verdict += f", taken only on request ({v.not_automatic})"
            lines.append(f"  {v.name}: {verdict}")
        return "\n".join(lines)

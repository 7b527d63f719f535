"""What the doctor reports: typed findings, each tied to a module and to a step of the article's checklist."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from trainfit.errors import TrainfitError
from trainfit.train.monitor import Check, Severity

__all__ = ["Check", "Direction", "DoctorError", "Finding", "FindingKind", "Severity"]


class DoctorError(TrainfitError):
    """The user's setup could not be loaded or run (bad ``module:function``, a factory or loss that raises)."""


class FindingKind(StrEnum):
    OVERFLOW = "overflow"  # values beyond the format's largest finite value
    UNDERFLOW = "underflow"  # values that flush to zero in the format
    NONFINITE = "nonfinite"  # the first module whose output or gradient became NaN/Inf
    SCALE_COLLAPSE = "scale-collapse"  # GradScaler's scale fell below 1 (or to 0)
    SCALE_DECLINE = "scale-decline"  # sustained decline / frequent skipped steps
    PRECISION = "precision"  # fp32 trains, the chosen precision does not
    LR = "lr"  # unstable at this learning rate, stable at a fraction of it
    CLIPPING = "clipping"  # unstable without clipping, stable with max_norm=1.0
    DATA = "data"  # NaN/Inf/extreme values in the batches


class Direction(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"


#: Which step of the article's troubleshooting order (§5.3) each kind of finding belongs to.
CHECK_OF: dict[FindingKind, Check] = {
    FindingKind.OVERFLOW: Check.PRECISION,
    FindingKind.UNDERFLOW: Check.PRECISION,
    FindingKind.NONFINITE: Check.PRECISION,
    FindingKind.SCALE_COLLAPSE: Check.PRECISION,
    FindingKind.SCALE_DECLINE: Check.PRECISION,
    FindingKind.PRECISION: Check.PRECISION,
    FindingKind.LR: Check.LEARNING_RATE,
    FindingKind.CLIPPING: Check.CLIPPING,
    FindingKind.DATA: Check.DATA,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    kind: FindingKind
    severity: Severity
    message: str
    advice: str = ""
    module: str | None = None
    direction: Direction | None = None
    step: int | None = None
    batch: int | None = None

    @property
    def check(self) -> Check:
        return CHECK_OF[self.kind]

    def to_json(self) -> dict[str, object]:
        return {
            "kind": self.kind.value,
            "severity": self.severity.value,
            "check": self.check.value,
            "module": self.module,
            "direction": self.direction.value if self.direction else None,
            "step": self.step,
            "batch": self.batch,
            "message": self.message,
            "advice": self.advice,
        }

"""StabilityMonitor: watch loss, gradient norm, loss scale and skipped steps; explain what goes wrong.

The monitor is fed one :class:`StepStats` per optimizer step (host floats) — by :class:`TrainStep`, by
the Hugging Face / Lightning callbacks, or by hand — and emits typed :class:`StabilityEvent` objects.
Each event carries advice in the article's troubleshooting order (§5.3): **precision** first (compare
with fp32), then the **learning rate** (halve it), then **clipping** (1.0), then the **data**
(NaN/Inf/outliers). The monitor module imports no torch; device tensors handed over by ``TrainStep``
are resolved in :meth:`StabilityMonitor.sync`, in one host transfer for all pending steps.

Detection rules (defaults in parentheses) and where they come from:

* **non-finite loss** — any NaN/Inf loss. Under fp16 autocast the loss is computed before scaling, so
  an inf loss means the *forward* overflowed, which loss scaling cannot fix (article §6.4).
* **non-finite gradient norm** on a step that was *not* skipped — the optimizer applied NaN/Inf
  gradients (bf16/fp32 have no scaler to catch them). With a scaler, non-finite gradients only skip the
  step; those are counted by the skip-rate rule instead.
* **loss / gradient-norm spikes** — robust z-score against the last ``window`` (100) finite values:
  value > median + z·1.4826·MAD (z = 6) and value > ratio·median (loss 1.5×, grad norm 5×), after
  ``min_history`` (20) values. The median/MAD pair is the standard robust estimate of location and
  scale (Hampel 1974; 1.4826 makes MAD consistent with σ for a normal distribution).
* **loss-scale collapse** — scale < 1 (``scale_collapse_below``). torch's ``GradScaler.update`` docs:
  "If the scale falls below 1 ... something is likely wrong"; the scaler has no floor, so after ~180
  consecutive overflows the scale is 0.0 and never recovers (DESIGN.md §4).
* **calibration** — ``GradScaler`` starts at 65536 (``init_scale``), halves the scale on every step with
  inf/NaN gradients and doubles it only after ``growth_interval`` (2000) consecutive clean steps. Until
  that first growth the scale has only ever gone down from its starting value: every skip is the scaler
  searching downwards for a scale at which the scaled gradients fit, interleaved with clean steps while
  the gradients fluctuate (a healthy MLP skips steps 0, 1, 3 and 4 and settles at 4096). So the monitor
  counts the run as *calibrating* until it has seen the scale grow, or ``growth_interval`` clean steps
  in a row (when GradScaler would grow it) — not merely until the first clean step. Skips while
  calibrating are not instability. The search is bounded: before any growth the scale is exactly
  ``init_scale / 2**skips``, so a run that keeps overflowing reaches scale < 1 after 17 skips from 65536
  and the collapse rule reports it; nothing is hidden for long. A monitor attached to a scaler restored
  from a checkpoint (already calibrated) should be built with ``calibrated=True``.
* **sustained loss-scale decline** — the article's warning sign (§3.3, "如果scale持续下降，说明训练不稳定").
  Once calibrated, a healthy run backs off at most about once per growth interval (the probe after
  each doubling); ``decline_backoffs`` (4) backoffs within ``window`` steps with a net decline is a
  sustained decline.
* **skip rate** — after calibration, ≥ ``skip_rate_threshold`` (10%) of the last ``window`` steps
  skipped (with at least ``min_history`` steps seen): the optimizer is silently not training.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from trainfit.errors import TrainfitError

log = logging.getLogger("trainfit.monitor")


class EventKind(StrEnum):
    NONFINITE_LOSS = "nonfinite-loss"
    NONFINITE_GRAD = "nonfinite-grad"
    LOSS_SPIKE = "loss-spike"
    GRAD_SPIKE = "grad-spike"
    SCALE_DECLINE = "scale-decline"
    SCALE_COLLAPSE = "scale-collapse"
    SKIP_RATE = "skip-rate"


class Severity(StrEnum):
    """How serious an event or a doctor finding is (one enum for the monitor and the doctor)."""

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class Check(StrEnum):
    """The article's troubleshooting steps (§5.3), in order."""

    PRECISION = "precision"
    LEARNING_RATE = "lr"
    CLIPPING = "clipping"
    DATA = "data"


CHECK_ORDER: tuple[Check, ...] = (Check.PRECISION, Check.LEARNING_RATE, Check.CLIPPING, Check.DATA)


@dataclass(frozen=True, slots=True, kw_only=True)
class Advice:
    check: Check
    order: int  # 1-based position in the article's troubleshooting order
    text: str
    applicable: bool = True  # False when already done (e.g. already fp32, already clipping at 1.0)

    def to_json(self) -> dict[str, object]:
        return {"check": self.check.value, "order": self.order, "text": self.text, "applicable": self.applicable}


@dataclass(frozen=True, slots=True, kw_only=True)
class StepStats:
    """What the monitor sees of one optimizer step; every field but ``step`` may be unknown (None)."""

    step: int
    loss: float | None = None
    grad_norm: float | None = None
    loss_scale: float | None = None
    skipped: bool | None = None
    lr: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class StabilityEvent:
    kind: EventKind
    severity: Severity
    step: int
    value: float
    threshold: float | None
    message: str
    advice: tuple[Advice, ...]

    def to_json(self) -> dict[str, object]:
        from trainfit.precision.formats import json_float

        return {
            "kind": self.kind.value,
            "severity": self.severity.value,
            "step": self.step,
            "value": json_float(self.value),
            "threshold": None if self.threshold is None else json_float(self.threshold),
            "message": self.message,
            "advice": [a.to_json() for a in self.advice],
        }

    def __str__(self) -> str:
        first = next((a for a in self.advice if a.applicable), None)
        hint = f" First check: {first.text}" if first else ""
        return f"[{self.severity.value}] step {self.step}: {self.message}.{hint}"


class InstabilityError(TrainfitError):
    """Raised by the monitor for event kinds listed in ``raise_on``."""

    def __init__(self, event: StabilityEvent) -> None:
        super().__init__(str(event))
        self.event = event


@dataclass(frozen=True, slots=True, kw_only=True)
class MonitorSummary:
    steps: int
    skipped_steps: int
    skip_rate: float
    calibration_steps: int  # steps skipped while the scaler was calibrating
    first_scale: float | None
    last_scale: float | None
    min_scale: float | None
    events: tuple[StabilityEvent, ...]
    #: the step at which calibration ended (the scale grew, or ``growth_interval`` clean steps in a row);
    #: None while still calibrating
    calibrated_at: int | None = None


def troubleshooting_advice(
    kind: EventKind,
    *,
    precision: str | None,
    lr: float | None,
    max_grad_norm: float | None,
    step: int,
) -> tuple[Advice, ...]:
    """Advice for an event in the article's order (§5.3): precision → learning rate → clipping → data."""
    half = precision is not None and precision not in ("fp32",)
    fp16 = precision is not None and "fp16" in precision
    if not half:
        prec = Advice(
            check=Check.PRECISION,
            order=1,
            text="the run is fp32, so half precision is not the cause"
            if precision == "fp32"
            else "rerun the same steps in fp32 from the same weights; if fp32 is stable, the cause is precision",
            applicable=precision != "fp32",
        )
    elif fp16:
        extra = (
            " The scale keeps falling: look for the layer that overflows (trainfit doctor), not at the "
            "scaler's settings (article §3.3); bf16 avoids it where the GPU supports bf16."
            if kind in (EventKind.SCALE_DECLINE, EventKind.SCALE_COLLAPSE, EventKind.SKIP_RATE)
            else " If fp32 is stable, watch scaler.get_scale() and find the overflowing layer (trainfit doctor)."
        )
        prec = Advice(
            check=Check.PRECISION,
            order=1,
            text="rerun a few hundred steps in fp32 from the same weights to see whether fp16 is the cause." + extra,
        )
    else:
        prec = Advice(
            check=Check.PRECISION,
            order=1,
            text="rerun a few hundred steps in fp32 from the same weights; if fp32 is stable, look for "
            "division by zero, log(0) and long low-precision accumulations (bf16 keeps only 8 bits).",
        )
    sensitive = "; mixed precision is more sensitive to it" if half else ""
    if lr is not None and lr > 0:
        lr_text = f"halve the learning rate ({lr:.3g} → {lr / 2:.3g}){sensitive}"
    else:
        lr_text = f"halve the learning rate{sensitive}"
    lr_advice = Advice(check=Check.LEARNING_RATE, order=2, text=lr_text)
    if max_grad_norm is None:
        # loss scaling only exists under fp16: fp32/bf16 runs get no scaler advice (unknown precision: a hint)
        when = (
            " after scaler.unscale_"
            if fp16
            else " (with fp16 loss scaling: after scaler.unscale_)"
            if precision is None
            else ""
        )
        clip = Advice(check=Check.CLIPPING, order=3, text=f"clip gradients at max_norm=1.0{when}")
    elif max_grad_norm > 1.0:
        clip = Advice(check=Check.CLIPPING, order=3, text=f"lower the clipping threshold from {max_grad_norm:g} to 1.0")
    else:
        clip = Advice(
            check=Check.CLIPPING,
            order=3,
            text=f"clipping is already at {max_grad_norm:g}",
            applicable=False,
        )
    data = Advice(
        check=Check.DATA,
        order=4,
        text=f"check the batches around step {step} for NaN/Inf and extreme values, and the preprocessing",
    )
    return (prec, lr_advice, clip, data)


def _robust_spike(value: float, history: Sequence[float], z: float, ratio: float) -> float | None:
    """Return the robust z-score if ``value`` is a spike against ``history``, else None."""
    med = statistics.median(history)
    mad = statistics.median(abs(h - med) for h in history)
    sigma = 1.4826 * mad
    if value <= ratio * med and med > 0:
        return None
    if sigma == 0:
        return math.inf if value > med and med > 0 and value > ratio * med else None
    score = (value - med) / sigma
    return score if score > z else None


@dataclass(slots=True)
class _Pending:
    step: int
    values: Any  # a 1-D device tensor [loss, grad_norm, found_inf, scale]
    has_grad_norm: bool
    has_scaler: bool
    lr: float | None


class StabilityMonitor:
    """Watches training health; see the module docstring for the rules and their sources.

    Args:
        window: steps of history the spike, decline and skip-rate rules look at.
        min_history: values needed before spike and skip-rate rules fire.
        check_every: ``TrainStep`` hands over device tensors; they are copied to the host together every
            ``check_every`` optimizer steps (one synchronisation per batch of steps, none per micro-step).
        on_event: called with each event (in addition to logging at WARNING/ERROR).
        raise_on: event kinds that raise :class:`InstabilityError` (e.g. ``{EventKind.NONFINITE_LOSS}``).
        history_limit: how many :class:`StepStats` to keep (None keeps all).
        growth_interval: the scaler's ``growth_interval`` (GradScaler's default 2000): calibration ends when
            the scale grows or after this many clean steps in a row.
        calibrated: the scaler has already calibrated (restored from a checkpoint): count every skip.
    """

    def __init__(
        self,
        *,
        window: int = 100,
        min_history: int = 20,
        check_every: int = 1,
        spike_zscore: float = 6.0,
        loss_spike_ratio: float = 1.5,
        grad_spike_ratio: float = 5.0,
        scale_collapse_below: float = 1.0,
        decline_backoffs: int = 4,
        skip_rate_threshold: float = 0.1,
        on_event: Callable[[StabilityEvent], None] | None = None,
        raise_on: Iterable[EventKind | str] = (),
        log_events: bool = True,
        history_limit: int | None = 100_000,
        growth_interval: int = 2000,
        calibrated: bool = False,
    ) -> None:
        if window < 2 or min_history < 2 or check_every < 1 or growth_interval < 1:
            raise ValueError("window and min_history must be >= 2, check_every and growth_interval >= 1")
        self.window = window
        self.min_history = min_history
        self.check_every = check_every
        self.spike_zscore = spike_zscore
        self.loss_spike_ratio = loss_spike_ratio
        self.grad_spike_ratio = grad_spike_ratio
        self.scale_collapse_below = scale_collapse_below
        self.decline_backoffs = decline_backoffs
        self.skip_rate_threshold = skip_rate_threshold
        self.growth_interval = growth_interval
        self.on_event = on_event
        self.raise_on = frozenset(EventKind(k) for k in raise_on)
        self.log_events = log_events
        # context for advice, set by TrainStep.attach / the callbacks
        self.precision: str | None = None
        self.max_grad_norm: float | None = None
        self.events: list[StabilityEvent] = []
        self.history: deque[StepStats] = deque(maxlen=history_limit)
        self._losses: deque[float] = deque(maxlen=window)
        self._grads: deque[float] = deque(maxlen=window)
        self._skips: deque[bool] = deque(maxlen=window)
        self._scales: deque[tuple[int, float]] = deque(maxlen=window + 1)
        self._backoffs: deque[int] = deque()
        self._last_emitted: dict[EventKind, int] = {}
        self._pending: list[_Pending] = []
        self._steps = 0
        self._skipped = 0
        self._calibrating = not calibrated
        self._calibrated_at: int | None = None
        self._calibration_steps = 0
        self._clean_streak = 0
        self._first_scale: float | None = None
        self._min_scale: float | None = None
        self._last_scale: float | None = None
        self._loss_was_finite = True
        self._zero_reported = False

    # ---------------------------------------------------------------- configuration
    def attach(self, *, precision: str | None = None, max_grad_norm: float | None = None) -> None:
        """Tell the monitor how the run is configured, so its advice can be specific."""
        self.precision = precision
        self.max_grad_norm = max_grad_norm

    @property
    def _fp16(self) -> bool:
        return self.precision is not None and "fp16" in self.precision

    # ---------------------------------------------------------------- device-side input
    def push(self, step: int, values: Any, *, has_grad_norm: bool, has_scaler: bool, lr: float | None) -> None:
        """Queue one optimizer step's device tensor ``[loss, grad_norm, found_inf, scale]`` (no sync)."""
        self._pending.append(_Pending(step, values, has_grad_norm, has_scaler, lr))
        if len(self._pending) >= self.check_every:
            self.sync()

    def sync(self) -> list[StabilityEvent]:
        """Copy all queued steps to the host in one transfer and run the rules on them."""
        if not self._pending:
            return []
        import torch

        pending, self._pending = self._pending, []
        rows = torch.stack([p.values for p in pending]).tolist()  # the one host synchronisation
        events: list[StabilityEvent] = []
        for p, (loss, grad_norm, found_inf, scale) in zip(pending, rows, strict=True):
            events += self.observe(
                StepStats(
                    step=p.step,
                    loss=loss,
                    grad_norm=grad_norm if p.has_grad_norm else None,
                    loss_scale=scale if p.has_scaler else None,
                    skipped=bool(found_inf > 0) if p.has_scaler else False,
                    lr=p.lr,
                )
            )
        return events

    # ---------------------------------------------------------------- host-side rules
    def observe(self, stats: StepStats) -> list[StabilityEvent]:
        """Run every rule on one step's stats; returns the new events (also kept in ``events``)."""
        self.history.append(stats)
        self._steps += 1
        events: list[StabilityEvent] = []
        s = stats.step
        self._update_calibration(stats)
        if stats.loss is not None:
            events += self._check_loss(s, stats.loss, stats.lr)
        if stats.grad_norm is not None:
            events += self._check_grad(s, stats.grad_norm, stats.skipped, stats.lr)
        if stats.skipped is not None:
            events += self._check_skips(s, stats.skipped, stats.lr)
        if stats.loss_scale is not None:
            events += self._check_scale(s, stats.loss_scale, stats.skipped, stats.lr)
        for event in events:
            self._emit(event)
        return events

    def _event(self, kind: EventKind, severity: Severity, step: int, value: float, threshold: float | None,
               message: str, lr: float | None) -> StabilityEvent | None:  # fmt: skip
        last = self._last_emitted.get(kind)
        if last is not None and step - last < self.window:
            return None
        self._last_emitted[kind] = step
        advice = troubleshooting_advice(
            kind, precision=self.precision, lr=lr, max_grad_norm=self.max_grad_norm, step=step
        )
        return StabilityEvent(
            kind=kind, severity=severity, step=step, value=value, threshold=threshold, message=message,
            advice=advice,
        )  # fmt: skip

    def _check_loss(self, step: int, loss: float, lr: float | None) -> list[StabilityEvent]:
        out: list[StabilityEvent] = []
        if not math.isfinite(loss):
            if self._loss_was_finite:
                self._last_emitted.pop(EventKind.NONFINITE_LOSS, None)  # a new streak always reports
            self._loss_was_finite = False
            why = " (loss scaling cannot fix a forward overflow)" if self._fp16 else ""
            ev = self._event(
                EventKind.NONFINITE_LOSS, Severity.ERROR, step, loss, None,
                f"loss is {loss} — the forward pass produced NaN/Inf{why}", lr,
            )  # fmt: skip
            return [ev] if ev else []
        self._loss_was_finite = True
        if len(self._losses) >= self.min_history:
            score = _robust_spike(loss, self._losses, self.spike_zscore, self.loss_spike_ratio)
            if score is not None:
                med = statistics.median(self._losses)
                ev = self._event(
                    EventKind.LOSS_SPIKE, Severity.WARNING, step, loss, med * self.loss_spike_ratio,
                    f"loss spiked to {loss:.4g} (median of the last {len(self._losses)} steps {med:.4g})", lr,
                )  # fmt: skip
                if ev:
                    out.append(ev)
        self._losses.append(loss)
        return out

    def _check_grad(self, step: int, norm: float, skipped: bool | None, lr: float | None) -> list[StabilityEvent]:
        if not math.isfinite(norm):
            if skipped:
                return []  # the scaler caught it; the skip-rate rule counts these
            ev = self._event(
                EventKind.NONFINITE_GRAD, Severity.ERROR, step, norm, None,
                f"gradient norm is {norm} and the optimizer step was applied — the weights are now corrupted",
                lr,
            )  # fmt: skip
            return [ev] if ev else []
        out: list[StabilityEvent] = []
        if len(self._grads) >= self.min_history:
            score = _robust_spike(norm, self._grads, self.spike_zscore, self.grad_spike_ratio)
            if score is not None:
                med = statistics.median(self._grads)
                ev = self._event(
                    EventKind.GRAD_SPIKE, Severity.WARNING, step, norm, med * self.grad_spike_ratio,
                    f"gradient norm spiked to {norm:.4g} (median {med:.4g})", lr,
                )  # fmt: skip
                if ev:
                    out.append(ev)
        self._grads.append(norm)
        return out

    def _update_calibration(self, stats: StepStats) -> None:
        """End calibration when the scaler has held a scale for a full growth interval: the scale grew
        (seen directly), or ``growth_interval`` clean steps in a row (when GradScaler grows it)."""
        if not self._calibrating:
            return
        grew = (
            stats.loss_scale is not None
            and self._last_scale is not None
            and stats.loss_scale > self._last_scale
            and not stats.skipped
        )
        if stats.skipped is not None:
            self._clean_streak = 0 if stats.skipped else self._clean_streak + 1
        if grew or self._clean_streak >= self.growth_interval:
            self._calibrating = False
            self._calibrated_at = stats.step

    def _check_skips(self, step: int, skipped: bool, lr: float | None) -> list[StabilityEvent]:
        if skipped:
            self._skipped += 1
        if self._calibrating:
            if skipped:
                self._calibration_steps += 1
            return []
        self._skips.append(skipped)
        if len(self._skips) < self.min_history:
            return []
        rate = sum(self._skips) / len(self._skips)
        if rate < self.skip_rate_threshold:
            return []
        ev = self._event(
            EventKind.SKIP_RATE, Severity.WARNING, step, rate, self.skip_rate_threshold,
            f"{rate:.0%} of the last {len(self._skips)} optimizer steps were skipped for inf/NaN gradients", lr,
        )  # fmt: skip
        return [ev] if ev else []

    def _check_scale(self, step: int, scale: float, skipped: bool | None, lr: float | None) -> list[StabilityEvent]:
        out: list[StabilityEvent] = []
        if self._first_scale is None:
            self._first_scale = scale
        prev = self._last_scale
        self._last_scale = scale
        self._min_scale = scale if self._min_scale is None else min(self._min_scale, scale)
        self._scales.append((step, scale))
        if scale < self.scale_collapse_below:
            never = ""
            if scale == 0 and not self._zero_reported:
                self._zero_reported = True
                self._last_emitted.pop(EventKind.SCALE_COLLAPSE, None)  # reaching 0 is always reported
                never = " It is 0 and can never grow back (GradScaler has no floor)."
            ev = self._event(
                EventKind.SCALE_COLLAPSE, Severity.ERROR, step, scale, self.scale_collapse_below,
                f"loss scale collapsed to {scale:.3g}: the gradients overflow at every scale, so loss "
                f"scaling is no longer doing anything.{never}", lr,
            )  # fmt: skip
            if ev:
                out.append(ev)
        if prev is not None and scale < prev and not self._calibrating:
            self._backoffs.append(step)
        while self._backoffs and step - self._backoffs[0] >= self.window:
            self._backoffs.popleft()
        start_scale = self._scales[0][1]
        if len(self._backoffs) >= self.decline_backoffs and scale < start_scale:
            ev = self._event(
                EventKind.SCALE_DECLINE, Severity.WARNING, step, scale, start_scale,
                f"loss scale fell {len(self._backoffs)} times in the last {self.window} steps "
                f"({start_scale:.3g} → {scale:.3g}): training is unstable — check the model or the data, "
                "not the scaler's parameters", lr,
            )  # fmt: skip
            if ev:
                out.append(ev)
        return out

    def _emit(self, event: StabilityEvent) -> None:
        self.events.append(event)
        if self.log_events:
            log.log(logging.ERROR if event.severity is Severity.ERROR else logging.WARNING, "%s", event)
        if self.on_event is not None:
            self.on_event(event)
        if event.kind in self.raise_on:
            raise InstabilityError(event)

    # ---------------------------------------------------------------- reporting
    def summary(self) -> MonitorSummary:
        self.sync()
        return MonitorSummary(
            steps=self._steps,
            skipped_steps=self._skipped,
            skip_rate=self._skipped / self._steps if self._steps else 0.0,
            calibration_steps=self._calibration_steps,
            calibrated_at=self._calibrated_at,
            first_scale=self._first_scale,
            last_scale=self._last_scale,
            min_scale=self._min_scale,
            events=tuple(self.events),
        )

    def kinds(self) -> set[EventKind]:
        return {e.kind for e in self.events}


__all__ = [
    "CHECK_ORDER",
    "Advice",
    "Check",
    "EventKind",
    "InstabilityError",
    "MonitorSummary",
    "Severity",
    "StabilityEvent",
    "StabilityMonitor",
    "StepStats",
    "troubleshooting_advice",
]

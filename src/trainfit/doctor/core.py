"""``trainfit doctor``: run the article's troubleshooting sequence (§5.3) automatically and explain it.

The sequence, for a model, its batches, a loss and an optimizer factory:

1. **Precision.** Train the same N steps from the same initial weights in fp32 and in the chosen
   precision; compare the loss curves. Scan activations and gradients per module against the format's
   limits (``scan.py``), locate the first module whose output or gradient turns NaN/Inf (``locate.py``),
   and read the loss-scale history.
2. **Learning rate.** If the chosen precision is unstable, rerun it with the learning rate halved, then
   quartered, then divided by eight; the first that is stable is the finding.
3. **Clipping.** Otherwise rerun with ``clip_grad_norm_(..., 1.0)``.
4. **Data.** Scan the batches for NaN/Inf, values beyond the format's range, outlier batches.

The diagnosis names the first check, in that order, that explains the instability; every check's
findings are reported regardless. A healthy run — fp32 and the chosen precision both train, nothing near
the format's limits, clean data — produces no findings.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from trainfit.doctor.data import BatchScan, scan_batches
from trainfit.doctor.findings import Direction, DoctorError, Finding, FindingKind, Severity
from trainfit.doctor.locate import Origin
from trainfit.doctor.runs import RunResult, RunSpec, run
from trainfit.doctor.scan import ModuleRange, TensorRole, range_scan
from trainfit.doctor.setup import DoctorSetup, load_setup
from trainfit.precision.formats import FloatFormat, get_format, json_float
from trainfit.strategy import Precision
from trainfit.train.monitor import CHECK_ORDER, Check, EventKind
from trainfit.train.step import resolve_precision

SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class DoctorConfig:
    precision: str = "auto"
    steps: int = 50
    loss_scaling: bool = True
    lr_halvings: int = 3
    clip_norm: float = 1.0
    scan_batches: int = 2
    seed: int = 0
    #: a module's tensor is reported as underflowing when this fraction of its non-zero values flush to 0
    underflow_fraction: float = 0.25
    #: the chosen precision "trains worse" when its loss improves by less than this fraction of fp32's
    progress_ratio: float = 0.5

    def __post_init__(self) -> None:
        if self.steps < 2:
            raise DoctorError("--steps must be at least 2")
        if self.scan_batches < 1:
            raise DoctorError("scan_batches must be at least 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class ScalePoint:
    step: int
    scale: float
    skipped: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class DoctorReport:
    precision: Precision
    format: FloatFormat
    steps: int
    device: str
    loss_scaling: bool
    reference: RunResult
    run: RunResult
    remedies: tuple[RunResult, ...]
    scan: tuple[ModuleRange, ...]
    grad_scale: float
    data: tuple[BatchScan, ...]
    forward_origin: Origin | None
    backward_origin: Origin | None
    scale_history: tuple[ScalePoint, ...]
    findings: tuple[Finding, ...]
    cause: Check | None
    diagnosis: str
    notes: tuple[str, ...] = field(default=())

    def kinds(self) -> set[FindingKind]:
        return {f.kind for f in self.findings}

    def to_json(self) -> dict[str, object]:
        return {
            "schema_version": SCHEMA_VERSION,
            "precision": self.precision.value,
            "format": self.format.id,
            "steps": self.steps,
            "device": self.device,
            "loss_scaling": self.loss_scaling,
            "cause": self.cause.value if self.cause else None,
            "diagnosis": self.diagnosis,
            "findings": [f.to_json() for f in self.findings],
            "runs": [r.to_json() for r in (self.reference, self.run, *self.remedies)],
            "scan": {"grad_scale": self.grad_scale, "rows": [r.to_json() for r in self.scan]},
            "nonfinite": {
                "forward": self.forward_origin.to_json() if self.forward_origin else None,
                "backward": self.backward_origin.to_json() if self.backward_origin else None,
            },
            "data": [b.to_json() for b in self.data],
            "loss_scale_history": [
                {"step": p.step, "scale": json_float(p.scale), "skipped": p.skipped} for p in self.scale_history
            ],
            "notes": list(self.notes),
        }


def _materialise(batches: Any, steps: int) -> tuple[list[Any], list[Any]]:
    """(the distinct batches, up to ``steps``; one batch per step, cycling through them)."""
    first = list(itertools.islice(iter(batches), steps))
    if not first:
        raise DoctorError("the setup's batches are empty")
    return first, [first[i % len(first)] for i in range(steps)]


def _choose_precision(name: str, device: torch.device) -> tuple[Precision, tuple[str, ...]]:
    if name == "auto":
        p = resolve_precision("auto", device)
        if p is Precision.FP32:
            return Precision.AMP_FP16, (
                "no GPU: checking amp-fp16, the narrowest recipe (what a GPU without bf16 would run)",
            )
        return p, ()
    p = resolve_precision(name, device)
    if p is Precision.FP32:
        raise DoctorError(
            "the doctor compares a half-precision recipe with fp32; choose amp-fp16, amp-bf16 or pure-bf16"
        )
    return p, ()


def _scan_findings(
    rows: Sequence[ModuleRange], fmt: FloatFormat, cfg: DoctorConfig, loss_scaling: bool
) -> list[Finding]:
    out: list[Finding] = []
    for r in rows:
        if r.role is TensorRole.ACTIVATION:
            if r.overflow:
                out.append(
                    Finding(
                        kind=FindingKind.OVERFLOW,
                        severity=Severity.ERROR,
                        module=r.module,
                        direction=Direction.FORWARD,
                        message=f"{r.overflow_fraction:.2%} of {r.module}'s outputs exceed {fmt.id}'s range "
                        f"(absmax {r.absmax:.4g} ≥ {fmt.overflow_threshold:.6g}); cast to {fmt.id} they become inf",
                        advice=f"keep this layer's values inside {fmt.id}: rescale its weights/inputs or add a "
                        "normalisation before it, run it outside autocast (torch.autocast(..., enabled=False)) or "
                        "use bf16 where the GPU supports it",
                    )
                )
            elif r.headroom_binades < 1:
                out.append(
                    Finding(
                        kind=FindingKind.OVERFLOW,
                        severity=Severity.WARNING,
                        module=r.module,
                        direction=Direction.FORWARD,
                        message=f"{r.module}'s outputs reach {r.absmax:.4g}, within 2× of {fmt.id}'s maximum "
                        f"{fmt.max_finite:.6g}",
                        advice="training can push them over; watch this layer",
                    )
                )
            if r.nonzero and r.flush_fraction >= cfg.underflow_fraction:
                out.append(
                    Finding(
                        kind=FindingKind.UNDERFLOW,
                        severity=Severity.WARNING,
                        module=r.module,
                        direction=Direction.FORWARD,
                        message=f"{r.flush_fraction:.0%} of {r.module}'s non-zero outputs flush to 0 in {fmt.id} "
                        f"(below {fmt.flush_threshold:.3g})",
                        advice="these values vanish when cast; anything that divides by or takes a root/log of them "
                        "produces inf",
                    )
                )
            continue
        what = "output gradients" if r.role is TensorRole.ACTIVATION_GRAD else "parameter gradients"
        if r.overflow_unscaled:
            out.append(
                Finding(
                    kind=FindingKind.OVERFLOW,
                    severity=Severity.ERROR,
                    module=r.module,
                    direction=Direction.BACKWARD,
                    message=f"{r.module}'s {what} exceed {fmt.id}'s range even without loss scaling "
                    f"(absmax {r.absmax:.4g})",
                    advice="loss scaling cannot fix an overflow (article §6.4): clip gradients at 1.0, lower the "
                    "learning rate or fix the layer's scale",
                )
            )
        if r.nonzero and r.flush_fraction >= cfg.underflow_fraction:
            at = f"at loss scale {r.scale:g}" if r.scale != 1.0 else "without loss scaling"
            out.append(
                Finding(
                    kind=FindingKind.UNDERFLOW,
                    severity=Severity.ERROR if r.flush_fraction > 0.9 else Severity.WARNING,
                    module=r.module,
                    direction=Direction.BACKWARD,
                    message=f"{r.flush_fraction:.0%} of {r.module}'s non-zero {what} flush to 0 in {fmt.id} {at} "
                    f"(|g| ≤ {fmt.flush_threshold / r.scale:.3g})",
                    advice="enable dynamic loss scaling (torch.amp.GradScaler)"
                    if r.scale == 1.0 and not loss_scaling
                    else "the loss scale is too low for these gradients; find what keeps pushing it down",
                )
            )
    return out


def _data_findings(data: Sequence[BatchScan], fmt: FloatFormat) -> list[Finding]:
    out: list[Finding] = []
    for b in data:
        if b.nan or b.inf:
            out.append(
                Finding(
                    kind=FindingKind.DATA,
                    severity=Severity.ERROR,
                    batch=b.index,
                    step=b.index,
                    message=f"batch {b.index} contains {b.nan} NaN and {b.inf} Inf values",
                    advice="fix or filter the data pipeline; one NaN input poisons every weight it touches",
                )
            )
        if b.beyond_format:
            out.append(
                Finding(
                    kind=FindingKind.DATA,
                    severity=Severity.WARNING,
                    batch=b.index,
                    step=b.index,
                    message=f"batch {b.index} has {b.beyond_format} values beyond {fmt.id}'s range "
                    f"(absmax {b.absmax:.4g})",
                    advice="normalise inputs; they overflow when autocast casts them",
                )
            )
        if b.outlier:
            out.append(
                Finding(
                    kind=FindingKind.DATA,
                    severity=Severity.WARNING,
                    batch=b.index,
                    step=b.index,
                    message=f"batch {b.index} is an outlier (absmax {b.absmax:.4g}, >100× the typical batch)",
                    advice="check this batch and the preprocessing",
                )
            )
    return out


def _forward_origin(result: RunResult) -> Origin | None:
    """The first forward origin before the weights were damaged (later ones are consequences)."""
    limit = result.corrupted_from
    valid = [o for o in result.forward_origins if limit is None or o.step < limit]
    return valid[0] if valid else None


def _backward_origin(result: RunResult) -> Origin | None:
    """The first non-finite gradient that matters: at a step whose loss was finite (else the forward is to
    blame), before the weights were damaged, and — with a scaler — after the opening calibration overflows."""
    limit = result.corrupted_from
    origins = [
        o for o in result.backward_origins if math.isfinite(result.losses[o.step]) and (limit is None or o.step < limit)
    ]
    if not origins:
        return None
    if not any(s is not None for s in result.scales):
        return origins[0]
    calibration = next((i for i, s in enumerate(result.skipped) if not s), len(result.skipped))
    if calibration == len(result.skipped):  # never left calibration: every step overflows
        return origins[0]
    troubled = {e.kind for e in result.events} & {
        EventKind.SCALE_COLLAPSE,
        EventKind.SCALE_DECLINE,
        EventKind.SKIP_RATE,
    }
    later = [o for o in origins if o.step >= calibration]
    return later[0] if later and (troubled or not result.health.stable) else None


def _trains_worse(ref: RunResult, res: RunResult, ratio: float) -> bool:
    p32, p = ref.health.progress, res.health.progress
    return ref.health.stable and p32 > 0 and p < ratio * p32


def diagnose(setup: DoctorSetup, config: DoctorConfig | None = None) -> DoctorReport:
    """Run the troubleshooting sequence on ``setup`` and return the report."""
    cfg = config or DoctorConfig()
    pristine = copy.deepcopy(setup.model)
    first = next(iter(pristine.parameters()), None)
    if first is None:
        raise DoctorError("the model has no parameters")
    device = first.device
    precision, notes = _choose_precision(cfg.precision, device)
    fmt = get_format("fp16" if precision is Precision.AMP_FP16 else "bf16")
    distinct, batches = _materialise(setup.batches, cfg.steps)

    data = scan_batches(distinct, fmt)
    ref = run(
        setup, pristine, batches, RunSpec(label="fp32", precision=Precision.FP32, track_nonfinite=True), seed=cfg.seed
    )
    res = run(
        setup,
        pristine,
        batches,
        RunSpec(label=precision.value, precision=precision, track_nonfinite=True, loss_scaling=cfg.loss_scaling),
        seed=cfg.seed,
    )
    grad_scale = res.settled_scale if precision is Precision.AMP_FP16 and cfg.loss_scaling else 1.0
    scan_model = copy.deepcopy(pristine).float()
    try:
        scan = range_scan(scan_model, batches[: cfg.scan_batches], setup.loss_fn, fmt, grad_scale=grad_scale)
    except Exception as exc:
        raise DoctorError(f"the range scan's forward/backward raised {type(exc).__name__}: {exc}") from exc

    worse = _trains_worse(ref, res, cfg.progress_ratio)
    unstable = not res.health.stable or worse
    remedies: list[RunResult] = []
    lr_fix: RunResult | None = None
    clip_fix: RunResult | None = None
    # A lower lr or clipping can calm a blow-up, not make a stalled run train; and a loss that is already
    # NaN/Inf at step 0 comes from the initial weights, before either has acted.
    at_start = res.health.first_nonfinite_step == 0
    if at_start:
        notes = (*notes, "the loss is NaN/Inf at step 0, before any update: lr and clipping runs skipped")
    if not res.health.stable and not at_start:
        for k in range(1, cfg.lr_halvings + 1):
            r = run(
                setup,
                pristine,
                batches,
                RunSpec(
                    label=f"{precision.value}, lr/{2**k}",
                    precision=precision,
                    lr_factor=0.5**k,
                    loss_scaling=cfg.loss_scaling,
                ),
                seed=cfg.seed,
            )
            remedies.append(r)
            if r.health.stable:
                lr_fix = r
                break
        if lr_fix is None:
            r = run(
                setup,
                pristine,
                batches,
                RunSpec(
                    label=f"{precision.value}, clip {cfg.clip_norm:g}",
                    precision=precision,
                    max_grad_norm=cfg.clip_norm,
                    loss_scaling=cfg.loss_scaling,
                ),
                seed=cfg.seed,
            )
            remedies.append(r)
            if r.health.stable:
                clip_fix = r

    findings: list[Finding] = []
    # 1. precision
    fwd = _forward_origin(res)
    bwd = _backward_origin(res)
    scan_findings = _scan_findings(scan, fmt, cfg, cfg.loss_scaling)
    located = fwd or bwd
    culprit = (
        located.module if located else next((f.module for f in scan_findings if f.severity is Severity.ERROR), None)
    )
    if ref.health.stable and unstable:
        how = (
            res.health.problem()
            if not res.health.stable
            else (f"it barely trains (loss {res.health.start_loss:.4g} → {res.health.end_loss:.4g})")
        )
        findings.append(
            Finding(
                kind=FindingKind.PRECISION,
                severity=Severity.ERROR,
                module=culprit,
                message=f"fp32 trains from the same weights (loss {ref.health.start_loss:.4g} → "
                f"{ref.health.end_loss:.4g}) but in {precision.value} {how}",
                advice="the cause is the number format: see the overflow/underflow/nonfinite findings for where",
            )
        )
    findings += scan_findings
    for origin, run_label in ((fwd, precision.value), (bwd, precision.value)):
        if origin is None:
            continue
        findings.append(
            Finding(
                kind=FindingKind.NONFINITE,
                severity=Severity.ERROR,
                module=origin.module,
                direction=origin.direction,
                step=origin.step,
                message=f"first {origin.what} in {run_label}: {origin.module}'s "
                f"{'output' if origin.direction is Direction.FORWARD else origin.where.value.replace('-', ' ')} "
                f"at step {origin.step} ({origin.direction.value}), with finite inputs",
                advice="this is where values leave the format's range first",
            )
        )
    ref_fwd = _forward_origin(ref)
    if not ref.health.stable and ref_fwd is not None and fwd is None:
        o = ref_fwd
        findings.append(
            Finding(
                kind=FindingKind.NONFINITE,
                severity=Severity.ERROR,
                module=o.module,
                direction=o.direction,
                step=o.step,
                message=f"first {o.what} in fp32: {o.module}'s output at step {o.step}",
            )
        )
    nonfinite_loss_steps = [i for i, x in enumerate(res.losses) if not math.isfinite(x)]
    if nonfinite_loss_steps and fwd is None:
        s = nonfinite_loss_steps[0]
        b = data[s % len(data)]
        if b.nan == 0 and b.inf == 0 and (res.corrupted_from is None or s < res.corrupted_from):
            findings.append(
                Finding(
                    kind=FindingKind.NONFINITE,
                    severity=Severity.ERROR,
                    module="(loss function)",
                    direction=Direction.FORWARD,
                    step=s,
                    message=f"the loss is NaN/Inf at step {s} although every module's output was finite",
                    advice="look for log(0), division by zero or overflow inside the loss computation",
                )
            )
    kinds = {e.kind for e in res.events}
    if EventKind.SCALE_COLLAPSE in kinds:
        ev = next(e for e in res.events if e.kind is EventKind.SCALE_COLLAPSE)
        findings.append(
            Finding(
                kind=FindingKind.SCALE_COLLAPSE,
                severity=Severity.ERROR,
                step=ev.step,
                module=bwd.module if bwd else None,
                message=ev.message,
                advice="gradients overflow at every scale: find the layer (nonfinite/underflow findings), don't tune "
                "the scaler (article §3.3)",
            )
        )
    elif kinds & {EventKind.SCALE_DECLINE, EventKind.SKIP_RATE}:
        ev = next(e for e in res.events if e.kind in (EventKind.SCALE_DECLINE, EventKind.SKIP_RATE))
        findings.append(
            Finding(
                kind=FindingKind.SCALE_DECLINE,
                severity=Severity.WARNING,
                step=ev.step,
                module=bwd.module if bwd else None,
                message=ev.message,
                advice="a falling loss scale is the article's warning sign (§3.3): check the model or the data",
            )
        )
    # 2. learning rate, 3. clipping
    if lr_fix is not None:
        findings.append(
            Finding(
                kind=FindingKind.LR,
                severity=Severity.ERROR if not ref.health.stable else Severity.WARNING,
                message=f"unstable at lr={res.lr:.3g} ({res.health.problem()}); stable at lr={lr_fix.lr:.3g} "
                f"({lr_fix.spec.label})",
                advice=f"lower the learning rate to {lr_fix.lr:.3g} or below (or warm it up)",
            )
        )
    if clip_fix is not None:
        findings.append(
            Finding(
                kind=FindingKind.CLIPPING,
                severity=Severity.ERROR if not ref.health.stable else Severity.WARNING,
                message=f"unstable without clipping ({res.health.problem()}); stable with max_norm={cfg.clip_norm:g}",
                advice=f"clip gradients: clip_grad_norm_(params, {cfg.clip_norm:g}) after scaler.unscale_",
            )
        )
    # 4. data
    findings += _data_findings(data, fmt)

    cause = _cause(ref, res, unstable, lr_fix, clip_fix, findings)
    diagnosis = _diagnosis(cause, precision, ref, res, lr_fix, clip_fix, findings, cfg.loss_scaling)
    history = tuple(
        ScalePoint(step=i, scale=s, skipped=bool(k))
        for i, (s, k) in enumerate(zip(res.scales, res.skipped, strict=True))
        if s is not None
    )
    return DoctorReport(
        precision=precision,
        format=fmt,
        steps=cfg.steps,
        device=str(device),
        loss_scaling=cfg.loss_scaling,
        reference=ref,
        run=res,
        remedies=tuple(remedies),
        scan=tuple(scan),
        grad_scale=grad_scale,
        data=tuple(data),
        forward_origin=fwd,
        backward_origin=bwd,
        scale_history=history,
        findings=tuple(sorted(findings, key=lambda f: (CHECK_ORDER.index(f.check), f.severity is not Severity.ERROR))),
        cause=cause,
        diagnosis=diagnosis,
        notes=notes,
    )


def _cause(
    ref: RunResult,
    res: RunResult,
    unstable: bool,
    lr_fix: RunResult | None,
    clip_fix: RunResult | None,
    findings: Sequence[Finding],
) -> Check | None:
    """The first check, in the article's order, that explains the instability."""
    data_errors = [f for f in findings if f.kind is FindingKind.DATA and f.severity is Severity.ERROR]
    if not unstable and ref.health.stable:
        return Check.DATA if data_errors else None
    if ref.health.stable and unstable:
        return Check.PRECISION
    if lr_fix is not None:
        return Check.LEARNING_RATE
    if clip_fix is not None:
        return Check.CLIPPING
    if data_errors or any(f.kind is FindingKind.DATA for f in findings):
        return Check.DATA
    return None


def _diagnosis(
    cause: Check | None,
    precision: Precision,
    ref: RunResult,
    res: RunResult,
    lr_fix: RunResult | None,
    clip_fix: RunResult | None,
    findings: Sequence[Finding],
    loss_scaling: bool,
) -> str:
    p = precision.value
    where = [
        f
        for f in findings
        if f.module
        and f.kind in (FindingKind.OVERFLOW, FindingKind.NONFINITE, FindingKind.UNDERFLOW)
        and f.severity is Severity.ERROR
    ]
    if cause is None and not findings:
        return (
            f"Healthy: fp32 and {p} both train from the same weights (fp32 {ref.health.start_loss:.4g} → "
            f"{ref.health.end_loss:.4g}, {p} {res.health.start_loss:.4g} → {res.health.end_loss:.4g}); no "
            "activation or gradient is near the format's limits and the batches are clean."
        )
    if cause is Check.PRECISION:
        text = f"Precision is the cause: fp32 trains, {p} does not ({res.health.problem() if not res.health.stable else 'it barely trains'})."  # noqa: E501
        if where:
            first = where[0]
            text += f" It starts at {first.module}: {first.message}."
        if any(f.kind is FindingKind.SCALE_COLLAPSE for f in findings):
            text += " The loss scale collapsed, so loss scaling has stopped working."
        if lr_fix is not None:
            text += f" Lowering the learning rate to {lr_fix.lr:.3g} also stabilises it."
        underflow = any(f.kind is FindingKind.UNDERFLOW and f.severity is Severity.ERROR for f in findings)
        if "fp16" in p and underflow and not loss_scaling:
            text += (
                " Gradients vanish in fp16 without loss scaling: enable dynamic loss scaling (torch.amp.GradScaler)."
            )
        elif "fp16" in p:
            text += " Fix the layer, or use bf16 (same range as fp32) on a GPU that supports it."
        return text
    if cause is Check.LEARNING_RATE and lr_fix is not None:
        return (
            f"The learning rate is the cause: fp32 is unstable too ({ref.health.problem()}), so it is not "
            f"precision; at lr={lr_fix.lr:.3g} instead of {res.lr:.3g} training is stable. Halve the learning "
            "rate until it is (article §5.3, step 2)."
        )
    if cause is Check.CLIPPING:
        return (
            "Gradient clipping is missing: fp32 is unstable too, lowering the learning rate does not help, and "
            "clipping the gradient norm at 1.0 makes training stable (article §5.3, step 3)."
        )
    if cause is Check.DATA:
        bad = [f for f in findings if f.kind is FindingKind.DATA]
        return (
            (
                f"The data is the cause: {bad[0].message}. fp32 fails the same way, and neither a lower learning "
                "rate nor clipping helps (article §5.3, step 4)."
            )
            if not ref.health.stable or not res.health.stable
            else f"Training is stable, but the data needs attention: {bad[0].message}."
        )
    if findings:
        return "No instability in these steps, but: " + "; ".join(f.message for f in findings[:3]) + "."
    return (
        f"Unexplained: fp32 {'is' if ref.health.stable else 'is not'} stable and {p} "
        f"{'is' if res.health.stable else 'is not'}; none of a lower learning rate, clipping or the data "
        "explains it."
    )


def diagnose_target(target: str, config: DoctorConfig | None = None) -> DoctorReport:
    """Load ``module.py:function`` and diagnose it."""
    return diagnose(load_setup(target), config)

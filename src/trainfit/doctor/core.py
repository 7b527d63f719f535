"""``trainfit doctor``: run the article's troubleshooting sequence (§5.3) automatically and explain it.

The sequence, for a model, its batches, a loss and an optimizer factory:

1. **Precision.** Train the same N steps from the same initial weights in fp32 and in the chosen
   precision; compare the loss curves. Scan activations, weights and gradients per module against the
   format's limits (``scan.py``), locate the first module whose output or gradient turns NaN/Inf
   (``locate.py``), and read the loss-scale history.
2. **Learning rate.** If the chosen precision is unstable, rerun it with the learning rate halved, then
   quartered, then divided by eight; the first that is stable is the finding.
3. **Clipping.** Otherwise rerun with ``clip_grad_norm_(..., 1.0)``.
4. **Data.** Scan the batches for NaN/Inf, values beyond the format's range, outlier batches.

The diagnosis names the first check, in that order, that explains the instability; every check's
findings are reported regardless. When fp32 fails too, the batches are clean and nothing tried makes
training stable, the learning rate is still named — by elimination, saying that even lr/8 did not help —
unless the loss is already NaN/Inf at step 0 (then no update has acted yet).

**Which module.** The headline names the module a user has to fix: the first, in execution order, whose
*own* computation leaves the format's range — forward before backward within a step; in backward, the
module whose backward *made* the out-of-range gradient (``graph.py``: the gradient of M's output is made
by M's consumer), not the module where it was first seen. Values that are out of range only because an
out-of-range input or gradient came in are consequences and are not findings (they stay in the scan).

**Near the limits.** A tensor is *near* the format's largest value when its magnitude is within
``near_binades`` (2) powers of two of it — two doublings (of the weights' scale, of the inputs' scale)
from overflow; the scan measures the initial weights, and training moves them. Gradients are judged
unscaled (the loss scaler keeps the scaled ones near the limit on purpose). Near tensors are warnings; a
healthy report states the margin and the closest tensor.

A healthy run — fp32 and the chosen precision both stable, nothing out of range or near it, clean data —
produces no findings.
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
from trainfit.doctor.findings import Direction, DoctorError, Finding, FindingKind
from trainfit.doctor.locate import Origin, Where
from trainfit.doctor.runs import RunResult, RunSpec, initial_loss, run
from trainfit.doctor.scan import ModuleRange, TensorRole, range_scan
from trainfit.doctor.setup import DoctorSetup, load_setup
from trainfit.precision.formats import FloatFormat, get_format, json_float
from trainfit.result import SCHEMA_VERSION
from trainfit.strategy import Precision
from trainfit.train.monitor import CHECK_ORDER, Check, EventKind, Severity
from trainfit.train.step import resolve_precision

#: what ``--precision`` accepts: the doctor compares a half-precision recipe with fp32
PRECISION_CHOICES: tuple[str, ...] = ("auto", "amp-fp16", "amp-bf16", "pure-bf16")


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
    #: "near the limit": within this many powers of two of the format's largest finite value
    near_binades: float = 2.0

    def __post_init__(self) -> None:
        if self.steps < 2:
            raise DoctorError("--steps must be at least 2")
        if self.scan_batches < 1:
            raise DoctorError("scan_batches must be at least 1")
        if self.lr_halvings < 1:
            raise DoctorError("lr_halvings must be at least 1")
        if not self.near_binades > 0:
            raise DoctorError("near_binades must be positive")


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
    #: the module the diagnosis names (None when it names none)
    culprit: str | None = None
    start_loss: float = math.nan
    near_binades: float = 2.0
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
            "culprit": self.culprit,
            "diagnosis": self.diagnosis,
            "start_loss": json_float(self.start_loss),
            "near_binades": self.near_binades,
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
    if name == Precision.FP32.value:
        raise DoctorError(
            "the doctor compares a half-precision recipe with fp32; choose amp-fp16, amp-bf16 or pure-bf16"
        )
    if name not in PRECISION_CHOICES:
        raise DoctorError(f"unknown precision '{name}'; choose one of: {', '.join(PRECISION_CHOICES)}")
    if name == "auto":
        p = resolve_precision("auto", device)
        if p is Precision.FP32:
            return Precision.AMP_FP16, (
                "no GPU: checking amp-fp16, the narrowest recipe (what a GPU without bf16 would run)",
            )
        return p, ()
    return resolve_precision(name, device), ()


def _lr(x: float | None) -> str:
    return "?" if x is None else f"{x:.3g}"


def _near_forward(r: ModuleRange, what: str, fmt_id: str, margin: str) -> Finding:
    """A forward tensor (a module's weights or outputs) within the near-limit margin of the format's maximum."""
    return Finding(
        kind=FindingKind.OVERFLOW,
        severity=Severity.WARNING,
        module=r.module,
        direction=Direction.FORWARD,
        message=f"{r.module}'s {what} reach {r.absmax:.4g}, {_pow2(r.headroom_binades)} below "
        f"{fmt_id}'s maximum ({margin} counts as near)",
        advice="training can push them over; watch this layer",
    )


def _pow2(h: float) -> str:
    return f"{h:.1f} powers of two"


def _describe_row(r: ModuleRange) -> str:
    if r.role is TensorRole.WEIGHT:
        return f"{r.module}'s weights"
    if r.role is TensorRole.ACTIVATION:
        return f"{r.module}'s outputs"
    if r.role is TensorRole.PARAM_GRAD:
        return f"{r.module}'s parameter gradients"
    return f"the gradient of {r.module}'s output"


def _headroom(r: ModuleRange) -> float:
    """Distance to the format's largest value, in powers of two (gradients: unscaled)."""
    return r.headroom_unscaled_binades if r.role.is_gradient else r.headroom_binades


class _Incoming:
    """Whether the gradient a module *received* (the gradient of its output) was already out of range: then
    an out-of-range gradient it makes is a consequence, not an origin."""

    def __init__(self, rows: Sequence[ModuleRange], near_binades: float) -> None:
        self.grad = {r.module: r for r in rows if r.role is TensorRole.ACTIVATION_GRAD}
        self.near_binades = near_binades

    def overflows(self, r: ModuleRange) -> bool:
        g = self.grad.get(r.produced_by or r.module)
        return g is not None and g is not r and g.overflow_unscaled > 0

    def near(self, r: ModuleRange) -> bool:
        g = self.grad.get(r.produced_by or r.module)
        return g is not None and g is not r and g.headroom_unscaled_binades < self.near_binades


def _scan_findings(
    rows: Sequence[ModuleRange], fmt: FloatFormat, cfg: DoctorConfig, precision: Precision, loss_scaling: bool
) -> list[Finding]:
    out: list[Finding] = []
    near = cfg.near_binades
    margin = f"within {near:g} powers of two ({2**near:g}×) of {fmt.id}'s largest value {fmt.max_finite:.6g}"
    fp16 = fmt.id == "fp16"
    incoming = _Incoming(rows, near)
    cast = (
        "the whole model is bf16"
        if precision is Precision.PURE_BF16
        else f"autocast casts the weights of matmul-type layers (Linear, Conv, …) to {fmt.id} for every forward"
    )
    forward = [r for r in rows if not r.role.is_gradient]
    backward = sorted(
        (r for r in rows if r.role.is_gradient),
        key=lambda r: r.backward_rank if r.backward_rank is not None else math.inf,
    )
    for r in forward:
        if r.role is TensorRole.WEIGHT:
            if r.overflow:
                out.append(
                    Finding(
                        kind=FindingKind.OVERFLOW,
                        severity=Severity.ERROR,
                        module=r.module,
                        direction=Direction.FORWARD,
                        message=f"{r.overflow_fraction:.2%} of {r.module}'s weights exceed {fmt.id}'s range (absmax "
                        f"{r.absmax:.4g} ≥ {fmt.overflow_threshold:.6g}); {cast}, where they become inf",
                        advice="a weight this large is usually an initialisation or loading bug: rescale the layer, or "
                        "run it outside autocast (torch.autocast(..., enabled=False))",
                    )
                )
            elif r.headroom_binades < near:
                out.append(_near_forward(r, "weights", fmt.id, margin))
            continue
        # activations: an origin only if the module's own inputs were within range (else a consequence)
        inputs_over = r.input_absmax >= fmt.overflow_threshold
        if r.overflow and not inputs_over:
            out.append(
                Finding(
                    kind=FindingKind.OVERFLOW,
                    severity=Severity.ERROR,
                    module=r.module,
                    direction=Direction.FORWARD,
                    message=f"{r.overflow_fraction:.2%} of {r.module}'s outputs exceed {fmt.id}'s range "
                    f"(absmax {r.absmax:.4g} ≥ {fmt.overflow_threshold:.6g}, from inputs within range); cast to "
                    f"{fmt.id} they become inf",
                    advice=f"keep this layer's values inside {fmt.id}: rescale its weights/inputs or add a "
                    "normalisation before it, run it outside autocast (torch.autocast(..., enabled=False)) or "
                    "use bf16 where the GPU supports it",
                )
            )
        elif not r.overflow and r.headroom_binades < near and not inputs_over:
            in_headroom = math.log2(fmt.max_finite / r.input_absmax) if r.input_absmax > 0 else math.inf
            if in_headroom >= near:  # else the values came in near the limit: a consequence
                out.append(_near_forward(r, "outputs", fmt.id, margin))
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
    for r in backward:
        producer = r.produced_by or r.module
        what = _describe_row(r)
        if r.overflow_unscaled and not incoming.overflows(r):
            fix = (
                "loss scaling cannot fix an overflow (article §6.4): " if fp16 else ""
            ) + f"fix the scale of {producer}'s weights or inputs, clip gradients at 1.0 or lower the learning rate"
            out.append(
                Finding(
                    kind=FindingKind.OVERFLOW,
                    severity=Severity.ERROR,
                    module=producer,
                    direction=Direction.BACKWARD,
                    message=f"{what} exceed{'s' if r.role is TensorRole.ACTIVATION_GRAD else ''} {fmt.id}'s range "
                    f"even without loss scaling (absmax {r.absmax:.4g}); {producer}'s backward makes "
                    f"{'it' if r.role is TensorRole.ACTIVATION_GRAD else 'them'} from gradients within range",
                    advice=fix,
                )
            )
        elif not r.overflow_unscaled and _headroom(r) < near and not incoming.near(r):
            out.append(
                Finding(
                    kind=FindingKind.OVERFLOW,
                    severity=Severity.WARNING,
                    module=producer,
                    direction=Direction.BACKWARD,
                    message=f"{what} reach {r.absmax:.4g} without loss scaling, {_pow2(_headroom(r))} below "
                    f"{fmt.id}'s maximum ({margin} counts as near); {producer}'s backward makes them",
                    advice="training can push them over"
                    + ("; the loss scale cannot go above 1 for long" if fp16 and loss_scaling else ""),
                )
            )
        if r.nonzero and r.flush_fraction >= cfg.underflow_fraction:
            at = f"at loss scale {r.scale:g}" if r.scale != 1.0 else "without loss scaling"
            if not fp16:
                advice = (
                    f"{fmt.id} has fp32's exponent range: gradients this small mean a vanishing signal (check the "
                    "loss's scale and the layer's initialisation), not a format problem"
                )
            elif r.scale == 1.0 and not loss_scaling:
                advice = "enable dynamic loss scaling (torch.amp.GradScaler)"
            else:
                advice = "the loss scale is too low for these gradients; find what keeps pushing it down"
            out.append(
                Finding(
                    kind=FindingKind.UNDERFLOW,
                    severity=Severity.ERROR if r.flush_fraction > 0.9 else Severity.WARNING,
                    module=r.module,
                    direction=Direction.BACKWARD,
                    message=f"{r.flush_fraction:.0%} of the non-zero values of {what} flush to 0 in {fmt.id} {at} "
                    f"(|g| ≤ {fmt.flush_threshold / r.scale:.3g})",
                    advice=advice,
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
    blame), before the weights were damaged, and — with a loss scaler — at a step whose backward ran at a
    scale ≤ 1. Above 1 an overflow is the scaler's own doing (it scales the gradients up, and backs off when
    they overflow: calibration); at a scale ≤ 1 the gradients themselves are out of range, which no loss
    scale fixes."""
    limit = result.corrupted_from
    origins = [
        o for o in result.backward_origins if math.isfinite(result.losses[o.step]) and (limit is None or o.step < limit)
    ]
    if result.init_scale is None:
        return origins[0] if origins else None
    for o in origins:
        scale = result.scale_before(o.step)
        if scale is not None and scale <= 1.0:
            return o
    return None


def _trains_worse(ref: RunResult, res: RunResult, ratio: float) -> bool:
    """The chosen precision makes less than ``ratio`` of fp32's progress per applied update. Progress is the
    drop of the fp32 evaluation loss from the initial weights to the trained ones, on the same batches for both
    runs; it is divided by the updates actually applied, because a step the scaler skips changes nothing (and
    GradScaler's calibration skips several at the start of a healthy run)."""
    if not ref.health.stable or ref.applied_updates == 0 or res.applied_updates == 0:
        return False
    start = ref.health.start_loss
    p32 = (start - ref.end_eval_loss) / ref.applied_updates
    p = (start - res.end_eval_loss) / res.applied_updates
    if not (math.isfinite(p32) and p32 > 0):
        return False
    return not math.isfinite(p) or p < ratio * p32


@dataclass(frozen=True, slots=True)
class _Culprit:
    module: str
    text: str


def _culprit(
    scan: Sequence[ModuleRange],
    fwd: Origin | None,
    bwd: Origin | None,
    res: RunResult,
    fmt: FloatFormat,
    cfg: DoctorConfig,
) -> _Culprit | None:
    """The first module, in execution order, whose own computation leaves the format's range.

    Candidates are ordered by (step, forward before backward, position in that pass); the range scan
    measures the initial weights, i.e. step 0. Forward: an overflowing weight or output whose inputs were in
    range, and the run's first NaN/Inf output with finite inputs. A module whose outputs flush to 0 and
    whose output's gradient is then the run's first non-finite gradient (sqrt/log/division of the zeros)
    counts as forward too: its forward left the range first. Backward: the first gradient, in backward
    order, that exceeds the range unscaled although the gradient its producer received did not — blamed on
    its producer — and the run's first non-finite gradient at a loss scale ≤ 1; last, gradients that almost
    all flush to 0.
    """
    position: dict[str, int] = {}
    for i, r in enumerate(scan):
        if r.role is TensorRole.ACTIVATION:
            position.setdefault(r.module, i)
    thr = fmt.overflow_threshold
    incoming = _Incoming(scan, cfg.near_binades)
    cands: list[tuple[tuple[float, int, float], _Culprit]] = []
    for i, r in enumerate(scan):
        if r.role is TensorRole.WEIGHT and r.overflow:
            text = f"its weights reach {r.absmax:.4g} ≥ {thr:.6g}, inf in {fmt.id}, so its forward computes with inf"
            cands.append(((0, 0, i), _Culprit(r.module, text)))
        elif r.role is TensorRole.ACTIVATION and r.overflow and r.input_absmax < thr:
            text = (
                f"its forward overflows {fmt.id} (outputs reach {r.absmax:.4g} ≥ {thr:.6g}, from inputs within range)"
            )
            cands.append(((0, 0, i), _Culprit(r.module, text)))
    if fwd is not None:
        text = f"its forward produces {fwd.what} from finite inputs at step {fwd.step} in {res.spec.label}"
        cands.append(((fwd.step, 0, position.get(fwd.module, math.inf)), _Culprit(fwd.module, text)))
    if bwd is not None and bwd.where is Where.OUTPUT_GRAD:
        row = next((r for r in scan if r.module == bwd.module and r.role is TensorRole.ACTIVATION), None)
        if row is not None and row.nonzero and row.flush_fraction >= cfg.underflow_fraction:
            text = (
                f"{row.flush_fraction:.0%} of its outputs flush to 0 in {fmt.id}, and at step {bwd.step} the gradient "
                f"through them is {bwd.what} ({bwd.producer}'s backward divides by, or takes a root/log of, the zeros)"
            )
            cands.append(((bwd.step, 0, position.get(bwd.module, math.inf)), _Culprit(bwd.module, text)))
    grads = [r for r in scan if r.role.is_gradient]
    over = [r for r in grads if r.overflow_unscaled and not incoming.overflows(r)]
    if over:
        r = min(over, key=lambda r: r.backward_rank if r.backward_rank is not None else math.inf)
        producer = r.produced_by or r.module
        text = (
            f"its backward makes {_describe_row(r)} exceed {fmt.id}'s range even without loss scaling "
            f"(absmax {r.absmax:.4g})"
        )
        cands.append(((0, 1, r.backward_rank if r.backward_rank is not None else math.inf), _Culprit(producer, text)))
    if bwd is not None:
        scale = res.scale_before(bwd.step)
        at = f" at loss scale {scale:g}" if scale is not None else ""
        text = f"its backward makes {bwd.describe()} {bwd.what} at step {bwd.step}{at}"
        cands.append(((bwd.step, 1, math.inf), _Culprit(bwd.producer, text)))
    vanish = [r for r in grads if r.nonzero and r.flush_fraction > 0.9]
    if vanish:
        r = min(vanish, key=lambda r: r.backward_rank if r.backward_rank is not None else math.inf)
        at = f"at loss scale {r.scale:g}" if r.scale != 1.0 else "without loss scaling"
        text = f"{r.flush_fraction:.0%} of the non-zero values of {_describe_row(r)} flush to 0 in {fmt.id} {at}"
        cands.append(((0, 2, r.backward_rank if r.backward_rank is not None else math.inf), _Culprit(r.module, text)))
    if not cands:
        return None
    return min(cands, key=lambda c: c[0])[1]


def _closest(scan: Sequence[ModuleRange]) -> tuple[ModuleRange, float] | None:
    """The tensor nearest the format's largest value (gradients unscaled)."""
    rows = [(r, _headroom(r)) for r in scan if r.absmax > 0]
    return min(rows, key=lambda x: x[1]) if rows else None


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
    start = initial_loss(setup, pristine, batches, seed=cfg.seed)

    def train(spec: RunSpec) -> RunResult:
        return run(setup, pristine, batches, spec, seed=cfg.seed, start_loss=start)

    ref = train(RunSpec(label="fp32", precision=Precision.FP32, track_nonfinite=True))
    res = train(
        RunSpec(label=precision.value, precision=precision, track_nonfinite=True, loss_scaling=cfg.loss_scaling)
    )
    grad_scale = res.settled_scale if precision is Precision.AMP_FP16 and cfg.loss_scaling else 1.0
    scan_model = copy.deepcopy(pristine).float()
    try:
        scan = range_scan(scan_model, batches[: cfg.scan_batches], setup.loss_fn, fmt, grad_scale=grad_scale)
    except Exception as exc:
        raise DoctorError(f"the range scan's forward/backward raised {type(exc).__name__}: {exc}") from exc

    worse = _trains_worse(ref, res, cfg.progress_ratio)
    unstable = not res.health.stable or worse
    lr_runs: list[RunResult] = []
    clip_run: RunResult | None = None
    lr_fix: RunResult | None = None
    clip_fix: RunResult | None = None
    # A lower lr or clipping can calm a blow-up, not make a stalled run train; and a loss that is already
    # NaN/Inf at step 0 comes from the initial weights, before either has acted.
    at_start = res.health.first_nonfinite_step == 0
    if at_start:
        notes = (*notes, "the loss is NaN/Inf at step 0, before any update: lr and clipping runs skipped")
    if not res.health.stable and not at_start:
        for k in range(1, cfg.lr_halvings + 1):
            r = train(
                RunSpec(
                    label=f"{precision.value}, lr/{2**k}",
                    precision=precision,
                    lr_factor=0.5**k,
                    loss_scaling=cfg.loss_scaling,
                )
            )
            lr_runs.append(r)
            if r.health.stable:
                lr_fix = r
                break
        if lr_fix is None:
            clip_run = train(
                RunSpec(
                    label=f"{precision.value}, clip {cfg.clip_norm:g}",
                    precision=precision,
                    max_grad_norm=cfg.clip_norm,
                    loss_scaling=cfg.loss_scaling,
                )
            )
            if clip_run.health.stable:
                clip_fix = clip_run
    remedies = [*lr_runs, *([clip_run] if clip_run is not None else [])]

    findings: list[Finding] = []
    p = precision.value
    # 1. precision
    fwd = _forward_origin(res)
    bwd = _backward_origin(res)
    scan_findings = _scan_findings(scan, fmt, cfg, precision, cfg.loss_scaling)
    culprit = _culprit(scan, fwd, bwd, res, fmt, cfg)
    if ref.health.stable and unstable:
        how = (
            res.health.problem()
            if not res.health.stable
            else f"it trains less than {cfg.progress_ratio:.0%} as much as fp32 "
            f"(loss {res.health.start_loss:.4g} → {res.health.end_loss:.4g})"
        )
        findings.append(
            Finding(
                kind=FindingKind.PRECISION,
                severity=Severity.ERROR,
                module=culprit.module if culprit else None,
                message=f"fp32 is stable from the same weights and {ref.health.trend()}, but in {p} {how}",
                advice="the cause is the number format: see the overflow/underflow/nonfinite findings for where",
            )
        )
    findings += scan_findings
    if fwd is not None:
        findings.append(
            Finding(
                kind=FindingKind.NONFINITE,
                severity=Severity.ERROR,
                module=fwd.module,
                direction=Direction.FORWARD,
                step=fwd.step,
                message=f"first {fwd.what} in {p}: {fwd.describe()} at step {fwd.step} (forward), with finite inputs",
                advice="this is where values leave the format's range first",
            )
        )
    if bwd is not None:
        scale = res.scale_before(bwd.step)
        at = f", loss scale {scale:g}" if scale is not None else ""
        findings.append(
            Finding(
                kind=FindingKind.NONFINITE,
                severity=Severity.ERROR,
                module=bwd.producer,
                direction=Direction.BACKWARD,
                step=bwd.step,
                message=f"first {bwd.what} in {p}: {bwd.describe()} at step {bwd.step} (backward{at}), from "
                "finite gradients",
                advice=f"{bwd.producer}'s backward is where gradients leave the format's range first",
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
                message=f"first {o.what} in fp32: {o.describe()} at step {o.step}",
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
                module=bwd.producer if bwd else None,
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
                module=bwd.producer if bwd else None,
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
                message=f"unstable at lr={_lr(res.lr)} ({res.health.problem()}); stable at lr={_lr(lr_fix.lr)} "
                f"({lr_fix.spec.label})",
                advice=f"lower the learning rate to {_lr(lr_fix.lr)} or below (or warm it up)",
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
    data_findings = _data_findings(data, fmt)
    # By elimination: fp32 fails too (not precision), the failure starts after updates have acted, nothing
    # tried stabilises it and the batches are clean — what remains of the article's list is the learning rate.
    lr_suspect = (
        not ref.health.stable
        and not res.health.stable
        and not at_start
        and ref.health.first_nonfinite_step != 0
        and bool(lr_runs)
        and lr_fix is None
        and clip_fix is None
        and not data_findings
    )
    if lr_suspect:
        tried = "; ".join(f"lr={_lr(r.lr)}: {r.health.problem()}" for r in lr_runs)
        clipped = f"; clipping at {cfg.clip_norm:g}: {clip_run.health.problem()}" if clip_run is not None else ""
        findings.append(
            Finding(
                kind=FindingKind.LR,
                severity=Severity.ERROR,
                message=f"unstable at lr={_lr(res.lr)} ({res.health.problem()}) and at every lower rate tried "
                f"({tried}){clipped}",
                advice=f"lower the learning rate by far more than {2**cfg.lr_halvings}× (try "
                f"{_lr(res.lr / 100 if res.lr is not None else None)}) with a warmup, and rerun the doctor",
            )
        )
    findings += data_findings

    cause = _cause(ref, res, unstable, lr_fix, clip_fix, lr_suspect, findings)
    diagnosis = _diagnosis(
        cause, precision, fmt, cfg, ref, res, lr_runs, lr_fix, clip_run, culprit, findings, scan, cfg.loss_scaling
    )
    history = tuple(
        ScalePoint(step=i, scale=s, skipped=bool(k))
        for i, (s, k) in enumerate(zip(res.scales, res.skipped, strict=True))
        if s is not None
    )
    named = culprit.module if culprit is not None and cause is Check.PRECISION else None
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
        culprit=named,
        start_loss=start,
        near_binades=cfg.near_binades,
        notes=notes,
    )


def _cause(
    ref: RunResult,
    res: RunResult,
    unstable: bool,
    lr_fix: RunResult | None,
    clip_fix: RunResult | None,
    lr_suspect: bool,
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
    if any(f.kind is FindingKind.DATA for f in findings):
        return Check.DATA
    if lr_suspect:
        return Check.LEARNING_RATE
    return None


def _lr_evidence(res: RunResult, lowest: RunResult) -> str:
    """What lowering the learning rate changed, if anything (a fact for the diagnosis, not a criterion)."""
    a, b = res.health, lowest.health
    if a.first_nonfinite_step is not None and (
        b.first_nonfinite_step is None or b.first_nonfinite_step > a.first_nonfinite_step
    ):
        later = f"from step {b.first_nonfinite_step}" if b.first_nonfinite_step is not None else "not at all"
        return (
            f"; lowering it does delay the failure (NaN/Inf from step {a.first_nonfinite_step} at lr={_lr(res.lr)}, "
            f"{later} at lr={_lr(lowest.lr)})"
        )
    if math.isfinite(a.max_loss) and math.isfinite(b.max_loss) and b.max_loss < a.max_loss:
        return (
            f"; lowering it does shrink the blow-up (peak loss {a.max_loss:.4g} at lr={_lr(res.lr)}, "
            f"{b.max_loss:.4g} at lr={_lr(lowest.lr)})"
        )
    return ""


def _diagnosis(
    cause: Check | None,
    precision: Precision,
    fmt: FloatFormat,
    cfg: DoctorConfig,
    ref: RunResult,
    res: RunResult,
    lr_runs: Sequence[RunResult],
    lr_fix: RunResult | None,
    clip_run: RunResult | None,
    culprit: _Culprit | None,
    findings: Sequence[Finding],
    scan: Sequence[ModuleRange],
    loss_scaling: bool,
) -> str:
    p = precision.value
    both_stable = ref.health.stable and res.health.stable
    if cause is None and not findings and both_stable:
        closest = _closest(scan)
        where = (
            f" (closest: {_describe_row(closest[0])}, {_pow2(closest[1])} below)"
            if closest is not None and math.isfinite(closest[1])
            else ""
        )
        return (
            f"Healthy: fp32 and {p} are both stable from the same weights (fp32 {ref.health.trend()}, {p} "
            f"{res.health.trend()}); no weight, activation or gradient is within {cfg.near_binades:g} powers of two "
            f"of {fmt.id}'s largest value{where}, and the batches are clean."
        )
    if cause is Check.PRECISION:
        how = (
            res.health.problem()
            if not res.health.stable
            else f"it trains less than {cfg.progress_ratio:.0%} as much as fp32"
        )
        text = f"Precision is the cause: fp32 is stable and {ref.health.trend()}; {p} is not ({how})."
        if culprit is not None:
            text += f" It starts at {culprit.module}: {culprit.text}."
        if any(f.kind is FindingKind.SCALE_COLLAPSE for f in findings):
            text += " The loss scale collapsed, so loss scaling has stopped working."
        if lr_fix is not None:
            text += f" Lowering the learning rate to {_lr(lr_fix.lr)} also stabilises it."
        underflow = any(f.kind is FindingKind.UNDERFLOW and f.severity is Severity.ERROR for f in findings)
        if "fp16" in p and underflow and not loss_scaling:
            text += (
                " Gradients vanish in fp16 without loss scaling: enable dynamic loss scaling (torch.amp.GradScaler)."
            )
        elif "fp16" in p and culprit is not None:
            text += " Fix the layer, or use bf16 (same range as fp32) on a GPU that supports it."
        elif "fp16" in p:
            text += " Use bf16 (same range as fp32) on a GPU that supports it."
        return text
    if cause is Check.LEARNING_RATE and lr_fix is not None:
        return (
            f"The learning rate is the cause: fp32 is unstable too ({ref.health.problem()}), so it is not "
            f"precision; at lr={_lr(lr_fix.lr)} instead of {_lr(res.lr)} training is stable. Halve the learning "
            "rate until it is (article §5.3, step 2)."
        )
    if cause is Check.LEARNING_RATE:
        lowest = lr_runs[-1]
        clipped = f", and neither does clipping at {cfg.clip_norm:g}" if clip_run is not None else ""
        return (
            f"The learning rate is the likely cause: fp32 is unstable too ({ref.health.problem()}), so it is not "
            f"precision, and the batches are clean; but even lr/{2 ** len(lr_runs)} (lr={_lr(lowest.lr)}, down from "
            f"{_lr(res.lr)}) does not make training stable{clipped}{_lr_evidence(res, lowest)}. Lower the learning "
            "rate by "
            f"much more — try lr={_lr(res.lr / 100 if res.lr is not None else None)} — with a warmup, and rerun the "
            "doctor; if no learning rate helps, check the optimizer's other settings and the loss (article §5.3, "
            "step 2)."
        )
    if cause is Check.CLIPPING:
        return (
            "Gradient clipping is missing: fp32 is unstable too, lowering the learning rate does not help, and "
            f"clipping the gradient norm at {cfg.clip_norm:g} makes training stable (article §5.3, step 3)."
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
    if findings and both_stable:
        return "No instability in these steps, but: " + "; ".join(f.message for f in findings[:3]) + "."
    state = (
        f"fp32 {'is stable' if ref.health.stable else 'is not stable (' + ref.health.problem() + ')'} and {p} "
        f"{'is stable' if res.health.stable else 'is not (' + res.health.problem() + ')'}"
    )
    return f"Unexplained: {state}; none of precision, a lower learning rate, clipping or the data explains it." + (
        " " + "; ".join(f.message for f in findings[:3]) + "." if findings else ""
    )


def diagnose_target(target: str, config: DoctorConfig | None = None) -> DoctorReport:
    """Load ``module.py:function`` and diagnose it."""
    return diagnose(load_setup(target), config)

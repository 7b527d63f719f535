"""Run the same N optimizer steps from the same initial weights under one configuration.

Each run deep-copies the pristine model, builds a fresh optimizer with the user's factory, optionally
scales its learning rate (the article's "halve it") and clipping, and drives ``TrainStep`` with a
``StabilityMonitor``. A run is *unstable* when its loss goes NaN/Inf, explodes (exceeds ``explode_factor``
× its starting loss), rises (ends above ``rise_factor`` × its start), or when the loss scale collapses
below 1.

**The starting loss** is the loss of the initial weights, before any update: the mean fp32 loss of the
pristine model on the first k batches (k = 3 for 15+ steps), computed once and shared by every run, since
every run starts from those weights. (It used to be the mean of each run's first k *training* losses, which
already include k − 1 updates: a learning rate 10⁴× too high had blown the loss up by then, and a run
whose loss went 14 → 1.8e7 → … was judged against a "start" of 6e6.) The end is the mean of the last k
training losses.

**The scaler.** Before its first growth (2000 clean steps) GradScaler's scale is exactly ``init_scale /
2**skips``: skips in a doctor run are the scaler calibrating (``StabilityMonitor``), however many there
are, until the scale falls below 1 — torch's ``GradScaler.update`` docs call that "something is likely
wrong", and it is what a run that keeps overflowing reaches (17 skips from 65536). So a collapsed scale
marks a run unstable; the fraction of skipped steps alone does not (in a short run it is calibration).

``pure-bf16`` runs cast the model *and* the batches' floating-point tensors to bf16, as a pure-bf16
pipeline does (the model alone would meet fp32 inputs: "mat1 and mat2 must have the same dtype").
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainfit.doctor.findings import DoctorError
from trainfit.doctor.locate import NonfiniteTracker, Origin
from trainfit.doctor.setup import DoctorSetup
from trainfit.precision.formats import json_float
from trainfit.strategy import Precision
from trainfit.train.monitor import StabilityEvent, StabilityMonitor
from trainfit.train.step import TrainStep


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSpec:
    label: str
    precision: Precision
    lr_factor: float = 1.0
    max_grad_norm: float | None = None
    loss_scaling: bool = True
    track_nonfinite: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class RunHealth:
    first_nonfinite_step: int | None
    exploded: bool
    rising: bool
    skip_fraction: float
    start_loss: float
    end_loss: float
    max_loss: float = math.nan
    #: the first step after which the loss scale was below 1 (None: no collapse or no scaler)
    scale_collapsed_at: int | None = None

    @property
    def progress(self) -> float:
        """start − end loss (positive when it trains); −inf when the loss ended non-finite."""
        return self.start_loss - self.end_loss if math.isfinite(self.end_loss) else -math.inf

    @property
    def trains(self) -> bool:
        """The loss went down (stable or not)."""
        return self.progress > 0

    @property
    def stable(self) -> bool:
        return (
            self.first_nonfinite_step is None
            and not self.exploded
            and not self.rising
            and self.scale_collapsed_at is None
        )

    def trend(self) -> str:
        """'trains (loss a → b)' or 'does not train (loss a → b)'."""
        verb = "trains" if self.trains else "does not train"
        return f"{verb} (loss {self.start_loss:.4g} → {self.end_loss:.4g})"

    def problem(self) -> str:
        if self.first_nonfinite_step is not None:
            return f"its loss is NaN/Inf from step {self.first_nonfinite_step}"
        if self.exploded:
            return f"its loss explodes from {self.start_loss:.4g} up to {self.max_loss:.4g}"
        if self.rising:
            return f"its loss rises from {self.start_loss:.4g} to {self.end_loss:.4g}"
        if self.scale_collapsed_at is not None:
            return (
                f"its loss scale collapses below 1 at step {self.scale_collapsed_at}, the scaler skipping "
                f"{self.skip_fraction:.0%} of the optimizer steps"
            )
        return "it is stable"


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    spec: RunSpec
    lr: float | None
    init_scale: float | None
    losses: tuple[float, ...]
    grad_norms: tuple[float | None, ...]
    scales: tuple[float | None, ...]
    skipped: tuple[bool | None, ...]
    events: tuple[StabilityEvent, ...]
    forward_origins: tuple[Origin, ...]
    backward_origins: tuple[Origin, ...]
    health: RunHealth
    #: the fp32 loss of the trained weights on the batches the initial loss was taken on (:func:`eval_loss`)
    end_eval_loss: float = math.nan

    @property
    def applied_updates(self) -> int:
        """Optimizer steps that changed the weights (a step the loss scaler skips does not)."""
        return sum(1 for s in self.skipped if not s)

    def scale_before(self, step: int) -> float | None:
        """The loss scale the backward of ``step`` ran at (scales are recorded after each update)."""
        if self.init_scale is None:
            return None
        return self.init_scale if step == 0 else self.scales[step - 1]

    @property
    def settled_scale(self) -> float:
        """The loss scale the run trained at: median scale of non-skipped steps; the initial scale when every
        step was skipped (the collapsed end value says nothing about the gradients); 1.0 without scaling."""
        good = sorted(s for s, k in zip(self.scales, self.skipped, strict=True) if s is not None and not k)
        if good:
            return good[len(good) // 2]
        return self.init_scale if self.init_scale is not None else 1.0

    @property
    def corrupted_from(self) -> int | None:
        """First step whose weights were already damaged: the step after a non-finite gradient or loss was
        applied (not skipped by a scaler). Hooks after that point see consequences, not causes."""
        for i, (loss, norm, skipped) in enumerate(zip(self.losses, self.grad_norms, self.skipped, strict=True)):
            bad = not math.isfinite(loss) or (norm is not None and not math.isfinite(norm))
            if bad and not skipped:
                return i + 1
        return None

    def to_json(self) -> dict[str, object]:
        h = self.health
        return {
            "label": self.spec.label,
            "precision": self.spec.precision.value,
            "lr": self.lr,
            "lr_factor": self.spec.lr_factor,
            "max_grad_norm": self.spec.max_grad_norm,
            "loss_scaling": self.spec.loss_scaling,
            "stable": h.stable,
            "problem": None if h.stable else h.problem(),
            "first_nonfinite_step": h.first_nonfinite_step,
            "skip_fraction": h.skip_fraction,
            "losses": [json_float(x) for x in self.losses],
            "grad_norms": [None if g is None else json_float(g) for g in self.grad_norms],
            "loss_scales": list(self.scales),
            "skipped": list(self.skipped),
            "events": [e.to_json() for e in self.events],
        }


def window(steps: int) -> int:
    """How many losses are averaged at the start and at the end of a run: 3, fewer for runs under 15 steps."""
    return max(1, min(3, steps // 5 or 1))


def assess(
    losses: Sequence[float],
    skipped: Sequence[bool | None],
    *,
    start_loss: float | None = None,
    scales: Sequence[float | None] = (),
    explode_factor: float = 10.0,
    rise_factor: float = 1.5,
) -> RunHealth:
    """Judge a run. ``start_loss`` is the loss of the initial weights (see the module docstring); without it,
    the first training loss — the only one computed before an update — is used."""
    first_bad = next((i for i, x in enumerate(losses) if not math.isfinite(x)), None)
    finite = [x for x in losses if math.isfinite(x)]
    k = window(len(losses))
    if start_loss is None:
        start_loss = losses[0] if losses else math.nan
    start = start_loss
    tail = list(losses[-k:])
    end = sum(tail) / len(tail) if all(math.isfinite(x) for x in tail) else math.inf
    peak = max(finite) if finite else math.nan
    exploded = bool(finite) and start > 0 and peak > explode_factor * start
    rising = len(losses) >= 10 and math.isfinite(end) and start > 0 and end > rise_factor * start
    n_skip = sum(1 for s in skipped if s)
    collapsed = next((i for i, s in enumerate(scales) if s is not None and s < 1.0), None)
    return RunHealth(
        first_nonfinite_step=first_bad,
        exploded=exploded,
        rising=rising,
        skip_fraction=n_skip / len(skipped) if skipped else 0.0,
        start_loss=start,
        end_loss=end,
        max_loss=peak,
        scale_collapsed_at=collapsed,
    )


def prepare_model(pristine: torch.nn.Module, precision: Precision) -> torch.nn.Module:
    model = copy.deepcopy(pristine)
    return model.to(torch.bfloat16) if precision is Precision.PURE_BF16 else model.float()


def cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    """``obj`` with every floating-point tensor inside it (tuples, lists, mappings) cast to ``dtype``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, Mapping):
        items = {k: cast_floats(v, dtype) for k, v in obj.items()}
        try:
            return type(obj)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(cast_floats(v, dtype) for v in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(cast_floats(v, dtype) for v in obj)
    return obj


def prepare_batches(batches: Sequence[Any], precision: Precision) -> Sequence[Any]:
    """pure-bf16 feeds bf16 data to the bf16 model; the other recipes take the batches as they are."""
    if precision is not Precision.PURE_BF16:
        return batches
    cast: dict[int, Any] = {}  # one cast per distinct batch (steps cycle through the same objects)
    return [cast.setdefault(id(b), cast_floats(b, torch.bfloat16)) for b in batches]


def eval_loss(setup: DoctorSetup, model: torch.nn.Module, batches: Sequence[Any], *, seed: int = 0) -> float:
    """The fp32 loss of ``model``'s weights averaged over the first ``window(len(batches))`` batches (forward
    only, in train mode, on an fp32 copy). Evaluating every run on the same batches makes their progress
    comparable: each training loss is on a different batch, and batches differ more than runs do."""
    torch.manual_seed(seed)
    copy = prepare_model(model, Precision.FP32)
    copy.train()
    values = []
    with torch.no_grad():
        for i, batch in enumerate(batches[: window(len(batches))]):
            try:
                values.append(float(setup.loss_fn(copy, batch)))
            except Exception as exc:
                raise DoctorError(f"the loss on batch {i} raised {type(exc).__name__}: {exc}") from exc
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def initial_loss(setup: DoctorSetup, pristine: torch.nn.Module, batches: Sequence[Any], *, seed: int = 0) -> float:
    """The fp32 loss of the initial weights (:func:`eval_loss`): every run's starting point."""
    return eval_loss(setup, pristine, batches, seed=seed)


def run(
    setup: DoctorSetup,
    pristine: torch.nn.Module,
    batches: Sequence[Any],
    spec: RunSpec,
    *,
    seed: int = 0,
    start_loss: float | None = None,
) -> RunResult:
    """Train ``len(batches)`` optimizer steps (one micro-batch each) under ``spec``; ``start_loss`` is the
    loss of the initial weights (:func:`initial_loss`)."""
    torch.manual_seed(seed)
    raw_batches = batches
    batches = prepare_batches(batches, spec.precision)
    model = prepare_model(pristine, spec.precision)
    model.train()
    try:
        optimizer = setup.make_optimizer(model.parameters())
    except Exception as exc:
        raise DoctorError(f"make_optimizer raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise DoctorError(f"make_optimizer must return a torch.optim.Optimizer, got {type(optimizer).__name__}")
    for group in optimizer.param_groups:
        if isinstance(group.get("lr"), float | int):
            group["lr"] = group["lr"] * spec.lr_factor
    lr = optimizer.param_groups[0].get("lr")
    monitor = StabilityMonitor(log_events=False, history_limit=None)
    scaler = None
    if spec.precision is Precision.AMP_FP16:
        device = next(model.parameters()).device.type
        scaler = torch.amp.GradScaler(device, enabled=spec.loss_scaling)
    init_scale = scaler.get_scale() if scaler is not None and scaler.is_enabled() else None
    step = TrainStep(
        model, optimizer, precision=spec.precision, max_grad_norm=spec.max_grad_norm, monitor=monitor, scaler=scaler
    )
    tracker = NonfiniteTracker(model) if spec.track_nonfinite else None
    try:
        for i, batch in enumerate(batches):
            if tracker is not None:
                tracker.step = i
            try:
                step(setup.loss_fn, model, batch)
            except DoctorError:
                raise
            except Exception as exc:
                raise DoctorError(f"training step {i} ({spec.label}) raised {type(exc).__name__}: {exc}") from exc
        step.flush()
    finally:
        if tracker is not None:
            tracker.close()
    hist = list(monitor.history)
    losses = tuple(s.loss if s.loss is not None else math.nan for s in hist)
    skipped = tuple(s.skipped for s in hist)
    scales = tuple(s.loss_scale for s in hist)
    return RunResult(
        spec=spec,
        lr=float(lr) if isinstance(lr, float | int) else None,
        init_scale=init_scale,
        losses=losses,
        grad_norms=tuple(s.grad_norm for s in hist),
        scales=scales,
        skipped=skipped,
        events=tuple(monitor.events),
        forward_origins=tuple(tracker.forward[k] for k in sorted(tracker.forward)) if tracker else (),
        backward_origins=tuple(tracker.backward[k] for k in sorted(tracker.backward)) if tracker else (),
        health=assess(losses, skipped, start_loss=start_loss, scales=scales),
        end_eval_loss=eval_loss(setup, model, raw_batches, seed=seed),
    )

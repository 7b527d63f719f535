"""The doctor's corpus: one MLP (fc1 → GELU → fc2 → GELU → LayerNorm → head, 16 batches of 32×16, MSE) broken in
one known way per variant, each diagnosed with the expected cause and — where one applies — module."""

from __future__ import annotations

import pytest

from tests.doctor import cases
from trainfit.doctor import DoctorConfig, FindingKind, diagnose
from trainfit.doctor.findings import Direction, Severity
from trainfit.train.monitor import Check

STEPS = 20
#: the late-calibration case needs the old rule's skip window (20 steps after the first clean one) to fill
LONGER = {"corpus_healthy_late_calibration": 30}

#: case → (precision, expected cause, expected module named by the diagnosis)
CORPUS = {
    "corpus_healthy": ("amp-fp16", None, None),
    "corpus_healthy_late_calibration": ("amp-fp16", None, None),
    "corpus_forward_overflow": ("amp-fp16", Check.PRECISION, "fc2"),
    "corpus_backward_overflow": ("amp-fp16", Check.PRECISION, "fc2"),
    "corpus_nan_data": ("amp-fp16", Check.DATA, None),
    "corpus_inf_label": ("amp-fp16", Check.DATA, None),
    "corpus_sgd_high_lr": ("amp-fp16", Check.LEARNING_RATE, None),
    "corpus_adam_high_lr": ("amp-fp16", Check.LEARNING_RATE, None),
}

_reports: dict[str, object] = {}


def report_for(name: str):
    if name not in _reports:
        precision = CORPUS[name][0]
        steps = LONGER.get(name, STEPS)
        _reports[name] = diagnose(getattr(cases, name)(), DoctorConfig(precision=precision, steps=steps))
    return _reports[name]


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_cause_and_module(name):
    _, cause, module = CORPUS[name]
    report = report_for(name)
    assert report.cause is cause, report.diagnosis
    assert report.culprit == module, report.diagnosis
    if module is not None:
        assert f"It starts at {module}:" in report.diagnosis
        precision = next(f for f in report.findings if f.kind is FindingKind.PRECISION)
        assert precision.module == module


@pytest.mark.parametrize("name", ["corpus_healthy", "corpus_healthy_late_calibration"])
def test_healthy_variants_have_no_findings(name):
    report = report_for(name)
    assert report.findings == () and report.remedies == ()
    assert report.diagnosis.startswith("Healthy")
    # the margin the report calls "near", stated
    assert "within 2 powers of two of fp16's largest value (closest:" in report.diagnosis


def test_healthy_calibration_skips_interleaved_with_clean_steps():
    """Defect 2: GradScaler skips steps 0, 1, 3 and 9 while settling at 4096. These are calibration; before
    the fix the doctor reported a backward `nonfinite` error at head (step 3) and a `scale-decline` warning
    carrying the monitor's skip-rate message (step 21)."""
    report = report_for("corpus_healthy_late_calibration")
    assert [i for i, k in enumerate(report.run.skipped) if k] == [0, 1, 3, 9]
    assert report.scale_history[-1].scale == 4096.0
    assert report.run.events == () and report.backward_origin is None


def test_forward_overflow_is_fc2_not_its_consumers():
    report = report_for("corpus_forward_overflow")
    errors = [f for f in report.findings if f.kind is FindingKind.OVERFLOW and f.severity is Severity.ERROR]
    # act2's outputs overflow only because fc2's did: a consequence, not a finding
    assert [(f.module, f.direction) for f in errors] == [("fc2", Direction.FORWARD)]
    assert report.forward_origin.module == "fc2" and report.forward_origin.step == 0
    assert "its forward overflows fp16" in report.diagnosis


def test_backward_overflow_is_blamed_on_the_module_whose_backward_made_it():
    """The gradient of act1's output — fc2's input — is what overflows first; fc2's backward made it.
    Before the fix the findings said act1 and the diagnosis named no cause."""
    report = report_for("corpus_backward_overflow")
    backward = [
        f
        for f in report.findings
        if f.kind is FindingKind.OVERFLOW and f.direction is Direction.BACKWARD and f.severity is Severity.ERROR
    ]
    assert backward[0].module == "fc2" and "gradient of act1's output" in backward[0].message
    assert "act1" not in {f.module for f in backward}
    row = next(r for r in report.scan if r.module == "act1" and r.role.value == "activation-grad")
    assert row.produced_by == "fc2" and row.overflow_unscaled > 0
    # the forward is within fp16: the run fails because the scaler cannot find a scale ≥ 1
    assert report.forward_origin is None
    assert report.run.health.scale_collapsed_at is not None and report.reference.health.stable
    assert "its backward makes the gradient of act1's output exceed fp16's range" in report.diagnosis


@pytest.mark.parametrize(("name", "batch"), [("corpus_nan_data", 5), ("corpus_inf_label", 7)])
def test_bad_data(name, batch):
    report = report_for(name)
    data = [f for f in report.findings if f.kind is FindingKind.DATA]
    assert [f.batch for f in data] == [batch]
    assert report.reference.health.first_nonfinite_step == batch  # fp32 fails the same way
    assert FindingKind.NONFINITE not in report.kinds()  # the values come in with the data: no module to blame


@pytest.mark.parametrize("name", ["corpus_sgd_high_lr", "corpus_adam_high_lr"])
def test_learning_rate_far_too_high(name):
    """Defect 1: neither lr/2, lr/4, lr/8 nor clipping helps; fp32 fails too. The cause is still the learning
    rate, by elimination, and the diagnosis says what to try next."""
    report = report_for(name)
    assert not report.reference.health.stable
    assert [r.spec.lr_factor for r in report.remedies] == [0.5, 0.25, 0.125, 1.0]
    assert not any(r.health.stable for r in report.remedies)
    assert FindingKind.PRECISION not in report.kinds()
    (lr,) = [f for f in report.findings if f.kind is FindingKind.LR]
    assert lr.severity is Severity.ERROR and "every lower rate tried" in lr.message
    assert "even lr/8" in report.diagnosis and "does not make training stable" in report.diagnosis
    assert f"try lr={report.run.lr / 100:.3g}" in report.diagnosis
    assert not report.diagnosis.startswith("No instability")


def test_adam_high_lr_fp32_blow_up_is_seen_from_the_initial_loss():
    """Defect 1: fp32's losses go 18 → 3.7e6 → …; judged against the mean of its first three losses (which
    already contain the blow-up) it "trained". The start is now the initial weights' loss."""
    report = report_for("corpus_adam_high_lr")
    h = report.reference.health
    assert report.start_loss == h.start_loss < 20
    assert h.exploded and h.max_loss > 1e6
    assert f"up to {h.max_loss:.4g}" in h.problem()  # the peak, not the end loss


@pytest.mark.parametrize("steps", [10, 11])
def test_short_healthy_run_is_not_blamed_on_precision(steps):
    """GradScaler's calibration skips (3 of the first 10 steps here) are no updates: fp16's progress is
    compared with fp32's after as many applied updates, not after as many steps."""
    report = diagnose(cases.corpus_healthy(), DoctorConfig(precision="amp-fp16", steps=steps))
    assert report.cause is None and report.findings == (), report.diagnosis

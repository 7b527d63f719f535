"""Engineered failures, each diagnosed correctly on the CPU; healthy runs produce no findings."""

from __future__ import annotations

import json

import pytest

from tests.doctor import cases
from trainfit.doctor import DoctorConfig, FindingKind, diagnose
from trainfit.doctor.demo import setup as demo_setup
from trainfit.doctor.setup import coerce_setup
from trainfit.train.monitor import Check

STEPS = 20


def run(factory, **kw):
    return diagnose(coerce_setup(factory()), DoctorConfig(steps=STEPS, **kw))


def modules_of(report, kind):
    return {f.module for f in report.findings if f.kind is kind}


@pytest.mark.parametrize("precision", ["amp-fp16", "amp-bf16"])
def test_healthy_run_has_no_findings(precision):
    report = run(cases.healthy, precision=precision)
    assert report.findings == ()
    assert report.cause is None
    assert report.reference.health.stable and report.run.health.stable
    assert report.diagnosis.startswith("Healthy")
    assert report.remedies == ()  # nothing to remedy: no extra runs


def test_activation_overflow_in_fp16():
    report = run(cases.overflow, precision="amp-fp16")
    assert report.cause is Check.PRECISION
    assert modules_of(report, FindingKind.OVERFLOW) == {"big"}
    assert "big" in modules_of(report, FindingKind.NONFINITE)
    assert report.forward_origin.module == "big" and report.forward_origin.step == 0
    assert report.reference.health.stable and not report.run.health.stable
    row = next(r for r in report.scan if r.module == "big" and r.role.value == "activation")
    assert row.absmax > 65520 and row.headroom_binades < 0
    assert "big" in report.diagnosis
    # The same model is fine in bf16: its range is fp32's.
    bf16 = run(cases.overflow, precision="amp-bf16")
    assert FindingKind.OVERFLOW not in bf16.kinds() and bf16.cause is None


def test_nan_in_a_batch_is_a_data_problem():
    report = run(cases.nan_batch, precision="amp-fp16")
    assert report.cause is Check.DATA
    data = [f for f in report.findings if f.kind is FindingKind.DATA]
    assert [f.batch for f in data] == [5]
    assert not report.reference.health.stable  # fp32 fails the same way
    assert report.reference.health.first_nonfinite_step == 5
    assert FindingKind.OVERFLOW not in report.kinds() and FindingKind.LR not in report.kinds()
    # the NaN comes in with the data: no module is blamed as its origin
    assert FindingKind.NONFINITE not in report.kinds()


def test_diverging_learning_rate():
    report = run(cases.diverging_lr, precision="amp-fp16")
    assert report.cause is Check.LEARNING_RATE
    (lr,) = [f for f in report.findings if f.kind is FindingKind.LR]
    assert "lr=0.8" in lr.message
    assert not report.reference.health.stable  # fp32 diverges too: not precision
    assert FindingKind.PRECISION not in report.kinds()


def test_loss_scale_collapse():
    report = run(cases.scale_collapse, precision="amp-fp16")
    assert report.cause is Check.PRECISION
    assert FindingKind.SCALE_COLLAPSE in report.kinds()
    assert report.run.health.skip_fraction == 1.0
    assert report.scale_history[-1].scale < 1.0
    assert report.backward_origin is not None and report.backward_origin.module == "fc"
    assert "fc" in modules_of(report, FindingKind.UNDERFLOW)  # the root cause: fc's outputs flush to 0


def test_gradients_underflow_without_loss_scaling():
    report = run(cases.tiny_gradients, precision="amp-fp16", loss_scaling=False)
    assert report.cause is Check.PRECISION
    underflow = [f for f in report.findings if f.kind is FindingKind.UNDERFLOW]
    assert underflow and all(f.direction.value == "backward" for f in underflow)
    assert "loss scaling" in report.diagnosis
    # With dynamic loss scaling the same model trains like fp32 and nothing underflows.
    scaled = run(cases.tiny_gradients, precision="amp-fp16")
    assert scaled.findings == () and scaled.grad_scale > 1


def test_demo_overflows_in_fp16():
    report = diagnose(demo_setup(), DoctorConfig(steps=20, precision="amp-fp16"))
    assert report.cause is Check.PRECISION
    assert modules_of(report, FindingKind.OVERFLOW) == {"amplify"}


def test_json_is_serialisable_and_has_findings():
    report = run(cases.overflow, precision="amp-fp16")
    data = json.loads(json.dumps(report.to_json(), allow_nan=False))
    assert data["schema_version"] == 1 and data["cause"] == "precision"
    assert {"kind", "module", "severity", "check", "message"} <= set(data["findings"][0])
    assert len(data["runs"][0]["losses"]) == STEPS

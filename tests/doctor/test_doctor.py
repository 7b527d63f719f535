"""Engineered failures, each diagnosed correctly on the CPU; healthy runs produce no findings."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.doctor import cases
from trainfit.doctor import DoctorConfig, DoctorError, DoctorSetup, FindingKind, diagnose
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


# ---------------------------------------------------------------------------------------------------------
# Regressions (issue 15, doctor part): each failed before its fix.


def diag(setup, steps=STEPS, **kw):
    return diagnose(setup, DoctorConfig(steps=steps, **kw))


def test_headline_names_the_module_whose_forward_overflows_not_the_layer_before():
    """``hot``'s weights ×3e4 (inputs ×8): its outputs reach 2.7e5. The findings always said so, but the
    headline said "It starts at embed: embed's output gradients exceed fp16's range" — a gradient that hot's
    backward made, attributed to the layer before it."""
    report = diag(cases.relu_hot(3e4, input_scale=8.0), precision="amp-fp16")
    assert report.cause is Check.PRECISION
    assert report.culprit == "hot"
    assert "It starts at hot: its forward overflows fp16" in report.diagnosis
    assert "embed" not in report.diagnosis
    # the backward overflows are blamed on the modules whose backward made them
    grad_rows = {r.module: r for r in report.scan if r.role.value == "activation-grad"}
    assert grad_rows["act1"].produced_by == "hot" and grad_rows["embed"].produced_by == "act1"
    backward = {f.module for f in report.findings if f.kind is FindingKind.OVERFLOW and f.direction.value == "backward"}
    assert "act1" not in backward and "embed" not in backward  # act1 only passed on what hot sent back


def test_fp32_that_does_not_train_is_not_said_to_train():
    """Gradient ascent (SGD maximize=True): fp32 stays stable but its loss rises 16 → 22.6; it used to say
    'fp32 trains from the same weights (loss 16.31 → 22.63)'."""
    setup = DoctorSetup(
        model=cases.corpus_model(fc2=1e5),
        batches=cases.corpus_batches(),
        loss_fn=cases.mse,
        make_optimizer=lambda params: torch.optim.SGD(params, lr=3e-3, maximize=True),
    )
    report = diag(setup, precision="amp-fp16")
    h = report.reference.health
    assert h.stable and h.end_loss > h.start_loss
    assert report.cause is Check.PRECISION
    (precision,) = [f for f in report.findings if f.kind is FindingKind.PRECISION]
    assert "does not train" in precision.message and "fp32 trains" not in precision.message
    assert "does not train" in report.diagnosis


def test_a_layer_within_the_near_margin_is_reported_with_the_margin():
    """fc2's outputs sit 1.1 powers of two below fp16's maximum. Before: "no activation or gradient is near
    the format's limits". Near is now defined (within ``near_binades`` = 2 powers of two) and stated."""
    setup = DoctorSetup(
        model=cases.corpus_model(fc2=3.34e4),
        batches=cases.corpus_batches(),
        loss_fn=cases.mse,
        make_optimizer=cases.adamw(),
    )
    report = diag(setup, precision="amp-fp16")
    row = next(r for r in report.scan if r.module == "fc2" and r.role.value == "activation")
    assert 1.0 < row.headroom_binades < 1.2
    (near,) = [f for f in report.findings if f.kind is FindingKind.OVERFLOW]
    assert near.module == "fc2" and near.severity.value == "warning"
    assert "1.1 powers of two below fp16's maximum" in near.message and "within 2 powers of two" in near.message
    assert not report.diagnosis.startswith("Healthy")
    # act2 receives fc2's near-limit values: a consequence, not a second warning
    assert "act2" not in {f.module for f in report.findings}
    # a wider margin than the distance makes it healthy, and the healthy text names the closest tensor
    relaxed = diag(setup, precision="amp-fp16", near_binades=1.0)
    assert relaxed.findings == ()
    assert "within 1 powers of two of fp16's largest value (closest: fc2's outputs, 1.1 powers of two below)" in (
        relaxed.diagnosis
    )


def test_weights_that_autocast_casts_to_fp16_are_scanned():
    """fc2's weights reach 1.8e5 while its outputs are ordinary in fp32 (fc1 ×1e-6 feeds it): under fp16
    autocast the weight itself is inf. The scan used to look only at outputs and gradients."""
    model = cases.corpus_model(fc2=1e6)
    with torch.no_grad():
        model.fc1.weight.mul_(1e-6)
        model.fc1.bias.mul_(1e-6)
    setup = DoctorSetup(model=model, batches=cases.corpus_batches(), loss_fn=cases.mse, make_optimizer=cases.adamw())
    report = diag(setup, precision="amp-fp16")
    row = next(r for r in report.scan if r.module == "fc2" and r.role.value == "weight")
    assert row.absmax > 65520 and row.overflow == int(torch.isinf(model.fc2.weight.detach().half()).sum())
    weight = [f for f in report.findings if f.kind is FindingKind.OVERFLOW and "weights exceed" in f.message]
    assert [f.module for f in weight] == ["fc2"] and weight[0].severity.value == "error"
    assert report.culprit == "fc2" and "its weights reach" in report.diagnosis
    # in bf16 the same weights are fine
    assert not [f for f in diag(setup, precision="amp-bf16").findings if f.kind is FindingKind.OVERFLOW]


def test_a_short_healthy_run_is_not_unstable_for_its_calibration_skips():
    """6 steps, 3 of them calibration skips (65536 → 8192): the old 'scaler skips most steps' rule called it
    unstable and blamed precision. Before its first growth the scale is 65536 / 2**skips, so only a scale
    below 1 (a collapse) means the scaler failed."""
    report = diag(cases.corpus_healthy(), steps=6, precision="amp-fp16")
    assert report.run.health.skip_fraction == 0.5
    assert report.run.health.stable and report.cause is None and report.findings == ()


def test_fp32_runs_get_no_loss_scaling_advice():
    """The fp32 reference run's nonfinite-loss event said '(loss scaling cannot fix a forward overflow)'."""
    report = diag(cases.corpus_nan_data(), precision="amp-fp16")
    fp32_events = report.reference.events
    assert fp32_events and all("loss scaling" not in e.message for e in fp32_events)
    assert all("scal" not in a.text for e in fp32_events for a in e.advice)
    fp16_events = [e for e in report.run.events if e.kind.value == "nonfinite-loss"]
    assert fp16_events and "loss scaling" in fp16_events[0].message  # under fp16 it is the point


def test_pure_bf16_casts_the_batches_too():
    """'mat1 and mat2 must have the same dtype': the model was cast to bf16, the batches were not."""
    report = diag(cases.corpus_healthy(), steps=8, precision="pure-bf16")
    assert report.precision.value == "pure-bf16" and report.cause is None and report.findings == ()
    assert all(math.isfinite(x) for x in report.run.losses)
    demo = diagnose(demo_setup(), DoctorConfig(steps=4, precision="pure-bf16"))
    assert all(math.isfinite(x) for x in demo.run.losses)


def test_pure_bf16_batches_in_mappings():
    """Batches as dicts (and dict-likes such as a tokenizer's BatchEncoding, a UserDict) are cast as well."""
    from collections import UserDict

    from trainfit.doctor.runs import prepare_batches
    from trainfit.strategy import Precision

    x = torch.ones(2, 3)
    ids = torch.ones(2, dtype=torch.long)
    (cast,) = prepare_batches([UserDict({"x": x, "ids": ids, "nested": [x]})], Precision.PURE_BF16)
    assert isinstance(cast, UserDict)
    assert cast["x"].dtype == torch.bfloat16 and cast["nested"][0].dtype == torch.bfloat16
    assert cast["ids"].dtype == torch.long
    assert prepare_batches([(x,)], Precision.AMP_FP16)[0][0] is x  # other recipes: untouched


@pytest.mark.parametrize("name", ["bogus", "fp6", "master-fp16"])
def test_precision_choices_do_not_offer_fp32(name):
    with pytest.raises(DoctorError) as info:
        diagnose(coerce_setup(cases.healthy()), DoctorConfig(precision=name))
    message = str(info.value)
    assert message == f"unknown precision '{name}'; choose one of: auto, amp-fp16, amp-bf16, pure-bf16"


def test_data_scan_sees_inside_dict_like_batches():
    """A tokenizer's BatchEncoding is a UserDict, not a dict: its tensors were skipped by the data scan."""
    from collections import UserDict

    from trainfit.doctor.data import scan_batches
    from trainfit.precision.formats import FP16

    x = torch.zeros(4)
    x[1] = math.nan
    (row,) = scan_batches([UserDict({"input": x, "ids": torch.ones(4, dtype=torch.long)})], FP16)
    assert row.nan == 1 and row.float_values == 4

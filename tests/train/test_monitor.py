"""StabilityMonitor rules, fed host stats directly and through a real GradScaler on the CPU."""

from __future__ import annotations

import math
import random
import subprocess
import sys

import pytest
import torch

from trainfit.train import EventKind, InstabilityError, StabilityMonitor, StepStats, TrainStep
from trainfit.train.monitor import CHECK_ORDER, Check, troubleshooting_advice


def healthy_stream(n: int, seed: int = 0, scale: float | None = 65536.0):
    rng = random.Random(seed)
    for i in range(n):
        yield StepStats(step=i, loss=2.0 * math.exp(-i / 300) + rng.uniform(-0.05, 0.05),
                        grad_norm=1.0 + rng.uniform(-0.2, 0.2), loss_scale=scale,
                        skipped=False if scale else None, lr=1e-3)  # fmt: skip


def feed(monitor: StabilityMonitor, stream) -> list:
    out = []
    for s in stream:
        out += monitor.observe(s)
    return out


def test_healthy_run_has_no_events():
    m = StabilityMonitor(log_events=False)
    assert feed(m, healthy_stream(1000)) == []


def test_healthy_fp16_run_with_calibration_and_growth_has_no_events():
    """A real GradScaler's life: opening overflows (calibration), then growth every 2000 clean steps and an
    occasional single backoff."""
    m = StabilityMonitor(log_events=False)
    scale, events, clean = 65536.0, [], 0
    rng = random.Random(1)
    for i in range(6000):
        skipped = i < 5 or (clean >= 2000 and i % 2500 == 0) or rng.random() < 0.0005
        if skipped:
            scale, clean = scale / 2, 0
        else:
            clean += 1
            if clean % 2000 == 0:
                scale *= 2
        events += m.observe(StepStats(step=i, loss=1.0 + rng.uniform(-0.05, 0.05), grad_norm=1.0,
                                      loss_scale=scale, skipped=skipped))  # fmt: skip
    assert events == []
    assert m.summary().calibration_steps == 5


def test_nonfinite_loss_with_advice_in_article_order():
    m = StabilityMonitor(log_events=False)
    m.attach(precision="amp-fp16", max_grad_norm=None)
    feed(m, healthy_stream(30))
    (ev,) = m.observe(StepStats(step=30, loss=math.nan, grad_norm=math.nan, skipped=True, lr=4e-4))
    assert ev.kind is EventKind.NONFINITE_LOSS and ev.step == 30
    assert tuple(a.check for a in ev.advice) == CHECK_ORDER == (Check.PRECISION, Check.LEARNING_RATE,
                                                                Check.CLIPPING, Check.DATA)  # fmt: skip
    assert "fp32" in ev.advice[0].text
    assert "0.0002" in ev.advice[1].text  # halve 4e-4
    assert "1.0" in ev.advice[2].text and ev.advice[2].applicable
    assert "step 30" in ev.advice[3].text


def test_advice_adapts_to_configuration():
    m = StabilityMonitor(log_events=False)
    m.attach(precision="fp32", max_grad_norm=1.0)
    (ev,) = m.observe(StepStats(step=0, loss=math.inf))
    assert not ev.advice[0].applicable  # already fp32
    assert not ev.advice[2].applicable  # already clipping at 1.0
    assert ev.advice[1].applicable and ev.advice[3].applicable


def test_loss_spike_and_grad_spike():
    m = StabilityMonitor(log_events=False)
    feed(m, healthy_stream(50))
    (ev,) = m.observe(StepStats(step=50, loss=9.0, grad_norm=1.0))
    assert ev.kind is EventKind.LOSS_SPIKE
    (ev,) = m.observe(StepStats(step=51, loss=1.8, grad_norm=40.0))
    assert ev.kind is EventKind.GRAD_SPIKE


def test_nonfinite_gradient_only_reported_when_applied():
    m = StabilityMonitor(log_events=False)
    assert m.observe(StepStats(step=0, loss=1.0, grad_norm=math.inf, skipped=True, loss_scale=32768.0)) == []
    (ev,) = m.observe(StepStats(step=1, loss=1.0, grad_norm=math.nan, skipped=False))
    assert ev.kind is EventKind.NONFINITE_GRAD


def test_scale_collapse_from_consecutive_overflows():
    m = StabilityMonitor(log_events=False)
    scale, events = torch.tensor(65536.0), []  # the scaler's scale is an fp32 tensor
    for i in range(200):
        scale = scale * 0.5
        events += m.observe(StepStats(step=i, loss=1.0, grad_norm=math.inf, skipped=True, loss_scale=scale.item()))
    assert scale.item() == 0.0  # fp32 runs out of subnormals after 16 + 149 + 1 halvings
    collapse = [e for e in events if e.kind is EventKind.SCALE_COLLAPSE]
    assert collapse[0].step == 16 and collapse[0].value == 0.5  # 2^16 halved 17 times
    assert any("never grow back" in e.message for e in collapse)  # 0.0 reached later and re-reported


def test_sustained_decline_after_calibration():
    """A scaler restored from a checkpoint at 2048 (already calibrated) backs off every 15 steps."""
    m = StabilityMonitor(log_events=False, calibrated=True)
    scale, events = 2048.0, []
    for i in range(100):
        skipped = i % 15 == 14  # a backoff every 15 steps, never regrown
        if skipped:
            scale /= 2
        events += m.observe(StepStats(step=i, loss=1.0, grad_norm=1.0, loss_scale=scale, skipped=skipped))
    kinds = [e.kind for e in events]
    assert EventKind.SCALE_DECLINE in kinds
    first = next(e for e in events if e.kind is EventKind.SCALE_DECLINE)
    assert first.step == 59  # the 4th backoff


def test_skip_rate():
    m = StabilityMonitor(log_events=False, calibrated=True)
    events = []
    for i in range(40):
        events += m.observe(StepStats(step=i, skipped=i % 3 == 0 and i > 0))
    assert [e.kind for e in events] == [EventKind.SKIP_RATE]


def test_raise_on_and_callback():
    seen = []
    m = StabilityMonitor(log_events=False, on_event=seen.append, raise_on={"nonfinite-loss"})
    with pytest.raises(InstabilityError) as info:
        m.observe(StepStats(step=3, loss=math.nan))
    assert info.value.event.kind is EventKind.NONFINITE_LOSS and seen == [info.value.event]


def test_real_gradscaler_collapse_through_trainstep():
    """A model whose fp16 gradient is inf at any scale (sqrt of an fp16-flushed 0) drives a real GradScaler
    down; the monitor reports the collapse and the skipped steps."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)
            with torch.no_grad():
                self.fc.weight.fill_(1e-9)
                self.fc.bias.zero_()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sqrt(self.fc(x).abs()).float().sum()

    model = Net()
    monitor = StabilityMonitor(log_events=False, check_every=4)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="amp-fp16", monitor=monitor)
    x = torch.ones(2, 4)
    for _ in range(24):
        step(lambda: model(x))
    step.flush()
    assert step.skipped_steps == 24
    assert EventKind.SCALE_COLLAPSE in monitor.kinds()
    assert monitor.summary().last_scale == 65536.0 / 2**24


def test_monitor_module_is_torch_free():
    code = "import sys, trainfit.train.monitor; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def gradscaler_stream(skips, steps: int, growth_interval: int = 2000):
    """StepStats from a real GradScaler driven by a chosen overflow pattern (the scale is read after update,
    as TrainStep reports it)."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", growth_interval=growth_interval)
    for i in range(steps):
        skipped = i in skips
        scaler.scale((p * (math.inf if skipped else 1.0)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        yield StepStats(step=i, loss=1.0, grad_norm=math.inf if skipped else 1.0,
                        loss_scale=scaler.get_scale(), skipped=skipped)  # fmt: skip


def test_calibration_skips_interleaved_with_clean_steps_are_not_instability():
    """A healthy fp16 MLP: the scaler skips steps 0, 1, 3, 4 and settles at 4096. The old rule ended
    calibration at the first clean step and raised skip-rate at step 21."""
    m = StabilityMonitor(log_events=False)
    stream = list(gradscaler_stream({0, 1, 3, 4}, 300))
    assert [s.loss_scale for s in stream[:6]] == [32768.0, 16384.0, 16384.0, 8192.0, 4096.0, 4096.0]
    assert feed(m, stream) == []
    summary = m.summary()
    assert summary.calibration_steps == 4 and summary.calibrated_at is None


def test_calibration_ends_when_the_scale_grows():
    """After the first growth (a real GradScaler with growth_interval=10), frequent skips are instability."""
    skips = {0, 1, 3, 4} | {i for i in range(20, 60) if i % 3 == 0}
    m = StabilityMonitor(log_events=False)  # growth_interval left at 2000: the growth itself is seen
    events = feed(m, gradscaler_stream(skips, 60, growth_interval=10))
    assert m.summary().calibrated_at == 14  # steps 5..14 clean: the scale doubles at step 14
    assert m.summary().calibration_steps == 4
    assert EventKind.SKIP_RATE in {e.kind for e in events}
    assert min(e.step for e in events) > 14


def test_calibration_ends_after_a_growth_interval_of_clean_steps_without_scale():
    """Without the scale (skip flags only), growth_interval clean steps in a row end calibration."""
    m = StabilityMonitor(log_events=False, growth_interval=20)
    skipped = [i in {0, 1, 3, 4} or (i >= 25 and i % 3 == 0) for i in range(80)]
    events = feed(m, (StepStats(step=i, skipped=k) for i, k in enumerate(skipped)))
    assert m.summary().calibrated_at == 24
    assert [e.kind for e in events] == [EventKind.SKIP_RATE]
    # the same pattern before any growth interval is calibration (the scale would only be going down)
    m2 = StabilityMonitor(log_events=False, growth_interval=2000)
    assert feed(m2, (StepStats(step=i, skipped=k) for i, k in enumerate(skipped))) == []


def test_scaler_that_never_calibrates_is_reported_by_the_collapse_rule():
    """Skips during calibration are not counted, but before any growth the scale is 65536 / 2**skips: a
    run that keeps overflowing (every other step) falls below 1 after 17 skips and is reported."""
    m = StabilityMonitor(log_events=False)
    events = feed(m, gradscaler_stream(set(range(0, 100, 2)), 100))
    collapse = [e for e in events if e.kind is EventKind.SCALE_COLLAPSE]
    assert collapse and collapse[0].step == 32  # the 17th skip


def test_nonfinite_loss_mentions_loss_scaling_only_for_fp16():
    for precision, mentioned in (("fp32", False), ("amp-bf16", False), ("amp-fp16", True)):
        m = StabilityMonitor(log_events=False)
        m.attach(precision=precision)
        (ev,) = m.observe(StepStats(step=0, loss=math.nan))
        assert ("loss scaling" in ev.message) is mentioned, (precision, ev.message)


def test_advice_mentions_the_loss_scaler_only_under_fp16():
    for precision, mentioned in (("fp32", False), ("amp-bf16", False), ("pure-bf16", False), ("amp-fp16", True)):
        advice = troubleshooting_advice(
            EventKind.NONFINITE_LOSS, precision=precision, lr=1e-3, max_grad_norm=None, step=5
        )
        texts = " ".join(a.text for a in advice)
        assert ("scaler" in texts) is mentioned, (precision, texts)
    fp32 = troubleshooting_advice(EventKind.NONFINITE_LOSS, precision="fp32", lr=1e-3, max_grad_norm=None, step=5)
    assert "mixed precision" not in fp32[1].text and "unknown" not in fp32[0].text

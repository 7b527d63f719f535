"""StabilityMonitor rules, fed host stats directly and through a real GradScaler on the CPU."""

from __future__ import annotations

import math
import random
import subprocess
import sys

import pytest
import torch

from trainfit.train import EventKind, InstabilityError, StabilityMonitor, StepStats, TrainStep
from trainfit.train.monitor import CHECK_ORDER, Check


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
    m = StabilityMonitor(log_events=False)
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
    m = StabilityMonitor(log_events=False)
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

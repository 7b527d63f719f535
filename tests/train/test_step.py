"""TrainStep equals a hand-written reference loop (the PyTorch AMP docs' recipe) for every precision."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

from trainfit.errors import StrategyError
from trainfit.strategy import Precision
from trainfit.train import StabilityMonitor, TrainStep

DTYPES = {"fp32": None, "amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))


def make_batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x).float(), y)


def reference_loop(model, optimizer, batches, precision, accum, max_norm, scaler, device="cpu"):
    """Written from the PyTorch AMP examples ("Gradient accumulation", "Working with Unscaled Gradients")."""
    dtype = DTYPES[precision]
    for i, batch in enumerate(batches):
        with torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = loss_fn(model, batch)
        loss = loss / accum
        if scaler is not None:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        if (i + 1) % accum == 0:
            if scaler is not None:
                scaler.unscale_(optimizer)
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def run_both(precision, accum, max_norm, opt_cls=torch.optim.AdamW, steps=12, init_scale=2.0**10, device="cpu",
             **opt_kw):  # fmt: skip
    batches = [(x.to(device), y.to(device)) for x, y in make_batches(steps)]
    ref_model = make_model().to(device)
    ours_model = copy.deepcopy(ref_model)
    ref_opt = opt_cls(ref_model.parameters(), lr=1e-2, **opt_kw)
    ours_opt = opt_cls(ours_model.parameters(), lr=1e-2, **opt_kw)
    fp16 = precision == "amp-fp16"
    ref_scaler = torch.amp.GradScaler(device, init_scale=init_scale) if fp16 else None
    our_scaler = torch.amp.GradScaler(device, init_scale=init_scale) if fp16 else None
    reference_loop(ref_model, ref_opt, batches, precision, accum, max_norm, ref_scaler, device)
    step = TrainStep(ours_model, ours_opt, precision=precision, grad_accum=accum, max_grad_norm=max_norm,
                     scaler=our_scaler, monitor=StabilityMonitor())  # fmt: skip
    for batch in batches:
        step(loss_fn, ours_model, batch)
    return ref_model, ours_model, ref_scaler, step


@pytest.mark.parametrize("precision", ["fp32", "amp-bf16", "amp-fp16"])
@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("max_norm", [None, 0.5])
def test_matches_reference_loop(precision, accum, max_norm):
    ref, ours, ref_scaler, step = run_both(precision, accum, max_norm)
    for (name, a), b in zip(ref.named_parameters(), ours.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert step.optimizer_steps == 12 // accum
    if ref_scaler is not None:
        assert step.loss_scale == ref_scaler.get_scale()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "amp-bf16", "amp-fp16"])
def test_matches_reference_loop_on_cuda(precision):
    if precision == "amp-bf16" and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("no native bf16")
    ref, ours, ref_scaler, step = run_both(precision, 2, 1.0, init_scale=2.0**24, device="cuda", fused=True)
    for a, b in zip(ref.parameters(), ours.parameters(), strict=True):
        assert torch.equal(a, b)
    if ref_scaler is not None:
        assert step.loss_scale == ref_scaler.get_scale() and step.skipped_steps > 0


def test_matches_reference_with_overflowing_scale_and_fused_adamw():
    # init scale 2^24 overflows fp16 gradients: several opening steps are skipped, in both loops.
    ref, ours, ref_scaler, step = run_both("amp-fp16", 2, 1.0, init_scale=2.0**24, fused=True)
    for a, b in zip(ref.parameters(), ours.parameters(), strict=True):
        assert torch.equal(a, b)
    assert step.skipped_steps > 0
    assert step.loss_scale == ref_scaler.get_scale() < 2.0**24


def test_clip_before_unscale_would_differ():
    """The reference comparison is sensitive to the order: clipping scaled gradients gives other weights."""
    batches = make_batches(6)
    model = make_model()
    wrong = copy.deepcopy(model)
    opt, wrong_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, wrong))
    step = TrainStep(model, opt, precision="amp-fp16", max_grad_norm=0.5,
                     scaler=torch.amp.GradScaler("cpu", init_scale=256.0))  # fmt: skip
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    for batch in batches:
        step(loss_fn, model, batch)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(wrong, batch)
        scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(wrong.parameters(), 0.5)  # wrong: clips the scaled gradients
        scaler.step(wrong_opt)
        scaler.update()
        wrong_opt.zero_grad(set_to_none=True)
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), wrong.parameters(), strict=True))


def test_clipping_sees_unscaled_gradients():
    model = make_model()
    batch = make_batches(1)[0]
    reference = copy.deepcopy(model)
    loss_fn(reference, batch).backward()
    true_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0), precision="amp-fp16", max_grad_norm=1e9,
                     scaler=torch.amp.GradScaler("cpu", init_scale=4096.0))  # fmt: skip
    step(loss_fn, model, batch)
    assert not step.last_skipped
    assert step.last_grad_norm.item() == pytest.approx(true_norm, rel=2e-2)


def test_skipped_step_leaves_weights_and_is_reported():
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    monitor = StabilityMonitor(log_events=False)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="amp-fp16", monitor=monitor,
                     scaler=torch.amp.GradScaler("cpu", init_scale=2.0**40))  # fmt: skip
    step(loss_fn, model, make_batches(1)[0])
    assert step.last_skipped and step.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert step.loss_scale == 2.0**39
    stats = monitor.summary()
    assert stats.skipped_steps == 1 and monitor.history[-1].skipped is True
    assert monitor.history[-1].loss_scale == 2.0**39


def test_gradient_accumulation_divides_the_loss():
    """grad_accum=4 over 4 equal micro-batches gives the gradient of one of them (mean, not sum)."""
    model = make_model()
    batch = make_batches(1)[0]
    ref = copy.deepcopy(model)
    loss_fn(ref, batch).backward()
    seen = {}
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    opt.register_step_pre_hook(lambda o, a, k: seen.update({id(p): p.grad.clone() for p in model.parameters()}))
    step = TrainStep(model, opt, precision="fp32", grad_accum=4)
    for _ in range(4):
        step(loss_fn, model, batch)
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(seen[id(p)], r.grad)


def test_flush_steps_a_partial_window():
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp32", grad_accum=4)
    step(loss_fn, model, make_batches(1)[0])
    assert step.optimizer_steps == 0 and not step.boundary
    assert step.flush() and step.optimizer_steps == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not step.flush()


def test_pure_bf16():
    model = make_model().to(torch.bfloat16)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="pure-bf16")
    x, y = make_batches(1)[0]
    loss = step(lambda m, b: torch.nn.functional.mse_loss(m(b[0].bfloat16()).float(), b[1]), model, (x, y))
    assert loss.dtype == torch.float32 and step.scaler is None


def test_auto_on_cpu_is_fp32():
    model = make_model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert step.precision is Precision.FP32 and step.scaler is None and step.autocast_dtype is None


@pytest.mark.parametrize(
    ("precision", "model_dtype", "match"),
    [
        ("master-fp16", torch.float32, "master"),
        ("amp-fp16", torch.float16, "fp32 trainable"),
        ("amp-bf16", torch.bfloat16, "pure-bf16"),
        ("pure-bf16", torch.float32, "bf16 model"),
        ("fp8", torch.float32, "unknown precision"),
    ],
)
def test_refuses_bad_configurations(precision, model_dtype, match):
    model = make_model().to(model_dtype)
    with pytest.raises(StrategyError, match=match):
        TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=precision)


def test_scaler_only_with_fp16_and_scalar_loss_required():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(StrategyError, match="GradScaler"):
        TrainStep(model, opt, precision="amp-bf16", scaler=torch.amp.GradScaler("cpu"))
    step = TrainStep(model, opt, precision="fp32")
    with pytest.raises(StrategyError, match="scalar"):
        step(lambda: model(torch.randn(2, 16)))


def test_no_host_sync_per_micro_step(monkeypatch):
    """trainfit itself calls neither .item() nor .tolist() per micro-step; the monitor copies once per
    ``check_every`` optimizer steps."""
    calls: list[tuple[str, str]] = []
    for name in ("item", "tolist", "__bool__", "__float__"):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *a, _orig=original, _name=name, **k):
            caller = inspect.currentframe().f_back.f_globals.get("__name__", "")
            calls.append((_name, caller))
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, wrapper)
    model = make_model()
    monitor = StabilityMonitor(check_every=2, log_events=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    step = TrainStep(model, torch.optim.AdamW(model.parameters(), lr=1e-3), precision="amp-fp16", grad_accum=4,
                     max_grad_norm=1.0, monitor=monitor, scaler=scaler)  # fmt: skip
    for batch in make_batches(16):
        step(loss_fn, model, batch)
    ours = [c for c in calls if c[1].startswith("trainfit")]
    assert ours == [("tolist", "trainfit.train.monitor")] * 2  # 4 optimizer steps / check_every=2
    assert len(monitor.history) == 4

"""Canary: the two GradScaler internals TrainStep reads (see trainfit/train/_scaler.py) still mean what we
think. If a torch upgrade breaks these, TrainStep's skipped-step detection must be revisited."""

from __future__ import annotations

import torch

from trainfit.train import _scaler


def _setup(init_scale: float):
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = lin(torch.randn(2, 4)).float().sum()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    return lin, opt, scaler


def test_found_inf_agrees_with_whether_the_optimizer_stepped():
    for init_scale, expect_skip in ((2.0**40, True), (1.0, False)):
        _, opt, scaler = _setup(init_scale)
        flag = _scaler.found_inf(scaler, opt)
        stepped: list[bool] = []
        opt.register_step_post_hook(lambda *a, _s=stepped: _s.append(True))
        scaler.step(opt)
        scaler.update()
        assert bool(flag.item() > 0) is expect_skip
        assert bool(stepped) is not expect_skip
        # the copy survives update() resetting the scaler's per-optimizer state
        assert bool(flag.item() > 0) is expect_skip


def test_scale_tensor_is_a_copy_of_get_scale():
    _, opt, scaler = _setup(2.0**40)
    scaler.step(opt)
    scaler.update()
    s = _scaler.scale_tensor(scaler)
    assert s.item() == scaler.get_scale() == 2.0**39
    assert _scaler.scale_tensor(torch.amp.GradScaler("cpu")).item() == 65536.0  # before any scale() call

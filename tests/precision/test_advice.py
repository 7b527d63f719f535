"""Precision advice follows the article's decision path; the snippets it prints actually run."""

from __future__ import annotations

import pytest
import torch

from trainfit.hardware.gpus import get_gpu, list_gpus
from trainfit.precision.advice import (
    AcceleratorKind,
    accelerator_from_spec,
    cpu_accelerator,
    fp8_from_cc,
    native_bf16_from_cc,
    recommend,
    training_loop_snippet,
)
from trainfit.strategy import Precision

NVIDIA = [g for g in list_gpus() if g.compute_capability]


@pytest.mark.parametrize("gpu", NVIDIA, ids=lambda g: g.id)
def test_capability_rules_agree_with_catalog_flags(gpu):
    # Two independent sources: the catalog's per-GPU flags (from vendor datasheets) and the CC rule.
    assert native_bf16_from_cc(gpu.compute_capability) == gpu.bf16
    assert fp8_from_cc(gpu.compute_capability) == gpu.fp8


@pytest.mark.parametrize(
    ("gpu_id", "precision", "scaling"),
    [
        ("v100-sxm2-32gb", Precision.AMP_FP16, True),
        ("t4", Precision.AMP_FP16, True),
        ("a100-sxm-80gb", Precision.AMP_BF16, False),
        ("rtx-4090", Precision.AMP_BF16, False),
        ("mi300x", Precision.AMP_BF16, False),
    ],
)
def test_decision_path(gpu_id, precision, scaling):
    advice = recommend(accelerator_from_spec(get_gpu(gpu_id)))
    assert advice.precision is precision
    assert advice.loss_scaling is scaling
    assert advice.reasons


def test_fp16_gpus_warn_about_emulated_bf16_check():
    advice = recommend(accelerator_from_spec(get_gpu("t4")))
    assert any("including_emulation=False" in n for n in advice.notes)
    a100 = recommend(accelerator_from_spec(get_gpu("a100-sxm-80gb")))
    assert not any("including_emulation" in n for n in a100.notes)


def test_fp8_note_only_from_8_9():
    assert any("FP8" in n for n in recommend(accelerator_from_spec(get_gpu("l4"))).notes)
    assert not any("FP8" in n for n in recommend(accelerator_from_spec(get_gpu("a100-sxm-80gb"))).notes)


def test_cpu_recommends_fp32():
    advice = recommend(cpu_accelerator())
    assert advice.accelerator.kind is AcceleratorKind.CPU
    assert advice.precision is Precision.FP32 and not advice.loss_scaling


def test_fp16_snippet_orders_unscale_clip_step_update():
    s = training_loop_snippet("amp-fp16")
    assert "torch.cuda.amp" not in s and "torch.amp.GradScaler" in s and "torch.autocast" in s
    order = [s.index(k) for k in ("scaler.scale(loss)", "scaler.unscale_", "clip_grad_norm_", "scaler.step",
                                  "scaler.update", "zero_grad(set_to_none=True)")]  # fmt: skip
    assert order == sorted(order)
    assert "/ accum" in s


@pytest.mark.parametrize("precision", ["fp32", "amp-bf16", "amp-fp16"])
def test_snippet_runs_on_cpu_and_trains(precision):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(64, 8)
    y = x.sum(dim=1, keepdim=True)
    loader = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 64, 8)] * 4

    def loss_fn(m, batch):
        return torch.nn.functional.mse_loss(m(batch[0]).float(), batch[1])

    before = loss_fn(model, (x, y)).item()
    code = training_loop_snippet(precision, device="cpu")
    exec(code, {"model": model, "optimizer": optimizer, "loader": loader, "loss_fn": loss_fn})
    after = loss_fn(model, (x, y)).item()
    assert after < before


def test_amd_advice_speaks_of_matrix_cores_not_tensor_cores_or_compute_capability() -> None:
    from trainfit.hardware import get_gpu
    from trainfit.precision.advice import accelerator_from_spec, recommend

    text = " ".join(recommend(accelerator_from_spec(get_gpu("mi250x"))).reasons)
    assert "matrix cores" in text and "tensor cores" not in text and "compute capability" not in text

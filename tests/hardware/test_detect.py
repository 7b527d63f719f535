"""Local detection with a faked torch.cuda: native bf16 is the compute capability, not is_bf16_supported()."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from trainfit.hardware import detect
from trainfit.precision.advice import AcceleratorKind, recommend
from trainfit.strategy import Precision


def fake_cuda(monkeypatch, devices, *, hip=None, bf16_supported=True):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(devices))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: devices[i])
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16_supported)
    monkeypatch.setattr(torch.cuda, "device", lambda i: contextlib.nullcontext())
    monkeypatch.setattr(torch.version, "hip", hip)


def props(name, gib, major=0, minor=0, arch=""):
    return SimpleNamespace(name=name, total_memory=gib * 2**30, major=major, minor=minor, gcnArchName=arch)


def test_t4_is_not_native_bf16_even_though_torch_says_supported(monkeypatch):
    fake_cuda(monkeypatch, [props("Tesla T4", 15, 7, 5)], bf16_supported=True)
    (acc,) = detect.detect_accelerators()
    assert acc.kind is AcceleratorKind.CUDA
    assert acc.native_bf16 is False and acc.bf16_supported_with_emulation is True
    assert acc.compute_capability == "7.5" and acc.catalog_id == "t4"
    assert recommend(acc).precision is Precision.AMP_FP16


def test_identical_devices_are_grouped(monkeypatch):
    fake_cuda(monkeypatch, [props("NVIDIA H100 80GB HBM3", 80, 9, 0)] * 8)
    (acc,) = detect.detect_accelerators()
    assert acc.count == 8 and acc.native_bf16 and acc.fp8 and acc.tf32
    assert recommend(acc).precision is Precision.AMP_BF16


def test_ada_has_fp8_ampere_does_not(monkeypatch):
    fake_cuda(monkeypatch, [props("NVIDIA L4", 22, 8, 9), props("NVIDIA A100-SXM4-80GB", 80, 8, 0)])
    l4, a100 = detect.detect_accelerators()
    assert l4.fp8 and not a100.fp8
    assert l4.native_bf16 and a100.native_bf16
    assert a100.catalog_id == "a100-sxm-80gb"


@pytest.mark.parametrize(
    ("arch", "bf16", "fp8"),
    [("gfx942:sramecc+:xnack-", True, True), ("gfx90a", True, False), ("gfx906", False, False)],
)
def test_rocm_uses_architecture_not_is_bf16_supported(monkeypatch, arch, bf16, fp8):
    fake_cuda(monkeypatch, [props("AMD Instinct", 64, arch=arch)], hip="6.2", bf16_supported=True)
    (acc,) = detect.detect_accelerators()
    assert acc.kind is AcceleratorKind.ROCM
    assert (acc.native_bf16, acc.fp8) == (bf16, fp8)


def test_no_cuda_means_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    acc = detect.detect_accelerator()
    assert acc.kind is AcceleratorKind.CPU
    assert recommend(acc).precision is Precision.FP32


@pytest.mark.parametrize(
    ("name", "gib", "expected"),
    [
        ("Tesla V100-SXM2-32GB", 32, "v100-sxm2-32gb"),
        ("Tesla V100-SXM2-16GB", 16, "v100-sxm2-16gb"),
        ("NVIDIA GeForce RTX 4090", 24, "rtx-4090"),
        ("NVIDIA L40S", 45, "l40s"),
        ("NVIDIA RTX A6000", 48, "rtx-a6000"),
        ("NVIDIA GH200 480GB", 96, "gh200-96gb"),
        ("Some Unknown Accelerator", 8, None),
    ],
)
def test_match_catalog(name, gib, expected):
    spec = detect.match_catalog(name, gib * 2**30)
    assert (spec.id if spec else None) == expected

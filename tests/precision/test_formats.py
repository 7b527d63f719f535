"""Formats are derived from bit layouts; these tests hold them against torch, numpy and ml_dtypes."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfit.precision.formats import (
    BF16,
    FLOAT_FORMATS,
    FP8_E4M3,
    FP8_E5M2,
    FP16,
    FP32,
    INT8,
    TF32,
    UnknownFormatError,
    edge_facts,
    get_format,
    headroom_binades,
    quantize,
)

TORCH_FORMATS = [f for f in FLOAT_FORMATS if f.torch_dtype]


@pytest.mark.parametrize("fmt", TORCH_FORMATS, ids=lambda f: f.id)
def test_limits_match_torch_finfo(fmt):
    fi = torch.finfo(getattr(torch, fmt.torch_dtype))
    assert fi.bits == fmt.bits
    assert fi.max == fmt.max_finite
    assert fi.smallest_normal == fmt.min_normal
    assert fi.eps == fmt.epsilon


@pytest.mark.parametrize("fmt", [FP16, FP32], ids=lambda f: f.id)
def test_limits_match_numpy_finfo(fmt):
    fi = np.finfo(getattr(np, fmt.numpy_name))
    assert fi.nexp == fmt.exponent_bits
    assert fi.nmant == fmt.mantissa_bits
    assert float(fi.max) == fmt.max_finite
    assert float(fi.smallest_normal) == fmt.min_normal
    assert float(fi.smallest_subnormal) == fmt.min_subnormal
    assert fi.minexp == fmt.emin
    assert fi.maxexp == fmt.emax + 1
    assert fi.precision == math.floor(-math.log10(fmt.epsilon))


@pytest.mark.parametrize("fmt", [BF16, FP8_E4M3, FP8_E5M2], ids=lambda f: f.id)
def test_limits_match_ml_dtypes(fmt):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    fi = ml_dtypes.finfo(getattr(ml_dtypes, fmt.ml_dtypes_name))
    assert fi.nexp == fmt.exponent_bits
    assert fi.nmant == fmt.mantissa_bits
    assert float(fi.max) == fmt.max_finite
    assert float(fi.smallest_normal) == fmt.min_normal
    assert float(fi.smallest_subnormal) == fmt.min_subnormal
    assert float(fi.eps) == fmt.epsilon
    assert fi.minexp == fmt.emin
    assert fi.maxexp == fmt.emax + 1


def test_tf32_is_fp32_range_with_fp16_mantissa():
    assert TF32.max_finite == pytest.approx(FP32.max_finite, rel=1e-3)
    assert TF32.min_normal == FP32.min_normal
    assert TF32.epsilon == FP16.epsilon
    assert TF32.bits == 19 and TF32.memory_bits == 32


def test_bias_and_well_known_constants():
    # Independent literature values (IEEE 754-2019 Table 3.5; OCP OFP8 Table 1), not our own output.
    assert (FP16.bias, BF16.bias, FP32.bias, FP8_E4M3.bias, FP8_E5M2.bias) == (15, 127, 127, 7, 15)
    assert FP8_E4M3.max_finite == 448 and FP8_E5M2.max_finite == 57344
    assert FP16.min_subnormal == 2.0**-24


@pytest.mark.parametrize("fmt", [f for f in TORCH_FORMATS if f.has_inf], ids=lambda f: f.id)
def test_overflow_threshold_matches_torch_cast(fmt):
    dtype = getattr(torch, fmt.torch_dtype)
    # float32 sources: torch casts float64 through float32, so a double just below 65520 rounds to
    # 65520.0f first and then to inf (double rounding) — not a property of the format.
    t = torch.tensor([fmt.overflow_threshold], dtype=torch.float32)
    below = torch.nextafter(t, torch.zeros_like(t))
    assert math.isinf(t.to(dtype).item())
    assert below.to(dtype).item() == fmt.max_finite


def test_e4m3_threshold_and_torch_saturation():
    t = FP8_E4M3.overflow_threshold
    assert t == 464
    assert torch.tensor([t]).to(torch.float8_e4m3fn).item() == 448  # the tie rounds to even (448)
    assert quantize(t, FP8_E4M3) == 448
    # torch saturates out-of-range values where the spec (and our reference) says NaN.
    assert torch.tensor([500.0]).to(torch.float8_e4m3fn).item() == 448
    assert math.isnan(quantize(500.0, FP8_E4M3))


@pytest.mark.parametrize("fmt", TORCH_FORMATS, ids=lambda f: f.id)
def test_flush_threshold_matches_torch_cast(fmt):
    dtype = getattr(torch, fmt.torch_dtype)
    if fmt is FP32:
        pytest.skip("fp32's flush threshold is below float32 itself")
    t = torch.tensor([fmt.flush_threshold], dtype=torch.float32)
    above = torch.nextafter(t, torch.ones_like(t))
    assert t.to(dtype).item() == 0.0
    assert above.to(dtype).item() == fmt.min_subnormal


fp32_values = st.floats(width=32, allow_nan=False, allow_infinity=False)


@pytest.mark.parametrize("fmt", [FP16, BF16, FP8_E5M2], ids=lambda f: f.id)
@settings(max_examples=400, deadline=None)
@given(x=fp32_values)
def test_quantize_matches_torch_cast(fmt, x):
    expected = torch.tensor([x], dtype=torch.float32).to(getattr(torch, fmt.torch_dtype)).double().item()
    assert quantize(x, fmt) == expected or (math.isinf(expected) and quantize(x, fmt) == expected)


@settings(max_examples=400, deadline=None)
@given(x=st.floats(min_value=-464, max_value=464, width=32))
def test_quantize_matches_torch_cast_e4m3_in_range(x):
    expected = torch.tensor([x], dtype=torch.float32).to(torch.float8_e4m3fn).double().item()
    assert quantize(x, FP8_E4M3) == expected


@settings(max_examples=400, deadline=None)
@given(x=st.floats(allow_nan=False, allow_infinity=False))
def test_quantize_matches_numpy_float16_from_double(x):
    with np.errstate(over="ignore"):
        expected = float(np.float16(x))
    assert quantize(x, FP16) == expected


@settings(max_examples=300, deadline=None)
@given(x=fp32_values)
def test_quantize_matches_ml_dtypes_bf16(x):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    expected = float(np.float32(x).astype(ml_dtypes.bfloat16))
    assert quantize(x, BF16) == expected


@settings(max_examples=300, deadline=None)
@given(a=st.floats(-1e6, 1e6), b=st.floats(-1e6, 1e6))
def test_quantize_is_monotone_and_idempotent(a, b):
    lo, hi = sorted((a, b))
    for fmt in (FP16, BF16):
        assert quantize(lo, fmt) <= quantize(hi, fmt)
        q = quantize(a, fmt)
        assert quantize(q, fmt) == q


@settings(max_examples=300, deadline=None)
@given(x=st.floats(min_value=1e-4, max_value=6e4))
def test_relative_error_bounded_by_unit_roundoff_in_normal_range(x):
    assert abs(quantize(x, FP16) - x) / x <= FP16.unit_roundoff


def test_edge_facts_agree_with_torch():
    facts = {f.id: f for f in edge_facts()}
    assert facts["fp16-overflow-threshold"].result == 65520
    assert math.isinf(torch.tensor([65520.0]).half().item())
    assert torch.tensor([65519.0]).half().item() == 65504
    assert facts["fp16-adam-eps"].result == torch.tensor([1e-8]).half().item() == 0.0
    b = (torch.tensor([256.0], dtype=torch.bfloat16) + torch.tensor([1.0], dtype=torch.bfloat16)).item()
    assert facts["bf16-256-plus-1"].result == b == 256
    scaled = torch.tensor([1e-8 * 65536]).half().item()
    assert facts["fp16-gradient-underflow"].result == scaled != 0
    assert math.isnan(facts["fp8-e4m3-no-inf"].result)


def test_int8_matches_torch_iinfo():
    ii = torch.iinfo(torch.int8)
    assert (INT8.min_value, INT8.max_value, INT8.bits) == (ii.min, ii.max, ii.bits)
    assert INT8.absmax_step(127.0) == 1.0


def test_headroom():
    assert headroom_binades(FP16.max_finite / 8, FP16) == pytest.approx(3.0)
    assert headroom_binades(1e6, FP16) < 0
    assert headroom_binades(0.0, FP16) == math.inf


def test_get_format_and_unknown():
    assert get_format("float16") is FP16
    assert get_format("BF16") is BF16
    with pytest.raises(UnknownFormatError, match="fp16"):
        get_format("fp61")


def test_formats_module_is_torch_free():
    code = "import sys, trainfit.precision.formats, trainfit.precision.advice; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

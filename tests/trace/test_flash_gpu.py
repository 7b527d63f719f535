"""A GPU without FlashAttention (compute capability < 8.0): the trace's CUDA emulation and the analytic model
pick the same SDPA kernel, and agree on the memory."""

from __future__ import annotations

import pytest

from trainfit.strategy import Strategy

from .conftest import tiny_spec

pytest.importorskip("torch")
from trainfit.analytic import estimate_analytic
from trainfit.analytic.activations import sdpa_kernel
from trainfit.trace import trace_spec
from trainfit.trace.agreement import PEAK_TOLERANCE, compare


@pytest.mark.parametrize(("family", "kernel"), [("llama", "math"), ("gpt2", "efficient")])
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_no_flash_gpu(family: str, kernel: str, checkpointing: str) -> None:
    spec = tiny_spec(family)
    s = Strategy(precision="amp-fp16", micro_batch=2, seq_len=256, checkpointing=checkpointing, flash_sdp=False)
    assert sdpa_kernel(spec, s) == kernel  # GQA (llama) has no fused kernel without flash
    traced = trace_spec(spec, s)
    assert set(traced.extra["sdpa_backends"]) == {kernel}
    ag = compare(estimate_analytic(spec, s), traced)
    assert abs(ag.peak_rel) <= PEAK_TOLERANCE, ag
    with_flash = trace_spec(
        spec, Strategy(precision="amp-fp16", micro_batch=2, seq_len=256, checkpointing=checkpointing)
    )
    assert set(with_flash.extra["sdpa_backends"]) == {"flash"}

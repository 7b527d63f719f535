"""The optimizer step's temporaries: the trace and the analytic model agree up to gradient clipping's
scratch, which the analytic model leaves out: ``clip_grad_norm_`` (max_grad_norm=1.0, the Trainer's default)
keeps one 0-dim fp32 norm per tensor (a 512-byte block each) while it stacks them, plus the stack, the total
norm and the clip coefficients — at most 512·(tensors + 4) bytes for these small models."""

from __future__ import annotations

import pytest

from trainfit.arch.params import inventory
from trainfit.result import Component, Phase
from trainfit.strategy import Strategy

from .conftest import tiny_spec

pytest.importorskip("torch")
from trainfit.analytic import estimate_analytic
from trainfit.trace import trace_spec


@pytest.mark.parametrize(
    ("optimizer", "precision"), [("lion", "fp32"), ("lion", "pure-bf16"), ("adamw-8bit", "amp-bf16")]
)
def test_step_temporaries_agree_up_to_clipping(optimizer: str, precision: str) -> None:
    spec = tiny_spec("llama")
    s = Strategy(precision=precision, optimizer=optimizer, micro_batch=1, seq_len=64)  # type: ignore[arg-type]
    traced = trace_spec(spec, s).phase(Phase.OPTIMIZER_STEP).get(Component.TEMPORARIES)
    analytic = estimate_analytic(spec, s).phase(Phase.OPTIMIZER_STEP).get(Component.TEMPORARIES)
    tensors = sum(count for _, count in inventory(spec).all_tensors())
    assert 0 <= traced - analytic <= 512 * (tensors + 4), (traced, analytic)

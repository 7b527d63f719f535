"""``--fp8 tensorwise``: the analytic model against the trace of torchao's real ``Float8Linear`` on fake tensors.

The trace swaps the block linears with torchao's ``convert_to_float8_training`` (trace/float8.py) and runs the
module's own autograd function, casts and ``torch._scaled_mm`` included; the analytic side is
:mod:`trainfit.analytic.float8`'s closed forms. A wide MLP and a small vocabulary put the casts' transients, not
the logits, at the peaks. Skipped without torchao (an optional extra: ``trainfit[fp8]``).
"""

from __future__ import annotations

import pytest

from trainfit.strategy import Strategy

from .conftest import tiny_spec, traced_once

pytest.importorskip("torch")
pytest.importorskip("torchao.float8")
from trainfit.analytic import estimate_analytic
from trainfit.analytic.float8 import block_linears
from trainfit.result import Component, MemoryReport, Phase
from trainfit.trace import trace_spec
from trainfit.trace.agreement import PEAK_TOLERANCE, compare

WIDE = {"hidden_size": 128, "intermediate_size": 1024, "vocab_size": 64, "head_dim": 32}


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["pure-bf16", "amp-bf16"])
def test_analytic_within_tolerance_of_traced_float8linear(precision: str) -> None:
    spec = tiny_spec("llama", **WIDE)
    s = Strategy(precision=precision, micro_batch=2, seq_len=256, float8="tensorwise")  # type: ignore[arg-type]
    traced = traced_once(trace_spec, spec, s)
    analytic = estimate_analytic(spec, s)
    ag = compare(analytic, traced)
    detail = "; ".join(f"{g.phase.value} {g.rel * 100:+.1f}% ({g.largest_component_gap()})" for g in ag.phases)
    assert abs(ag.peak_rel) <= PEAK_TOLERANCE, detail
    for gap in ag.phases:
        if gap.phase in (Phase.FORWARD, Phase.BACKWARD):
            assert abs(gap.rel) <= PEAK_TOLERANCE, detail
    # Converted weights get no autocast copy in either method (only the LM head's, under amp).
    tr = traced.phase(Phase.BACKWARD).components.get(Component.AUTOCAST_COPIES, 0)
    an = analytic.phase(Phase.BACKWARD).components.get(Component.AUTOCAST_COPIES, 0)
    assert tr == an


@pytest.mark.slow
def test_fp8_casts_raise_the_traced_backward() -> None:
    """The casts are real in the trace: the fp8 step's backward holds more than the bf16 step's (both save the
    bf16 linear's tensors; the difference is the casts' transients), and so does the analytic one."""
    spec = tiny_spec("llama", **WIDE)
    plain = Strategy(precision="pure-bf16", micro_batch=2, seq_len=256)
    fp8 = Strategy(precision="pure-bf16", micro_batch=2, seq_len=256, float8="tensorwise")
    a, b = trace_spec(spec, plain), traced_once(trace_spec, spec, fp8)
    grown = b.phase(Phase.BACKWARD).total_bytes - a.phase(Phase.BACKWARD).total_bytes
    analytic = estimate_analytic(spec, fp8).phase(Phase.BACKWARD).total_bytes
    assert grown > 0
    assert analytic - estimate_analytic(spec, plain).phase(Phase.BACKWARD).total_bytes > 0
    assert sum(x.converted for x in block_linears(spec)) == 7


@pytest.mark.slow
# DDP's cell is full-matrix only: a DDP rank with Float8Linear is the one-GPU fp8 model (test above) plus DDP's
# buckets (tests/trace/test_distributed.py); FSDP2's cell is where fp8 meets sharded states.
@pytest.mark.parametrize("sharding", ["fsdp", pytest.param("ddp", marks=pytest.mark.full_matrix)])
def test_one_rank_of_fsdp2_and_ddp_with_float8linear(sharding: str) -> None:
    """torchtitan's order: Float8Linear swapped in, then ``fully_shard`` / DDP (trace/distributed.py) on the fake
    process group. What fp8 adds to a rank — each method's fp8 run minus its bf16 run — agrees within 3% of the
    rank's traced peak (the bf16 runs themselves are checked in tests/trace/test_distributed.py)."""
    from trainfit.analytic.parallel import estimate_parallel
    from trainfit.strategy import Parallelism
    from trainfit.trace.distributed import trace_distributed

    spec = tiny_spec("llama", **WIDE)

    def both(fp8: str) -> tuple[MemoryReport, MemoryReport]:
        s = Strategy(
            precision="amp-bf16",
            parallelism=Parallelism(data=2),
            sharding=sharding,  # type: ignore[arg-type]
            micro_batch=2,
            seq_len=256,
            float8=fp8,  # type: ignore[arg-type]
        )
        return estimate_parallel(spec, s), trace_distributed(spec, s)

    (a0, t0), (a1, t1) = both("none"), both("tensorwise")
    for ph in (Phase.FORWARD, Phase.BACKWARD):
        added_a = a1.phase(ph).total_bytes - a0.phase(ph).total_bytes
        added_t = t1.phase(ph).total_bytes - t0.phase(ph).total_bytes
        assert abs(added_a - added_t) <= 0.03 * t1.phase(ph).total_bytes, (ph, added_a, added_t)

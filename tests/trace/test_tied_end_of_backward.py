"""The end of backward of a tied model, analytic vs trace: the token table's two dense gradients meet there
(``trainfit.analytic.states.tied_gradient_sum``) and, with a large vocabulary and few tokens, that moment is the
backward's peak. Out of place (the head reads the table itself) the sum is one table more than in place (behind
autocast's cast); with accumulation the head's buffered gradient sits beside the resident ``.grad``. The trace
replays autograd's in-place rule (``Tracker.merge_inplace_accumulations``, held to a real CPU run of a tied table
by tests/trace/test_real_cpu.py). Before the closed form followed it, the out-of-place cases were one table (16%)
low."""

from __future__ import annotations

import pytest

from trainfit.result import Phase
from trainfit.strategy import MemorySavers, Strategy

from .conftest import tiny_spec

pytest.importorskip("torch")
from trainfit.analytic import estimate_analytic
from trainfit.trace import trace_spec

CASES = [
    pytest.param("pure-bf16", "none", 1, MemorySavers(), id="pure-bf16"),
    # the savers table's Llama-3.2-1B row: with the layers' activations on the host the end of backward is the peak
    pytest.param("pure-bf16", "none", 1, MemorySavers(activation_offload=True), id="pure-bf16-offload"),
    pytest.param("fp32", "full", 2, MemorySavers(), id="fp32-full-accum2"),
    pytest.param("amp-bf16", "none", 1, MemorySavers(), id="amp-bf16-in-place"),
]


@pytest.mark.parametrize(("precision", "ckpt", "accum", "savers"), CASES)
def test_tied_end_of_backward(precision: str, ckpt: str, accum: int, savers: MemorySavers) -> None:
    spec = tiny_spec("qwen2", vocab_size=32768)
    s = Strategy(
        precision=precision,  # type: ignore[arg-type]
        checkpointing=ckpt,  # type: ignore[arg-type]
        grad_accum=accum,
        micro_batch=1,
        seq_len=16,
        savers=savers,
    )
    a, t = estimate_analytic(spec, s), trace_spec(spec, s)
    ab, tb = (next(p for p in r.phases if p.phase is Phase.BACKWARD) for r in (a, t))
    assert abs(ab.total_bytes - tb.total_bytes) <= 0.005 * tb.total_bytes, (ab.total_bytes, tb.total_bytes)

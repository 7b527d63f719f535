"""Gradient accumulation in the trace (issue 15 item 8): a step is several forward/backward passes whose
gradients autograd adds into the existing ``.grad`` tensors, so from the second pass on every gradient is
resident through forward and backward — as the analytic model keeps them."""

from __future__ import annotations

import pytest

from trainfit.result import Component, Phase
from trainfit.strategy import Strategy

from .conftest import tiny_spec

torch = pytest.importorskip("torch")

from trainfit.analytic import estimate_analytic  # noqa: E402
from trainfit.trace import readout, trace, trace_spec  # noqa: E402
from trainfit.trace import runner as rn  # noqa: E402
from trainfit.trace.agreement import PEAK_TOLERANCE, compare  # noqa: E402
from trainfit.trace.timeline import Label  # noqa: E402

from .test_real_cpu import TOL_BYTES, _run, profiled_window_peaks  # noqa: E402

C = Component

CASES = [
    ("llama", {}),
    ("llama", {"checkpointing": "full"}),
    ("qwen2", {"precision": "master-bf16"}),
    ("gpt2", {"precision": "fp32"}),
]


def _spec(family: str, layers: int = 6):  # type: ignore[no-untyped-def]
    return tiny_spec(family, **{("n_layer" if family == "gpt2" else "num_hidden_layers"): layers})


@pytest.mark.parametrize(("family", "kw"), CASES)
def test_gradients_resident_in_forward_and_backward_as_analytic(family: str, kw: dict[str, str]) -> None:
    spec = _spec(family)
    one = trace_spec(spec, Strategy(micro_batch=2, seq_len=64, **kw))  # type: ignore[arg-type]
    st = Strategy(micro_batch=2, seq_len=64, grad_accum=2, **kw)  # type: ignore[arg-type]
    acc, analytic = trace_spec(spec, st), estimate_analytic(spec, st)
    # Every model gradient, as at the optimizer step of a plain run (master recipes: the 16-bit ones).
    grads = analytic.phase(Phase.FORWARD).get(C.GRADIENTS)
    assert grads > 0
    for ph in (Phase.FORWARD, Phase.BACKWARD):
        assert acc.phase(ph).get(C.GRADIENTS) == grads, ph
    # The forward pass is the plain one plus the resident gradients, byte for byte.
    assert acc.phase(Phase.FORWARD).total_bytes == one.phase(Phase.FORWARD).total_bytes + grads
    assert acc.phase(Phase.OPTIMIZER_STEP) == one.phase(Phase.OPTIMIZER_STEP)
    assert abs(compare(analytic, acc).peak_rel) <= PEAK_TOLERANCE, (analytic.peak_bytes, acc.peak_bytes)


@pytest.mark.parametrize(("family", "kw"), [CASES[0], pytest.param(*CASES[1], marks=pytest.mark.full_matrix)])
def test_extrapolation_still_equals_full_depth(family: str, kw: dict[str, str]) -> None:
    spec = _spec(family, 7)
    st = Strategy(micro_batch=2, seq_len=64, grad_accum=4, **kw)  # type: ignore[arg-type]
    ext, full = trace_spec(spec, st), trace_spec(spec, st, extrapolate=False)
    assert ext.extra["extrapolated"] and full.extra["layers_traced"] == [7]
    for pe, pf in zip(ext.phases, full.phases, strict=True):
        assert pe.components == pf.components, pe.phase


def test_accumulation_count_beyond_two_costs_the_same() -> None:
    """Passes 3, 4, ... of a step repeat pass 2: only two are run, and the numbers do not depend on N."""
    spec = _spec("llama", 4)
    r2, r8 = (trace_spec(spec, Strategy(micro_batch=1, seq_len=32, grad_accum=n)) for n in (2, 8))
    assert r2.phases == r8.phases
    assert any("accumulation" in n for n in r8.notes)


def test_generic_trace_accumulates() -> None:
    def model() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))

    def run(n: int):  # type: ignore[no-untyped-def]
        return trace(
            model,
            lambda: (torch.zeros(8, 256),),
            loss_fn=lambda out, _b: out.float().pow(2).mean(),
            precision="fp32",
            grad_accum=n,
        )

    one, two = run(1), run(2)
    grads = one.phase(Phase.OPTIMIZER_STEP).get(C.GRADIENTS)
    assert one.phase(Phase.FORWARD).get(C.GRADIENTS) == 0
    assert two.phase(Phase.FORWARD).get(C.GRADIENTS) == two.phase(Phase.BACKWARD).get(C.GRADIENTS) == grads


def test_runner_runs_two_passes_after_the_first_step() -> None:
    opts = rn.RunOptions(recipe=Strategy().recipe, steps=3, grad_accum=5)
    assert [opts.passes(s) for s in range(3)] == [1, 2, 2]
    assert rn.RunOptions(recipe=Strategy().recipe).passes(1) == 1
    with pytest.raises(Exception, match="grad_accum"):
        rn.RunOptions(recipe=Strategy().recipe, grad_accum=0)


def test_fake_accumulating_pass_matches_a_real_cpu_run() -> None:
    """AccumulateGrad adds into an existing ``.grad`` in place (``variable_grad += new_grad``), also under
    fake tensors: the second pass of a step equals a real CPU run's, measured by the profiler."""
    spec = tiny_spec("llama", num_hidden_layers=3)
    s = Strategy(micro_batch=2, seq_len=128, grad_accum=2)
    run = _run(spec, s, rn.fake_mode(), grad_accum=2)
    second = [iv for iv in run.timeline.phase_intervals() if iv.label.micro_step == 1]
    assert [iv.label.phase for iv in second] == [Phase.FORWARD, Phase.BACKWARD]
    fake = {pk.label.phase: pk.total_bytes for pk in run.tracker.peaks(second)}
    # the accumulating pass holds every gradient: more than the first pass of the step
    first = readout.worst_by(
        (pk.label.phase, pk)
        for pk in run.tracker.peaks(run.timeline.phase_intervals())
        if isinstance(pk.label, Label) and pk.label.micro_step == 0
    )
    assert all(fake[ph] > first[ph].total_bytes for ph in fake)

    real = profiled_window_peaks(
        lambda: _run(spec, s, None, track=False, annotate=True, grad_accum=2),
        {ph.value: f"trainfit:1.1:{ph.value}" for ph in fake},
    )
    for ph, nbytes in fake.items():
        best = real[ph.value]
        assert abs(nbytes - best) <= TOL_BYTES, (ph, nbytes, best)

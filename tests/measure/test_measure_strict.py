"""``--method measure`` on a real GPU, held tightly (issue 9 part 1): the depth-extrapolated measurement
equals a full-depth measurement, every layout run starts from the same allocation, and the measurement
agrees with the trace plus the cuBLAS workspaces (which the trace's own report leaves to ``estimate``). Skipped
without CUDA."""

from __future__ import annotations

import pytest

from trainfit.result import Phase
from trainfit.strategy import Strategy

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.trace.conftest import tiny_spec  # noqa: E402
from trainfit.measure import measure_spec  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

#: The measurement holds the cuBLAS/cuBLASLt workspaces (``measure.gpu.warm_up`` makes them before the first run;
#: the caching allocator serves them, so ``max_memory_allocated`` counts them) and the trace does not: they are
#: subtracted exactly, for this device's compute capability and this torch's release
#: (:func:`trainfit.allocator.workspaces.training_workspaces`). What may remain is the allocator's rounding the
#: measurement carries (unsplit cached blocks: up to 13 MiB per phase on the H200, ``DEPTH_SLACK_BYTES``). The
#: old allowance (128 MiB) predated the workspaces being modelled and let them go missing unnoticed (65 MiB on the
#: H200 under torch 2.11); not yet run on a GPU at this bound.
ROUNDING_SLACK_BYTES = 32 * 2**20


def _workspace_bytes() -> int:
    import os

    from trainfit.allocator.workspaces import parse_torch_version, training_workspaces

    cc = torch.cuda.get_device_capability()
    release = parse_torch_version(torch.__version__)
    return sum(w.size_bytes for w in training_workspaces(cc, os.environ, torch_version=release))


#: Extrapolated vs full depth, both measured: the allocator may hand out an unsplit cached block a little
#: larger than the request (counted whole by max_memory_allocated), which does not repeat per layer; the
#: measurement extrapolates the requested bytes and carries the deepest run's rounding unscaled
#: (measure/gpu.py), which can differ from the full depth's by a few blocks (master-bf16 sgd-momentum,
#: optimizer step: 10 MiB at 2 layers, 13 MiB at 6 on the H200).
DEPTH_SLACK_BYTES = 8 * 2**20

CASES = [
    dict(precision="amp-bf16"),
    dict(precision="fp32", checkpointing="full"),
    dict(precision="master-bf16", optimizer="sgd-momentum"),
    dict(precision="amp-bf16", grad_accum=2),
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kw", CASES)
def test_extrapolated_measurement_equals_full_depth(kw: dict[str, object]) -> None:
    spec = tiny_spec("llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=6, vocab_size=8192)
    st = Strategy(micro_batch=4, seq_len=1024, **kw)  # type: ignore[arg-type]
    ext = measure_spec(spec, st)
    full = measure_spec(spec, st, extrapolate=False, with_trace=False)
    assert ext.extra["layers_traced"] == [1, 2] and full.extra["layers_traced"] == [6]
    assert not ext.warnings and not full.warnings, (ext.warnings, full.warnings)
    for ph in Phase:
        e, f = ext.phase(ph).total_bytes, full.phase(ph).total_bytes
        assert abs(e - f) <= max(DEPTH_SLACK_BYTES, 0.01 * f), (ph, e, f)
        traced = int(ext.extra["trace"][ph.value]) + _workspace_bytes()
        assert abs(e - traced) <= max(ROUNDING_SLACK_BYTES, 0.02 * traced), (ph, e, traced)


@pytest.mark.gpu
@needs_gpu
def test_a_catalog_model_is_measured_within_two_percent_of_the_trace() -> None:
    """Issue 9's bound at a realistic size, where the tiny model's 32 MiB floor (about 9% of its phases) cannot hide
    a miss: qwen2.5-0.5b amp-bf16 2 × 1024, extrapolated as the CLI does, against the trace plus the workspaces, per
    phase within 2%; the reserve is the trace's simulated one (measure/gpu.py), so the verdict's reserved figure is
    ``--method trace``'s above the measured peak. About 6 s on an H200 plus a 15 s trace."""
    from trainfit.arch import load_model

    r = measure_spec(load_model("qwen2.5-0.5b"), Strategy(micro_batch=2, seq_len=1024))
    assert r.extra["extrapolated"] and not r.warnings, r.warnings
    for ph in Phase:
        measured, traced = r.phase(ph).total_bytes, int(r.extra["trace"][ph.value]) + _workspace_bytes()
        assert abs(measured / traced - 1) <= 0.02, (ph, measured, traced)
    assert any("simulated allocator" in n for n in r.notes), r.notes

"""Ground truth: the fake-tensor trace equals a real CPU run of the same steps, as measured by
``torch.profiler(profile_memory=True)`` (every allocator call, no dispatch mode in the way), with the CUDA
emulation switched off so both sides run the same kernels. The remaining difference is a constant few
tens of KiB (CPU-only tensors such as RNG state) — and it is what validates the replay of autograd's
in-place gradient accumulation, which fake tensors alone get wrong."""

from __future__ import annotations

import pytest

from trainfit.strategy import Strategy

from .conftest import tiny_spec

torch = pytest.importorskip("torch")
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from trainfit.result import Phase  # noqa: E402
from trainfit.trace import hf, readout  # noqa: E402
from trainfit.trace import runner as rn  # noqa: E402
from trainfit.trace import tracker as tk  # noqa: E402
from trainfit.trace.optim import make_optimizer  # noqa: E402

TOL_BYTES = 64 * 1024


def _run(spec, s: Strategy, mode, **kw):  # type: ignore[no-untyped-def]
    meta, _ = hf.build_meta(spec, s, rn.weight_dtype(s.recipe))
    n = meta.config.num_hidden_layers
    path, _stack = hf.find_stack(meta, n)
    model = hf.reduced_model(meta, path, list(range(n)), n)
    rn.materialize(model, mode, None)
    box: list[tk.Tracker] = []
    hf.install_checkpointing(model, list(model.get_submodule(path)), hf.blocks_for(n, s.checkpointing), box)
    fns = rn.StepFns(
        make_batch=hf.batch_fn(spec, s.micro_batch, s.seq_len),
        forward=lambda m, b: m(**b),
        loss_of=lambda o, _b: o.loss,
        make_optimizer=lambda p: make_optimizer(s.optimizer, p, adamw_impl="foreach"),
    )
    opts = rn.RunOptions(
        recipe=s.recipe, head_module=hf.head_of(model), prepare=box.append, grad_accum=kw.pop("grad_accum", 1)
    )
    with hf.runtime_patches():
        return rn.run_steps(model, fns, opts, rn.Execution(mode=mode, emulate_cuda=False, **kw))


def profiled_window_peaks(run_fn, windows: dict[str, str]) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """Run ``run_fn`` under the CPU profiler and return, per key, the peak live bytes (allocator-rounded)
    within the profiler range named by ``windows[key]``."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_fn()
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    ranges = {e.name(): (e.start_ns(), e.end_ns()) for e in events if e.name().startswith("trainfit:")}
    mem = [(e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"]
    out = {}
    for key, name in windows.items():
        lo, hi = ranges[name]
        live, best = 0, 0
        for t, n in mem:
            if t > hi:
                break
            live += tk.rounded(n) if n > 0 else -tk.rounded(-n)
            if t >= lo:
                best = max(best, live)
        out[key] = best
    return out


def _profiled_peaks(spec, s: Strategy) -> dict[str, int]:  # type: ignore[no-untyped-def]
    return profiled_window_peaks(
        lambda: _run(spec, s, None, track=False, annotate=True), {ph.value: f"trainfit:1:{ph.value}" for ph in Phase}
    )


@pytest.mark.parametrize(
    ("family", "overrides", "kw"),
    [
        ("llama", {"num_hidden_layers": 3}, dict(micro_batch=2, seq_len=128)),
        ("gpt2", {"n_layer": 3}, dict(micro_batch=2, seq_len=64, checkpointing="full", precision="fp32")),
        # a big tied vocabulary puts the backward peak at the embedding's gradient accumulation
        (
            "llama",
            {"num_hidden_layers": 2, "vocab_size": 16384, "tie_word_embeddings": True},
            dict(micro_batch=1, seq_len=16, precision="fp32"),
        ),
        ("mixtral", {"num_hidden_layers": 2}, dict(micro_batch=2, seq_len=64, precision="master-bf16")),
    ],
)
def test_fake_trace_matches_real_cpu_run(family: str, overrides: dict[str, object], kw: dict[str, object]) -> None:
    spec = tiny_spec(family, **overrides)
    s = Strategy(**kw)  # type: ignore[arg-type]
    fake = readout.phase_peaks(_run(spec, s, rn.fake_mode()))
    real = _profiled_peaks(spec, s)
    for ph, pk in fake.items():
        assert abs(pk.total_bytes - real[ph.value]) <= TOL_BYTES, (ph, pk.total_bytes, real[ph.value])

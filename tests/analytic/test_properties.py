"""Invariants of the analytic model (hypothesis), on its allocated bytes (the closed-form phases)."""

from __future__ import annotations

import dataclasses

from hypothesis import example, given, settings
from hypothesis import strategies as st

from trainfit.analytic import estimate_analytic
from trainfit.analytic.activations import attention_variants, sdpa_kernel
from trainfit.analytic.model import analytic_phases
from trainfit.arch import ModelSpec, catalog_slugs, load_model
from trainfit.result import Component
from trainfit.strategy import Attention, Checkpointing, Optimizer, Precision, Strategy

SLUGS = [s for s in catalog_slugs() if s not in ("deepseek-v3", "llama-3.1-405b")]

strategies = st.builds(
    Strategy,
    precision=st.sampled_from(list(Precision)),
    optimizer=st.sampled_from(list(Optimizer)),
    # sac refuses eager/math attention and MoE (one line); tests/analytic/test_savers.py and the trace hold it
    checkpointing=st.sampled_from([c for c in Checkpointing if c is not Checkpointing.SAC]),
    attention=st.sampled_from(list(Attention)),
    micro_batch=st.integers(1, 16),
    seq_len=st.integers(1, 8192),
    grad_accum=st.integers(1, 4),
)


@settings(max_examples=80, deadline=None)
@given(slug=st.sampled_from(SLUGS), s=strategies)
def test_components_nonnegative_and_peak_is_sum(slug: str, s: Strategy) -> None:
    phases = analytic_phases(load_model(slug), s)
    for p in phases:
        assert all(v >= 0 for v in p.components.values())
        assert p.total_bytes == sum(p.components.values())


@settings(max_examples=15, deadline=None)
@given(slug=st.sampled_from(SLUGS), s=strategies)
def test_the_report_is_the_closed_form(slug: str, s: Strategy) -> None:
    """The invariants here test :func:`analytic_phases`; the report's phases are exactly those plus the allocator's
    block rounding (:mod:`trainfit.analytic.blocks`, never negative), and its peak is their largest."""
    r = estimate_analytic(load_model(slug), s)
    rounded = [p.get(Component.ALLOCATOR_ROUNDING) for p in r.phases]
    assert min(rounded) >= 0
    closed = tuple(
        dataclasses.replace(p, components={**p.components, Component.ALLOCATOR_ROUNDING: 0}) for p in r.phases
    )
    assert analytic_phases(load_model(slug), s) == closed
    assert r.peak_bytes == sum(r.peak.components.values())
    assert r.peak_bytes == max(p.total_bytes for p in r.phases)


def peak(spec: ModelSpec, s: Strategy) -> int:
    """``estimate_analytic(spec, s).peak_bytes`` (allocated) without the allocator simulation, which these
    invariants do not look at (fragmentation is not monotonic in anything)."""
    return max(p.total_bytes for p in analytic_phases(spec, s))


def _kernels(spec: ModelSpec, s: Strategy) -> list[str]:
    return [sdpa_kernel(v, s) for v, _ in attention_variants(spec, s)]


@settings(max_examples=80, deadline=None)
@given(slug=st.sampled_from(SLUGS), s=strategies, db=st.integers(1, 8), ds=st.integers(1, 2048))
# Mistral-7B in fp32 at the sliding window (hypothesis seed 108): below 4096 tokens SDPA gets no mask and
# grouped k/v, so fp32 runs the math kernel (fp32 b·heads·s² scores); from 4096 on transformers passes the
# window mask and repeats k/v, and SDPA runs the memory-efficient kernel. Real memory drops there.
@example(
    slug="mistral-7b-v0.1",
    s=Strategy(precision="fp32", optimizer="sgd", micro_batch=1, seq_len=4095),
    db=1,
    ds=1,
)
@example(slug="starcoder2-7b", s=Strategy(precision="amp-bf16", seq_len=2048), db=1, ds=2048)
def test_monotonic_in_batch_and_seq(slug: str, s: Strategy, db: int, ds: int) -> None:
    """Memory never decreases with the batch, nor with the sequence while SDPA keeps its kernel. The one
    mechanism that changes the kernel with the length is a sliding window: transformers passes a mask (and
    repeats k/v) only once the sequence reaches the window, which can move SDPA from the math kernel to the
    memory-efficient one."""
    spec = load_model(slug)
    base = peak(spec, s)
    assert peak(spec, dataclasses.replace(s, micro_batch=s.micro_batch + db)) >= base
    longer = dataclasses.replace(s, seq_len=s.seq_len + ds)
    if peak(spec, longer) >= base:
        return
    # Only a kernel change may lower it: the window's mask moving SDPA off the math kernel (a move between
    # fused kernels, e.g. flash → memory-efficient at Starcoder2's window, does not lower memory).
    window = spec.sliding_window
    assert window is not None and s.seq_len < window <= longer.seq_len
    assert _kernels(spec, s).count("math") > _kernels(spec, longer).count("math")


def _no_cache_slack(spec: ModelSpec, s: Strategy, c: Checkpointing) -> int:
    """The two ways checkpointing can add bytes, both only when the end of backward is the peak:

    * HF turns the KV cache off under gradient checkpointing. For a fused-qkv model with RoPE the cache had
      replaced v (a view of the fused output) by a copy, so a layer recomputed without the cache keeps the
      whole fused output: a·t·(q_dim + kv_dim) more per recomputed layer.
    * The first segment's input (the embedding output, r·t·h) is kept by its checkpoint while that segment is
      recomputed for the last backward step; without checkpointing nothing saves it when the norm saves an
      fp32 copy instead (a 16-bit residual stream with RMSNorm), so with every gradient resident the bottom
      block can outweigh the embedding's moment by it (Mixtral pure-bf16, hypothesis)."""
    from trainfit.analytic.activations import Widths

    first_input = Widths.of(s).residual * s.tokens_per_micro_batch * spec.hidden_size
    if not (spec.fused_qkv and spec.rotary_dim and spec.use_cache):
        return first_input
    per_segment = dataclasses.replace(s, checkpointing=c).checkpoint_layout(spec.num_layers).largest_segment
    a = s.recipe.compute_bits // 8
    return per_segment * a * s.tokens_per_micro_batch * (spec.q_dim + spec.kv_dim) + first_input


@settings(max_examples=80, deadline=None)
@given(slug=st.sampled_from(SLUGS), s=strategies)
@example(slug="mixtral-8x7b-v0.1", s=Strategy(precision="pure-bf16", micro_batch=7, seq_len=761))
def test_checkpointing_never_increases_memory(slug: str, s: Strategy) -> None:
    spec = load_model(slug)
    none = peak(spec, dataclasses.replace(s, checkpointing=Checkpointing.NONE))
    for c in (Checkpointing.FULL, Checkpointing.SQRT):
        ckpt = peak(spec, dataclasses.replace(s, checkpointing=c))
        assert ckpt <= none + _no_cache_slack(spec, s, c)


@settings(max_examples=60, deadline=None)
@given(slug=st.sampled_from(SLUGS), s=strategies, extra=st.integers(1, 8))
def test_monotonic_in_layers(slug: str, s: Strategy, extra: int) -> None:
    spec = load_model(slug)
    deeper = dataclasses.replace(spec, num_layers=spec.num_layers + extra)
    assert peak(deeper, s) >= peak(spec, s)

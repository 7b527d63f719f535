"""Analytic vs trace: the closed-form model must land within 5% of the traced peak.

Six architectures (Llama-3, Qwen2.5, Gemma-2, GPT-2, BERT, Mixtral-style MoE) x recipes x checkpointing
none/full x two shapes (a pairwise subset: tests/conftest.py ``pairwise``; ``TRAINFIT_FULL_MATRIX=1`` runs every
cell), on tiny configs, plus eager attention (score chain, masks, dropout) for models that default to SDPA.
``python benchmarks/agreement.py`` prints the same comparison at catalog sizes.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from tests.conftest import pairwise
from trainfit.strategy import Strategy

from .conftest import tiny_spec

pytest.importorskip("torch")
from trainfit.analytic import estimate_analytic
from trainfit.analytic.activations import attention_variants, sdpa_kernel
from trainfit.trace import trace_spec
from trainfit.trace.agreement import PEAK_TOLERANCE, compare

FAMILIES = ("llama", "qwen2", "gemma2", "gpt2", "bert", "mixtral")
SHAPES = ((1, 128), (4, 512))


def _cells(precisions: tuple[str, ...], *, pairwise: bool = False) -> list[object]:
    """Every family x recipe x checkpointing x shape; ``pairwise``: each (family, recipe) still meets both
    checkpointing modes and both shapes, but not all four pairs of them (the shape's effect on the analytic is
    covered whole by the amp-bf16 cells; this halves the suite's largest matrix)."""
    cells = itertools.product(FAMILIES, precisions, ("none", "full"), SHAPES)
    return [
        pytest.param(fam, prec, ck, shape, id=f"{fam}-{prec}-{ck}-b{shape[0]}s{shape[1]}")
        for fam, prec, ck, shape in cells
        if not pairwise or (ck == "none") == (shape == SHAPES[(FAMILIES.index(fam) + precisions.index(prec)) % 2])
    ]


def _check(
    family: str, precision: str, ckpt: str, shape: tuple[int, int], attention: str = "sdpa", **overrides: Any
) -> None:
    spec = tiny_spec(family, **overrides)
    s = Strategy(
        precision=precision,  # type: ignore[arg-type]
        checkpointing=ckpt,  # type: ignore[arg-type]
        micro_batch=shape[0],
        seq_len=shape[1],
        attention=attention,  # type: ignore[arg-type]
    )
    traced = trace_spec(spec, s)
    ag = compare(estimate_analytic(spec, s), traced)
    if s.attention.value == "sdpa" and spec.supports_sdpa:
        # The analytic model's kernel choice is the one the trace's CUDA emulation made.
        assert set(traced.extra["sdpa_backends"]) == {sdpa_kernel(v, s) for v, _ in attention_variants(spec, s)}
    detail = "; ".join(
        f"{g.phase.value} {g.rel * 100:+.1f}% ({g.largest_component_gap()})" for g in ag.phases if g.components
    )
    assert abs(ag.peak_rel) <= PEAK_TOLERANCE, f"peak {ag.peak_rel * 100:+.1f}%: {detail}"


@pytest.mark.parametrize(("family", "precision", "ckpt", "shape"), pairwise(_cells(("amp-bf16",))))
def test_analytic_within_5_percent_of_trace(family: str, precision: str, ckpt: str, shape: tuple[int, int]) -> None:
    _check(family, precision, ckpt, shape)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "precision", "ckpt", "shape"),
    pairwise(_cells(("fp32", "amp-fp16", "master-bf16", "pure-bf16"), pairwise=True)),
)
def test_analytic_within_5_percent_of_trace_other_recipes(
    family: str, precision: str, ckpt: str, shape: tuple[int, int]
) -> None:
    _check(family, precision, ckpt, shape)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "precision", "ckpt"),
    [  # pairwise: each family meets both recipes and both checkpointing modes, not all four pairs
        pytest.param(f, p, c, id=f"{f}-{p}-{c}")
        for i, f in enumerate(("llama", "gpt2", "bert"))
        for p, c in (("amp-bf16", ("none", "full")[i % 2]), ("pure-bf16", ("full", "none")[i % 2]))
    ]
    # Falcon's eager path without checkpointing (with it, see docs/accuracy.md: a known gap).
    + [pytest.param("falcon", p, "none", id=f"falcon-{p}-none") for p in ("amp-bf16", "pure-bf16")],
)
def test_eager_attention_within_5_percent_of_trace(family: str, precision: str, ckpt: str) -> None:
    """Eager attention on models that default to SDPA: Llama (fp32 softmax, one mask), GPT-2 (softmax in
    the scores' dtype, attention dropout), BERT (no mask, dropout on the softmax output) and Falcon
    (softmax in the residual dtype, no cast of the probabilities)."""
    _check(family, precision, ckpt, (4, 512), attention="eager")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("precision", "ckpt", "seq"),
    pairwise(
        pytest.param(p, c, s, id=f"{p}-{c}-s{s}")
        for p, c, s in itertools.product(("amp-bf16", "pure-bf16"), ("none", "full"), (128, 200))
    ),
)
def test_sliding_window_sdpa_within_5_percent_of_trace(precision: str, ckpt: str, seq: int) -> None:
    """Mistral-style sliding window with SDPA: below the window no mask (flash); from the window on a real
    mask, the memory-efficient kernel, a saved additive bias per layer and repeat_kv'd k/v."""
    _check("mistral-window", precision, ckpt, (4, seq))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "precision", "ckpt", "batch"),
    [  # pairwise: each architecture meets every recipe and both checkpointing modes, each recipe both modes
        pytest.param(f, p, c, 4, id=f"{f}-{p}-{c}")
        for i, f in enumerate(("falcon", "falcon-new"))
        for j, p in enumerate(("amp-bf16", "pure-bf16", "fp32"))
        for c in (("none", "full")[(i + j) % 2],)
    ]
    + [pytest.param("falcon", "amp-bf16", "none", 1, id="falcon-amp-bf16-none-b1")],
)
def test_falcon_sdpa_kernels_within_5_percent_of_trace(family: str, precision: str, ckpt: str, batch: int) -> None:
    """HF Falcon before transformers 5.25 calls SDPA itself: multi-query without enable_gqa takes the math kernel
    (fp32 scores; its broadcast k/v are copied per head unless the batch is 1), the new architecture the
    memory-efficient kernel with a saved bias. From 5.25 both go through transformers' interface, whose
    ``repeat_kv`` (the mask is always materialised) gives the memory-efficient kernel every head — as stride-0
    views of the one k/v head of multi-query Falcon. (GQA in fp32, also math: the llama and qwen2 fp32 cells above.)"""
    _check(family, precision, ckpt, (batch, 512))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "precision", "attention", "layers"),
    [
        ("llama", "amp-bf16", "sdpa", {"num_hidden_layers": 9}),
        ("gemma2", "pure-bf16", "sdpa", {"num_hidden_layers": 9}),
        ("gpt2", "amp-bf16", "eager", {"n_layer": 9}),
        ("falcon", "amp-bf16", "sdpa", {"num_hidden_layers": 9}),
    ],
    ids=["llama", "gemma2", "gpt2-eager", "falcon"],
)
def test_sqrt_checkpointing_within_5_percent_of_trace(
    family: str, precision: str, attention: str, layers: dict[str, int]
) -> None:
    """sqrt checkpointing: 9 layers in 3 segments of 3, each recomputed whole in backward."""
    _check(family, precision, "sqrt", (4, 512), attention, **layers)


@pytest.mark.slow
@pytest.mark.parametrize(("precision", "ckpt"), list(itertools.product(("amp-bf16", "fp32"), ("none", "full"))))
def test_partly_sliding_stack_within_5_percent_of_trace(precision: str, ckpt: str) -> None:
    """Qwen2 with its last layers sliding: past the window those layers get a mask (memory-efficient
    kernel), the others none (flash in 16-bit, the math kernel in fp32 with GQA)."""
    _check("qwen2", precision, ckpt, (4, 200), use_sliding_window=True, sliding_window=160, max_window_layers=2)


@pytest.mark.parametrize(
    ("family", "precision"),
    [("llama", "amp-bf16"), ("llama", "pure-bf16"), ("qwen2", "amp-bf16"), ("gpt2", "pure-bf16")],
)
def test_sac_keeps_exactly_the_save_list_outputs(family: str, precision: str) -> None:
    """``--checkpointing sac``: torch's selective checkpointing with torchtitan's policy, traced, keeps per layer
    exactly what :func:`sac_saved_terms` lists beyond full checkpointing (every second bias-free ``mm``, every
    ``addmm``, the fused attention's output and logsumexp); and the peaks agree like every recipe's."""
    from trainfit.analytic.activations import sac_saved_terms
    from trainfit.result import Component, Phase

    spec = tiny_spec(family)
    sac = Strategy(precision=precision, checkpointing="sac", micro_batch=2, seq_len=128)  # type: ignore[arg-type]
    full = Strategy(precision=precision, checkpointing="full", micro_batch=2, seq_len=128)  # type: ignore[arg-type]
    traced_sac, traced_full = trace_spec(spec, sac), trace_spec(spec, full)
    kept = [t.phase(Phase.FORWARD).components[Component.ACTIVATIONS] for t in (traced_sac, traced_full)]
    assert kept[0] - kept[1] == spec.num_layers * sum(x.bytes for x in sac_saved_terms(spec, sac))
    ag = compare(estimate_analytic(spec, sac), traced_sac)
    assert abs(ag.peak_rel) <= 0.03 and all(abs(g.rel) <= 0.03 for g in ag.phases if g.components), ag


@pytest.mark.parametrize("precision", ["amp-bf16", "fp32"])
def test_sac_with_dropout_agrees_within_3_percent(precision: str) -> None:
    """GPT-2 (dropout 0.1) under autocast or fp32: the traced SAC keeps ±16 KiB per layer beside what
    :func:`sac_saved_terms` lists (not found yet: docs/accuracy.md); the peaks still agree."""
    spec = tiny_spec("gpt2")
    sac = Strategy(precision=precision, checkpointing="sac", micro_batch=2, seq_len=128)  # type: ignore[arg-type]
    ag = compare(estimate_analytic(spec, sac), trace_spec(spec, sac))
    # the peak, as the other agreement tests: fp32 GPT-2's forward phase is as far off under full checkpointing
    assert abs(ag.peak_rel) <= 0.03, ag


@pytest.mark.parametrize(
    ("precision", "ckpt"), [("pure-bf16", "none"), ("pure-bf16", "sqrt"), ("amp-bf16", "full")], ids=lambda x: x
)
def test_deepseek_fp32_router_agrees_per_phase(precision: str, ckpt: str) -> None:
    """DeepSeek-V2's router linear runs on ``hidden_states.type(float32)`` (a new fp32 tensor it saves over a 16-bit
    normed input) and its fp32 routing weights promote the routed output, whose backward opens with fp32 routed-row
    gradients: forward and backward within 0.8% of the trace (before: pure-bf16 −5.0%, sqrt backward −7.1%, amp
    full backward −2.8%)."""
    spec = tiny_spec("deepseek_v2")
    s = Strategy(precision=precision, checkpointing=ckpt, micro_batch=2, seq_len=256)  # type: ignore[arg-type]
    closed, traced = estimate_analytic(spec, s), trace_spec(spec, s)
    for pa, pt in zip(closed.phases[:2], traced.phases[:2], strict=True):
        assert abs(pa.total_bytes - pt.total_bytes) <= 0.008 * pt.total_bytes, (
            pa.phase,
            pa.total_bytes,
            pt.total_bytes,
        )

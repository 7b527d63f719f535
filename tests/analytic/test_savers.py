"""Memory savers (trainfit.analytic.savers): each never increases the device peak (hypothesis), and hand counts
from the libraries' own rules (torchtune's chunked loss and optimizer-in-backward, Liger's chunk size,
bitsandbytes' paged states)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfit import estimate
from trainfit.analytic import estimate_analytic
from trainfit.analytic.model import MomentName, backward_moments, step_inputs
from trainfit.analytic.savers import chunked_head_copy_bytes, liger_chunk_tokens, offload_retained_bytes
from trainfit.arch import load_model
from trainfit.arch.spec import ModelKind
from trainfit.errors import StrategyError
from trainfit.result import Component, MemoryReport, Phase
from trainfit.strategy import Attention, Checkpointing, MemorySavers, Optimizer, Precision, Strategy

SLUGS = ["llama-3.2-1b", "qwen2.5-7b", "gpt2", "mistral-7b-v0.1", "phi-2", "opt-6.7b", "mixtral-8x7b-v0.1"]

strategies = st.builds(
    Strategy,
    precision=st.sampled_from(list(Precision)),
    optimizer=st.sampled_from([Optimizer.ADAMW, Optimizer.ADAMW_8BIT, Optimizer.LION, Optimizer.SGD]),
    checkpointing=st.sampled_from([Checkpointing.NONE, Checkpointing.FULL, Checkpointing.SQRT]),
    attention=st.sampled_from(list(Attention)),
    micro_batch=st.integers(1, 8),
    seq_len=st.integers(1, 4096),
)

SAVERS = [
    MemorySavers(loss="chunked"),
    MemorySavers(loss="chunked", loss_chunks=3),
    MemorySavers(loss="fused-linear"),
    MemorySavers(optimizer_in_backward=True),
    MemorySavers(activation_offload=True),
    MemorySavers(paged_optimizer=True),
    MemorySavers(loss="chunked", optimizer_in_backward=True, activation_offload=True, paged_optimizer=True),
]


def _closed_peak(r: MemoryReport) -> int:
    """The peak of the closed form's tensors (their requests), without the allocator's block rounding
    (``Component.ALLOCATOR_ROUNDING``): which cached blocks a request lands in is not monotonic in anything."""
    return max(p.total_bytes - p.get(Component.ALLOCATOR_ROUNDING) for p in r.phases)


def _chunked_slack(spec: Any, s: Strategy, savers: MemorySavers) -> int:
    """The one way a saver adds bytes: with a chunked loss the head's weight gets N gradient contributions, and
    while the second is added into autograd's buffer (out of place: the first is a view) two vocab×h gradients
    (compute dtype) and their sum are alive; when the
    head's gradient dominates the step (SGD, a large tied table: GPT-2 in fp32, +16% at 512 tokens) that can
    outweigh the logits it saves."""
    if savers.loss.value != "chunked":
        return 0
    return 3 * (s.recipe.compute_bits // 8) * spec.vocab_size * spec.embed_dim


def test_chunked_loss_can_raise_the_peak_when_the_head_gradient_dominates() -> None:
    spec = load_model("gpt2")
    s = Strategy(precision="fp32", optimizer="sgd", micro_batch=1, seq_len=512)
    base = estimate_analytic(spec, s).peak_bytes
    chunked = estimate_analytic(spec, dataclasses.replace(s, savers=MemorySavers(loss="chunked"))).peak_bytes
    assert base < chunked <= base + _chunked_slack(spec, s, MemorySavers(loss="chunked"))


@settings(max_examples=30, deadline=None)
@given(slug=st.sampled_from(SLUGS), s=strategies, savers=st.sampled_from(SAVERS))
def test_each_saver_never_increases_the_peak(slug: str, s: Strategy, savers: MemorySavers) -> None:
    spec = load_model(slug)
    if savers.loss.value != "standard" and spec.final_logit_softcapping:
        return
    if savers.paged_optimizer and s.optimizer is Optimizer.SGD:
        return  # bitsandbytes has no paged SGD (refused)
    base = estimate_analytic(spec, s)
    saved = estimate_analytic(spec, dataclasses.replace(s, savers=savers))
    assert _closed_peak(saved) <= _closed_peak(base) + _chunked_slack(spec, s, savers)
    for pb, ps in zip(base.phases, saved.phases, strict=True):
        # what leaves the GPU is counted on the host, never lost
        assert ps.total_bytes + ps.host_bytes >= min(ps.total_bytes, pb.total_bytes)


#: Fine-tuning setups for the property below: (how, finetune_setup arguments).
FINETUNE_SETUPS = [
    ("lora", {"rank": 16, "targets": "q_proj,v_proj"}),
    ("lora", {"rank": 8, "targets": "all-linear", "dropout": 0.05}),
    ("lora", {"rank": 16, "targets": "all-linear", "base_dtype": "int8"}),
    ("lora", {"rank": 16, "targets": "all-linear", "base_dtype": "bf16"}),
    ("qlora", {"rank": 16, "targets": "all-linear"}),
    ("qlora", {"rank": 64, "targets": "q_proj,v_proj"}),
    ("freeze", {"freeze": "embeddings"}),
    ("freeze", {"freeze": "embeddings,layers:0-1"}),
]


@settings(max_examples=200, deadline=None)
@given(
    slug=st.sampled_from(SLUGS),
    s=strategies,
    setup=st.sampled_from(FINETUNE_SETUPS),
    savers=st.sampled_from(SAVERS),
)
def test_each_saver_never_increases_the_peak_when_fine_tuning(
    slug: str, s: Strategy, setup: tuple[str, dict[str, Any]], savers: MemorySavers
) -> None:
    """The saver invariant under LoRA, QLoRA, LLM.int8 and ``--freeze``, with each saver's traced exception as its
    slack (the chunked loss's, and a frozen head's per-chunk casts; Liger's head gradient from the forward; offloading's
    unpacked weight copy and what torchtune keeps between backwards). Offloading broke it beyond those: its in-flight
    bound counted twice the largest linear's input and weight, where the MLP's linears never unpack back to back
    (mistral-7b LoRA q,v in fp32, 2 × 16: 27.387 → 27.587 GiB with offload, the trace 27.387 → 27.369; now 27.370)."""
    from trainfit.analytic.model import analytic_phases
    from trainfit.strategy import finetune_setup

    spec = load_model(slug)
    if savers.loss.value != "standard" and spec.final_logit_softcapping:
        return
    if savers.paged_optimizer and s.optimizer is Optimizer.SGD:
        return  # bitsandbytes has no paged SGD (refused)
    how, kwargs = setup
    try:
        adapter, base_weights = finetune_setup(how, **kwargs)  # type: ignore[arg-type]
        s = dataclasses.replace(s, adapter=adapter, base_weights=base_weights)
        base = analytic_phases(spec, s)
        saved = analytic_phases(spec, dataclasses.replace(s, savers=savers))
    except StrategyError:
        return  # a target the model lacks, a recipe the setup refuses
    # The chunked loss's exception, and its second way over a frozen head under autocast: each chunk casts the fp32
    # weight again and saves the cast (autocast caches leaves that require grad only; analytic.savers.
    # chunked_head_copy_bytes, checked against the trace in tests/trace/test_savers_trace.py).
    slack = _chunked_slack(spec, s, savers)
    if savers.loss.value == "chunked":
        slack += chunked_head_copy_bytes(spec, dataclasses.replace(s, savers=savers))
    if savers.loss.value == "fused-linear":
        # Liger's exception: a trainable head's gradient is there from the forward on (``grad_weight``), and where the
        # forward is the peak (frozen layers, so few gradients in backward) it can outweigh the few logits it saves.
        slack += step_inputs(spec, dataclasses.replace(s, savers=savers), keep_logits=False).grad_head
    if savers.activation_offload:
        # ... and what torchtune keeps between backwards over a frozen token table, checkpointed (the last unpacking
        # node's reach: the embeddings' leaf output, its gradient, the bottom segment's LLM.int8 inputs): a step with
        # few segments (``sqrt``) moves fewer inputs than that (the trace: llama-3.2-1b LoRA over LLM.int8 in fp32,
        # 6 × 456, backward 8642 → 9155 MiB with offload).
        slack += _offload_weight_slack(spec, s) + sum(
            offload_retained_bytes(spec, dataclasses.replace(s, savers=savers))
        )
    assert max(p.total_bytes for p in saved) <= max(p.total_bytes for p in base) + slack


def _offload_weight_slack(spec: Any, s: Strategy) -> int:
    """Offloading's exception, traced (tests/trace/test_savers_trace.py): a matmul saves its weight as the view
    ``weight.t()``, no ``nn.Parameter``, so torchtune copies it to the host and back, and in a layer's backward the
    unpacked copy of one weight (two attention projections' back to back) is on the GPU beside the parameter; at a
    few tokens that outweighs the activations it moves (llama-3.2-1b LoRA in fp32 at 1 token: the trace's backward
    4.689 → 4.754 GiB). The weights' part of :func:`trainfit.analytic.savers.offload_in_flight_bytes`."""
    from trainfit.analytic.float8 import block_linears

    a = s.recipe.compute_bits // 8
    sizes = {x.name: a * x.in_features * x.out_features for x in block_linears(spec)}
    attention = sorted((v for k, v in sizes.items() if k.startswith("attn.")), reverse=True)
    return max(max(sizes.values(), default=0), sum(attention[:2]))


def _selective_slack(spec: Any, s: Strategy) -> int:
    """The one way selective recompute adds bytes (found by the trace, tests/trace/test_savers_trace.py): the
    checkpoint keeps the attention interface's q and k after RoPE, in the residual stream's dtype (fp32 under
    autocast), where a fused SDPA kernel would have kept 16-bit casts; and the recomputation makes the kernel's
    output once more (a·t·q_dim, one layer). With flash attention and fp32 weights that outweighs the logsumexp it
    drops."""
    a = s.recipe.compute_bits // 8
    r = s.recipe.weight_bits // 8
    t = s.tokens_per_micro_batch
    return spec.num_layers * max(0, r - a) * t * (spec.q_dim + spec.kv_dim) + a * t * spec.q_dim


@settings(max_examples=30, deadline=None)
@given(slug=st.sampled_from(SLUGS), s=strategies)
def test_selective_recompute_never_increases_the_peak(slug: str, s: Strategy) -> None:
    spec = load_model(slug)
    none = _closed_peak(estimate_analytic(spec, dataclasses.replace(s, checkpointing=Checkpointing.NONE)))
    sel = _closed_peak(estimate_analytic(spec, dataclasses.replace(s, checkpointing=Checkpointing.SELECTIVE)))
    assert sel <= none + _selective_slack(spec, s)


def test_selective_recompute_can_raise_the_peak_with_flash_under_autocast() -> None:
    """The exception above, as the trace shows it on a tiny Llama (amp-bf16, flash: +1.1% at 2×256 tokens): at
    catalog size the fp32 q and k the checkpoint keeps outweigh the logsumexp; with eager attention the dropped
    b·heads·s² chain wins by far."""
    spec = load_model("llama-3.2-1b")
    s = Strategy(precision="amp-bf16", micro_batch=1, seq_len=2048)
    none = estimate_analytic(spec, s).peak_bytes
    sel = estimate_analytic(spec, dataclasses.replace(s, checkpointing="selective")).peak_bytes
    assert none < sel <= none + _selective_slack(spec, s)
    eager = dataclasses.replace(s, attention="eager")
    assert estimate_analytic(spec, dataclasses.replace(eager, checkpointing="selective")).peak_bytes < (
        estimate_analytic(spec, eager).peak_bytes
    )


def test_selective_recompute_drops_the_eager_score_chain() -> None:
    """Korthikanti et al. 2022: selective recompute removes the 5·a·s/h term — with eager attention the
    b·heads·s² chain; with flash SDPA only the fp32 logsumexp (4·b·heads·s) per layer."""
    spec = load_model("llama-3.2-1b")
    s = Strategy(precision="pure-bf16", attention="eager", micro_batch=1, seq_len=2048)
    none = estimate_analytic(spec, s).phase(Phase.FORWARD).components[Component.ACTIVATIONS]
    sel = estimate_analytic(spec, dataclasses.replace(s, checkpointing="selective"))
    scores = 32 * 2048 * 2048  # b·heads·s²
    # at least the fp32 softmax output per layer is gone (16 layers)
    assert none - sel.phase(Phase.FORWARD).components[Component.ACTIVATIONS] >= 16 * 4 * scores
    sdpa = dataclasses.replace(s, attention="sdpa")
    lse = 16 * 4 * 1 * 32 * 2048
    a0 = estimate_analytic(spec, sdpa).phase(Phase.FORWARD).components[Component.ACTIVATIONS]
    a1 = estimate_analytic(spec, dataclasses.replace(sdpa, checkpointing="selective"))
    assert a0 - a1.phase(Phase.FORWARD).components[Component.ACTIVATIONS] == lse


def test_chunked_loss_hand_count() -> None:
    """torchtune CEWithChunkedOutputLoss, N = 8: every chunk's fp32 log-softmax saved (4·V), the fp32 copy one
    chunk at a time; backward inside the first chunk: 4·V + 2 × 4·V/8."""
    spec = load_model("llama-3.2-1b")
    s = Strategy(precision="pure-bf16", micro_batch=1, seq_len=1024, savers=MemorySavers(loss="chunked"))
    v = 1024 * 128256
    r = estimate_analytic(spec, s)
    assert r.phase(Phase.FORWARD).components[Component.LOGITS_LOSS] == 2 * v + 4 * v + 4 * v // 8
    q = step_inputs(spec, s, keep_logits=False)
    start = next(m for m in backward_moments(q) if m.name is MomentName.BACKWARD_START)
    # the larger of the first chunk's log-softmax backward and the head's second per-chunk matmul backward (the
    # logits gradients of the 6 chunks not yet run; two vocab×h bf16 weight gradients and their out-of-place sum)
    assert start.logits_loss == max(4 * v + 8 * v // 8, 2 * (v - 2 * v // 8) + 3 * 2 * 128256 * 2048)


def test_liger_chunk_size_matches_its_own_example() -> None:
    """Liger's comment: BT = 4096·4, V = 32000, H = 4096 → inc_factor 8, chunk 2048."""
    assert liger_chunk_tokens(4096 * 4, 32000, 4096) == 2048
    assert liger_chunk_tokens(100, 32000, 4096) == 16  # next_pow2(⌈100/8⌉)


def test_fused_linear_has_no_vocabulary_logits() -> None:
    spec = load_model("llama-3.1-8b")
    s = Strategy(precision="pure-bf16", micro_batch=4, seq_len=2048, checkpointing="full")
    fused = estimate_analytic(spec, dataclasses.replace(s, savers=MemorySavers(loss="fused-linear")))
    t, vocab, h = 4 * 2048, 128256, 4096
    c = 256  # next_pow2(⌈8192 / ⌈128256/4096⌉⌉) = next_pow2(⌈8192/32⌉) = 256
    head_grad = vocab * h * 2
    fwd = fused.phase(Phase.FORWARD).components[Component.LOGITS_LOSS]
    assert fwd == head_grad + 2 * c * vocab + 2 * c * h + 4 * t
    assert fwd - head_grad < 2 * t * vocab // 10  # far below the bf16 logits alone


def test_optimizer_in_backward_holds_one_gradient() -> None:
    """torchtune register_optim_in_bwd_hooks: the largest gradient alive is one tensor's (the untied 128256×2048
    embedding table, bf16); nothing is left for optimizer.step()."""
    spec = load_model("llama-3.2-1b")
    s = Strategy(precision="pure-bf16", micro_batch=1, seq_len=512, savers=MemorySavers(optimizer_in_backward=True))
    r = estimate_analytic(spec, s)
    assert r.phase(Phase.BACKWARD).components[Component.GRADIENTS] <= 128256 * 2048 * 2
    assert r.phase(Phase.OPTIMIZER_STEP).components[Component.GRADIENTS] == 0
    with pytest.raises(StrategyError, match="grad-accum 4"):
        dataclasses.replace(s, grad_accum=4)


def test_paged_states_are_reported_apart() -> None:
    """bitsandbytes paged AdamW8bit: the states (about 2 B/param) are outside the device peak, on the host side."""
    spec = load_model("llama-3.2-1b")
    s = Strategy(optimizer="adamw-8bit", micro_batch=1, seq_len=512)
    plain = estimate_analytic(spec, s)
    paged = estimate_analytic(spec, dataclasses.replace(s, savers=MemorySavers(paged_optimizer=True)))
    states = plain.phase(Phase.OPTIMIZER_STEP).components[Component.OPTIMIZER_STATES]
    assert 1.9 * plain.params < states < 2.1 * plain.params
    for p in paged.phases:
        assert p.components[Component.OPTIMIZER_STATES] == 0
        assert p.host_components[Component.OPTIMIZER_STATES] == states
    # the states leave every phase, nothing else moves (but which cached blocks the rest lands in: the rounding)
    assert _closed_peak(paged) == _closed_peak(plain) - states


def test_activation_offload_without_checkpointing_counted_by_hand() -> None:
    """torchtune's OffloadActivations without checkpointing, Llama-3.2-1B pure-bf16 (t = s = 1024), counted save
    by save from HF LlamaDecoderLayer's ops (independent of the term lists): every save of >= 1 KiB goes to the
    host once per save — weight views included — and at the forward's end the GPU keeps only the final norm's
    saves (the stash of the last 5 packs) and the head's input (NoOpManager)."""
    spec = load_model("llama-3.2-1b")  # 16 layers, h 2048, 32 heads, 8 kv heads of 64, i 8192, tied
    t, h, qd, kvd, i, hd, L = 1024, 2048, 2048, 512, 8192, 64, 16
    s = Strategy(precision="pure-bf16", micro_batch=1, seq_len=t)
    plain = estimate_analytic(spec, s)
    off = estimate_analytic(spec, dataclasses.replace(s, savers=MemorySavers(activation_offload=True)))
    rms = 2 * 4 * t * h + 2 * 4 * t + 2 * t * h  # pow and x*rsqrt: fp32 input twice, rsqrt twice; weight*normed
    layer = (
        2 * rms
        + 3 * 2 * t * h  # q, k, v each save the normed input
        + 4 * 2 * t * hd  # q*cos, rot(q)*sin, k*cos, rot(k)*sin (1, 1, s, hd tables)
        + 2 * t * (qd + 2 * kvd)
        + 2 * t * qd
        + 4 * 32 * t  # SDPA: q, k, v, out, fp32 logsumexp
        + 2 * t * qd  # o_proj's input
        + 2 * 2 * t * h
        + 4 * 2 * t * i  # gate/up inputs; gate, silu(gate), up, product (down's input)
        + 2 * (h * qd + 2 * h * kvd + qd * h + 3 * h * i)  # every weight's transposed view
    )
    host = L * layer + 8 * t + rms  # + the int64 ids and the final norm
    f0, f1 = plain.phase(Phase.FORWARD), off.phase(Phase.FORWARD)
    assert abs(f1.host_components[Component.ACTIVATIONS] - host) <= 0.001 * host
    assert f1.components[Component.ACTIVATIONS] == 4 * t * h + 4 * t + 2 * t * h + 2 * t * h  # final norm, head in
    assert f1.total_bytes < f0.total_bytes


def test_activation_offload_with_checkpointing_moves_the_checkpoint_inputs() -> None:
    """With full checkpointing torchtune packs each layer's input (2·t·h), the ids and the final norm's saves; two
    inputs stay on the GPU (the backward's unpacked copies)."""
    spec = load_model("llama-3.2-1b")
    t, h = 1024, 2048
    s = Strategy(precision="pure-bf16", checkpointing="full", micro_batch=1, seq_len=t)
    plain = estimate_analytic(spec, s)
    off = estimate_analytic(spec, dataclasses.replace(s, savers=MemorySavers(activation_offload=True)))
    f0, f1 = plain.phase(Phase.FORWARD), off.phase(Phase.FORWARD)
    rms = 2 * 4 * t * h + 2 * 4 * t + 2 * t * h
    assert f1.host_components[Component.ACTIVATIONS] == 16 * 2 * t * h + 8 * t + rms
    assert f0.components[Component.ACTIVATIONS] - f1.components[Component.ACTIVATIONS] == 14 * 2 * t * h


def test_savers_are_refused_where_not_modelled() -> None:
    bert = load_model("bert-base-uncased")
    with pytest.raises(StrategyError, match="causal-LM"):
        estimate(bert, Strategy(seq_len=128, savers=MemorySavers(loss="chunked")))
    spec = load_model("llama-3.2-1b")
    with pytest.raises(StrategyError, match="paged-optimizer yet; use --method analytic"):
        estimate(spec, Strategy(seq_len=128, savers=MemorySavers(paged_optimizer=True)), method="trace")
    with pytest.raises(StrategyError, match="paged"):
        Strategy(optimizer="sgd", savers=MemorySavers(paged_optimizer=True))
    assert bert.kind is ModelKind.MASKED_LM


@pytest.mark.parametrize("slug", ["llama-3.2-1b", "qwen2.5-0.5b", "gpt2", "mistral-7b-v0.1"])
def test_sac_lies_between_full_checkpointing_and_none(slug: str) -> None:
    """torchtitan's per-op SAC keeps more than full checkpointing (the save list's outputs) and less than none:
    strictly so at the end of the forward; the peak may be the optimizer step's, the same for all three."""
    spec = load_model(slug)
    reports = {
        ck: estimate_analytic(spec, Strategy(checkpointing=ck, micro_batch=2, seq_len=2048))  # type: ignore[arg-type]
        for ck in ("none", "sac", "full")
    }
    peaks = {ck: r.peak_bytes for ck, r in reports.items()}
    assert peaks["full"] <= peaks["sac"] <= peaks["none"], peaks
    fwd = {ck: r.phase(Phase.FORWARD).total_bytes for ck, r in reports.items()}
    assert fwd["full"] < fwd["sac"] < fwd["none"], fwd


@pytest.mark.parametrize(
    ("slug", "kw", "says"),
    [
        ("mixtral-8x7b-v0.1", {}, "MoE"),
        ("llama-3.2-1b", {"attention": "eager"}, "eager"),
        ("llama-3.2-1b", {"precision": "fp32"}, "math"),
    ],
)
def test_sac_is_refused_where_not_modelled(slug: str, kw: dict[str, str], says: str) -> None:
    with pytest.raises(StrategyError, match=says):
        estimate(load_model(slug), Strategy(checkpointing="sac", seq_len=256, **kw))  # type: ignore[arg-type]

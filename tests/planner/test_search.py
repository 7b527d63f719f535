"""The micro-batch search equals a brute-force scan; suggestions follow the states."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainfit import Strategy, estimate, get_gpu, load_model
from trainfit.analytic import estimate_analytic
from trainfit.planner.search import (
    MAX_SEARCH_BATCH,
    SuggestionKind,
    max_micro_batch,
    required_bytes,
)
from trainfit.result import Component


@pytest.mark.parametrize(
    ("slug", "gpu"), [("gpt2", "t4"), ("qwen2.5-0.5b", "rtx-4090"), ("llama-3.2-1b", "a100-sxm-80gb")]
)
def test_search_equals_brute_force(slug: str, gpu: str) -> None:
    spec, s = load_model(slug), Strategy(seq_len=1024, checkpointing="full")
    usable = int(get_gpu(gpu).memory_bytes * 0.7)
    best, capped = max_micro_batch(spec, s, usable, estimate_analytic)
    assert not capped
    fits = [
        b
        for b in range(1, best + 2)
        if required_bytes(estimate_analytic(spec, dataclasses.replace(s, micro_batch=b))) <= usable
    ]
    assert fits == list(range(1, best + 1))


def test_capped_search_says_at_least() -> None:
    spec, s = load_model("gpt2"), Strategy(seq_len=1)
    best, capped = max_micro_batch(spec, s, 1 << 50, estimate_analytic)
    assert capped and best == MAX_SEARCH_BATCH


def _apply(s: Strategy, flags: tuple[str, ...]) -> Strategy:
    kw = {"batch": "micro_batch", "grad-accum": "grad_accum"}
    changes = {kw[f.split()[0][2:]]: int(f.split()[1]) for f in flags}
    return dataclasses.replace(s, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("slug", "gpu", "kw"),
    [
        ("gpt2", "t4", dict(micro_batch=64, seq_len=1024, precision="amp-fp16")),
        ("bert-base-uncased", "t4", dict(micro_batch=32, seq_len=512, precision="amp-fp16")),
        ("qwen2.5-0.5b", "rtx-4090", dict(micro_batch=16, seq_len=1024, grad_accum=3)),
    ],
)
def test_suggested_accumulation_fits_and_keeps_the_effective_batch(slug: str, gpu: str, kw: dict[str, object]) -> None:
    s = Strategy(**kw)  # type: ignore[arg-type]
    r = estimate(slug, s, gpu=gpu)
    assert r.fit is not None and not r.fit.fits
    (sug,) = r.fit.suggestions
    assert sug.kind is SuggestionKind.SMALLER_MICRO_BATCH
    applied = _apply(s, sug.flags)
    assert applied.grad_accum >= 2 and applied.effective_batch >= s.effective_batch
    assert applied.effective_batch - s.effective_batch < applied.grad_accum  # within one micro-batch row each
    after = estimate(slug, applied, gpu=gpu)
    assert after.fit is not None and after.fit.fits, (sug, after.fit)


def test_suggestions() -> None:
    r = estimate("llama-3.1-8b", Strategy(), gpu="a100-sxm-80gb")
    assert r.fit is not None and r.fit.suggestions[0].kind is SuggestionKind.LEANER_STATES
    r = estimate("llama-3.1-70b", Strategy(precision="pure-bf16", optimizer="adamw-8bit"), gpu="a100-sxm-80gb")
    assert r.fit is not None and r.fit.suggestions[0].kind is SuggestionKind.NEEDS_SHARDING
    r = estimate("gpt2", Strategy(), gpu="a100-sxm-80gb")
    assert r.fit is not None and r.fit.fits and r.fit.suggestions == ()


def test_leaner_states_suggest_only_flags_not_in_use() -> None:
    r = estimate(
        "llama-3.1-8b", Strategy(precision="pure-bf16", checkpointing="full", micro_batch=4), gpu="a100-sxm-80gb"
    )
    assert r.fit is not None
    (sug,) = r.fit.suggestions
    assert sug.kind is SuggestionKind.LEANER_STATES and sug.flags == ("--optimizer adamw-8bit",)


@given(
    fails=st.sets(st.integers(min_value=1, max_value=64), min_size=1),
    lowest=st.integers(min_value=0, max_value=3),
)
def test_largest_below_keeps_the_search_contract(fails: set[int], lowest: int) -> None:
    """Any predicate (monotone or not): the answer holds and its successor fails; None only when ``lowest`` fails."""
    from trainfit.planner.search import largest_below

    hi = max(fails)
    if hi <= lowest:
        return
    probes: list[int] = []

    def pred(x: int) -> bool:
        probes.append(x)
        assert lowest <= x < hi
        return x not in fails

    got = largest_below(pred, hi, lowest)
    if got is None:
        assert lowest in fails
    else:
        assert got not in fails and (got + 1) in fails and lowest <= got < hi
    if hi - 1 not in fails:
        assert probes == [hi - 1]  # just below the bound: one probe


def test_many_gpu_micro_batch_search_counts_up_without_a_bound() -> None:
    """Many GPUs have no closed-form bound: the search doubles from micro-batch 1 (a handful of estimates) and
    lands where stepping up one at a time does."""
    from trainfit.strategy import Parallelism

    spec, gpu = load_model("llama-3.2-1b"), get_gpu("a100-sxm-40gb")
    s = Strategy(parallelism=Parallelism(data=4), sharding="fsdp", seq_len=4096, checkpointing="full")
    rep = estimate(spec, s, gpu=gpu)
    assert rep.fit is not None and rep.fit.max_micro_batch is not None and 0 < rep.fit.max_micro_batch < 64
    best = rep.fit.max_micro_batch

    def fits(b: int) -> bool:
        r = estimate(spec, dataclasses.replace(s, micro_batch=b), gpu=gpu, search_micro_batch=False)
        return r.fit is not None and r.fit.fits

    assert fits(best) and not fits(best + 1)


@pytest.mark.parametrize("seq", [8192, 12288])
def test_expandable_segments_are_suggested_exactly_when_they_make_it_fit(seq: int) -> None:
    s = Strategy(precision="pure-bf16", optimizer="adamw-8bit", checkpointing="full", micro_batch=1, seq_len=seq)
    plain = estimate("llama-3.1-8b", s, gpu="a100-sxm-80gb", allocator="", fixes=False)
    grown = estimate("llama-3.1-8b", s, gpu="a100-sxm-80gb", allocator="expandable_segments:True", fixes=False)
    assert plain.fit is not None and grown.fit is not None
    # the setting changes the reserve, and the blocks kept whole that only the default allocator has
    assert grown.peak.get(Component.ALLOCATOR_ROUNDING) == 0
    assert plain.peak_bytes - plain.peak.get(Component.ALLOCATOR_ROUNDING) <= grown.peak_bytes <= plain.peak_bytes
    hinted = [x for x in plain.fit.suggestions if x.kind is SuggestionKind.EXPANDABLE_SEGMENTS]
    assert bool(hinted) == (not plain.fit.fits and grown.fit.fits)
    if hinted:
        assert hinted[0].flags == ("--alloc-conf expandable_segments:True",)
        assert f"{grown.fit.required_bytes / 2**30:.2f} GiB" in hinted[0].reason
    assert not [x for x in grown.fit.suggestions if x.kind is SuggestionKind.EXPANDABLE_SEGMENTS]


def test_no_accumulation_is_suggested_under_optimizer_in_backward() -> None:
    """--optimizer-in-backward steps each parameter as its gradient arrives, so it cannot accumulate (torchtune
    refuses): a setup that does not fit gets no --grad-accum suggestion — it once raised that very refusal in place of
    the estimate — and a checked fix that drops the saver says so."""
    from trainfit.planner.rank import describe_changes
    from trainfit.strategy import MemorySavers

    s = Strategy(micro_batch=32, seq_len=1024, savers=MemorySavers(optimizer_in_backward=True))
    r = estimate("qwen2.5-0.5b", s, gpu="rtx-4090")
    assert r.fit is not None and not r.fit.fits
    assert all(x.kind is not SuggestionKind.SMALLER_MICRO_BATCH for x in r.fit.suggestions)
    plain = dataclasses.replace(s, savers=MemorySavers(), grad_accum=32, micro_batch=1)
    assert "without --optimizer-in-backward" in describe_changes(plain, s)
    assert "without --optimizer-in-backward" not in describe_changes(s, s)

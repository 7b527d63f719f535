"""The table leads with the answer; the explanation is behind verbose; only the report is needed."""

from __future__ import annotations

import dataclasses
from typing import Any

from rich.console import Console

from trainfit import estimate
from trainfit.report.table import render
from trainfit.result import MemoryReport
from trainfit.strategy import MemorySavers, Strategy
from trainfit.strategy.adapters import finetune_setup
from trainfit.units import fmt_count


def _text(report: MemoryReport, verbose: bool = False) -> str:
    console = Console(record=True, width=200)
    render(console, report, verbose=verbose)
    return console.export_text()


def test_verdict_and_peak_come_before_the_breakdown() -> None:
    text = _text(estimate("gpt2", gpu="t4"))
    assert text.index("FITS") < text.index("Peak allocated") < text.index("Allocated memory by phase")
    assert "Bytes per parameter" not in text and "note:" not in text
    verbose = _text(estimate("gpt2", gpu="t4"), verbose=True)
    assert "Bytes per parameter" in verbose and "note:" in verbose


def test_capped_and_unsearched_batches_are_said() -> None:
    r = estimate("gpt2", gpu="t4")
    assert r.fit is not None
    capped = dataclasses.replace(r, fit=dataclasses.replace(r.fit, max_micro_batch_capped=True))
    assert f"at least {r.fit.max_micro_batch}" in _text(capped)
    unsearched = dataclasses.replace(r, fit=dataclasses.replace(r.fit, max_micro_batch=None))
    assert "not searched" in _text(unsearched)


def _run(
    slug: str, how: str = "full", precision: str = "amp-bf16", savers: MemorySavers | None = None, **kw: Any
) -> str:
    adapter, base = finetune_setup(how, **kw)
    s = Strategy(precision=precision, adapter=adapter, base_weights=base, savers=savers or MemorySavers())
    return _text(estimate(slug, s))


def test_the_header_says_what_trains_and_which_savers_run() -> None:
    """A fine-tuning run's header names its adapter, base storage, frozen patterns and trainable share; a saver run
    its savers as the CLI spells them; full training of the recipe's weights adds neither line."""
    adapter, base = finetune_setup("qlora", rank=64, targets="q_proj,v_proj")
    r = estimate("mistral-7b-v0.1", Strategy(adapter=adapter, base_weights=base))
    share = f"{fmt_count(r.trainable_params)} trainable ({r.trainable_params / r.params:.2%})"
    assert 0 < r.trainable_params < r.params
    assert f"QLoRA r64 α128 on q_proj, v_proj, fp32 adapters · base nf4 + double quant · {share}" in _text(r)
    dora = _run("llama-3.2-1b", "lora", dora=True, dropout=0.05, base_dtype="int8")
    assert "DoRA r16 α32 on all-linear, fp32 adapters, dropout 0.05 · base int8 (LLM.int8) · " in dora
    adapter, base = finetune_setup("freeze", freeze="embeddings,layers:0-15")
    r = estimate("llama-3.1-8b", Strategy(adapter=adapter, base_weights=base))
    share = f"{fmt_count(r.trainable_params)} trainable ({r.trainable_params / r.params:.2%})"
    assert f"\nfrozen embeddings, layers:0-15 · {share}\n" in _text(r)
    savers = MemorySavers(loss="chunked", optimizer_in_backward=True)
    assert "\nsavers: --loss chunked:8 --optimizer-in-backward\n" in _run(
        "llama-3.2-3b", precision="pure-bf16", savers=savers
    )
    fp8 = _text(estimate("llama-3.2-1b", Strategy(precision="amp-bf16", float8="tensorwise")))
    assert fp8.splitlines()[1].startswith("amp-bf16 · fp8 tensorwise linears · adamw")
    plain = _text(estimate("gpt2"))
    assert "trainable" not in plain.split("Peak allocated")[0] and "savers:" not in plain and "fp8" not in plain

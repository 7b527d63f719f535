"""The table leads with the answer; the explanation is behind verbose; only the report is needed."""

from __future__ import annotations

import dataclasses

from rich.console import Console

from trainfit import estimate
from trainfit.report.table import render
from trainfit.result import MemoryReport


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

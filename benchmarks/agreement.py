"""Analytic vs trace at catalog sizes: the table in docs/accuracy.md ("Analytic vs trace").

For each model x recipe x checkpointing (micro-batch 1 x 2048 tokens; BERT 8 x 512), the peak of each
method, the difference, and per phase the component that differs most. The trace extrapolates in depth
(exact against full depth, see tests/trace/test_depth.py), so catalog sizes take seconds.
Usage: python benchmarks/agreement.py [--write]   (--write replaces the marked section of docs/accuracy.md)
"""

from __future__ import annotations

import itertools
import re
import sys
import time
from pathlib import Path

from trainfit.analytic import estimate_analytic
from trainfit.arch import load_model
from trainfit.strategy import Strategy
from trainfit.trace import trace_spec
from trainfit.trace.agreement import PEAK_TOLERANCE, compare

MODELS = (
    "gpt2",
    "bert-base-uncased",
    "qwen2.5-0.5b",
    "llama-3.2-1b",
    "gemma-2b",
    "qwen2.5-7b",
    "llama-3.1-8b",
    "mixtral-8x7b-v0.1",
    "falcon-7b",
)
HEAVY_MODELS = ("qwen2.5-0.5b", "llama-3.2-1b", "gemma-2b", "gpt2-large")
EAGER_MODELS = ("gpt2", "bert-base-uncased", "llama-3.2-1b")
RECIPES = ("amp-bf16", "master-bf16")
CHECKPOINTING = ("none", "full")
BEGIN, END = "<!-- agreement:begin -->", "<!-- agreement:end -->"


def gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def rows() -> list[str]:
    out = [
        "| model | recipe | ckpt | b×s | analytic GiB (phase) | trace GiB (phase) | Δ peak "
        "| largest component gaps (analytic − trace, MiB) |",
        "|---|---|---|---|---:|---:|---:|---|",
    ]

    def shape(model: str) -> tuple[int, int]:
        return (8, 512) if model.startswith("bert") else (1, 2048)

    cells = [
        (model, rec, ck, shape(model), "sdpa") for model, rec, ck in itertools.product(MODELS, RECIPES, CHECKPOINTING)
    ]
    # Activation-heavy shapes, where the saved tensors and the logits, not the optimizer step, set the peak.
    cells += [
        (model, rec, ck, (4, 4096), "sdpa")
        for model, rec, ck in itertools.product(HEAVY_MODELS, ("amp-bf16", "pure-bf16"), CHECKPOINTING)
    ]
    # Sliding window past the window: SDPA gets a real mask (memory-efficient kernel, a bias per layer).
    cells += [
        ("mistral-7b-v0.1", rec, ck, (1, 8192), "sdpa")
        for rec, ck in itertools.product(("amp-bf16", "pure-bf16"), CHECKPOINTING)
    ]
    # Eager attention: the b·heads·s² score chain and the [b, 1, s, s] masks.
    cells += [
        (model, rec, ck, shape(model), "eager")
        for model, rec, ck in itertools.product(EAGER_MODELS, ("amp-bf16", "pure-bf16"), CHECKPOINTING)
    ]
    for model, rec, ck, (b, s), attn in cells:
        spec = load_model(model)
        st = Strategy(  # type: ignore[arg-type]
            precision=rec, checkpointing=ck, micro_batch=b, seq_len=s, attention=attn, optimizer_impl="foreach"
        )
        ag = compare(estimate_analytic(spec, st), trace_spec(spec, st))
        gaps = []
        for g in ag.phases:
            lc = g.largest_component_gap()
            if lc and abs(lc[1]) >= 2**20:
                gaps.append(f"{g.phase.value}: {lc[0].value} {lc[1] / 2**20:+.0f}")
        flag = "" if abs(ag.peak_rel) <= PEAK_TOLERANCE else " ⚠"
        label = " (eager)" if attn == "eager" else ""
        out.append(
            f"| {model}{label} | {rec} | {ck} | {b}×{s} "
            f"| {gib(ag.analytic_peak_bytes)} ({ag.analytic_peak_phase.value}) "
            f"| {gib(ag.trace_peak_bytes)} ({ag.trace_peak_phase.value}) | {ag.peak_rel * 100:+.1f}%{flag} "
            f"| {'; '.join(gaps) or '—'} |"
        )
        print(out[-1], file=sys.stderr, flush=True)
    return out


def main() -> None:
    t0 = time.perf_counter()
    table = rows()
    section = "\n".join(
        [
            BEGIN,
            "## Analytic vs trace at catalog sizes",
            "",
            "`python benchmarks/agreement.py --write` (adamw foreach, SDPA unless marked eager, steady-state step;",
            f"⚠ = peak off by more than {PEAK_TOLERANCE:.0%}). Small-config matrix:",
            "`pytest tests/trace/test_agreement.py`.",
            "",
            *table,
            "",
            f"_{len(table) - 2} comparisons in {time.perf_counter() - t0:.0f} s on this machine._",
            END,
        ]
    )
    print(section)
    if "--write" in sys.argv:
        write_section(section, BEGIN, END)


def write_section(section: str, begin: str, end: str) -> None:
    """Replace the ``begin``…``end`` section of docs/accuracy.md with ``section`` (append it when absent)."""
    doc = Path(__file__).resolve().parent.parent / "docs" / "accuracy.md"
    text = doc.read_text(encoding="utf-8")
    if begin in text:
        text = re.sub(re.escape(begin) + ".*?" + re.escape(end), section, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    doc.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()

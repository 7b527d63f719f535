"""Analytic vs trace for LoRA fine-tuning at catalog sizes: the table in docs/accuracy.md ("Fine-tuning:
analytic vs trace").

For each model x target set x checkpointing x dropout (rank 16, amp-bf16 over a bf16 base with PEFT's fp32
adapters, micro-batch 1 x 2048 tokens) the peak of each method and the worst per-phase difference. The trace
runs real PEFT modules on fake tensors (trainfit.trace.peft) and extrapolates in depth from two depths.
QLoRA rows trace real bitsandbytes Linear4bit layers quantised on fake tensors.
Usage: python benchmarks/agreement_finetune.py [--write]   (--write replaces the marked section of docs/accuracy.md)
"""

from __future__ import annotations

import itertools
import re
import sys
import time
from pathlib import Path

from trainfit import Strategy, estimate
from trainfit.arch import load_model
from trainfit.result import Component
from trainfit.strategy import finetune_setup

MODELS = ("llama-3.2-1b", "qwen2.5-7b", "llama-3.1-8b", "mistral-7b-v0.1")
TARGETS = ("q_proj,v_proj", "all-linear")
CHECKPOINTING = ("none", "full")
DROPOUT = (0.0, 0.05)
BEGIN, END = "<!-- agreement-finetune:begin -->", "<!-- agreement-finetune:end -->"
GIB = 2**30


def rows(*, qlora_only: bool = False) -> list[str]:
    out = [
        "| model | targets | ckpt | dropout | analytic peak GiB | trace peak GiB | worst phase diff |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for name, targets, ckpt, dropout in itertools.product(MODELS, TARGETS, CHECKPOINTING, DROPOUT):
        if qlora_only:
            break
        spec = load_model(name)
        a, b = finetune_setup("lora", rank=16, targets=targets, dropout=dropout, base_dtype="bf16")
        s = Strategy(adapter=a, base_weights=b, checkpointing=ckpt, micro_batch=1, seq_len=2048)
        t0 = time.perf_counter()
        ra, rt = estimate(spec, s), estimate(spec, s, method="trace")
        worst = max(
            ((pa.total_bytes - pt.total_bytes) / pt.total_bytes for pa, pt in zip(ra.phases, rt.phases, strict=True)),
            key=abs,
        )
        out.append(
            f"| {name} | {targets} | {ckpt} | {dropout} | {ra.peak_bytes / GIB:.2f} | {rt.peak_bytes / GIB:.2f} "
            f"| {worst * 100:+.2f}% |"
        )
        print(out[-1], f"({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    out += [
        "",
        "QLoRA (nf4 + double quant, prepare_model_for_kbit_training; real bitsandbytes Linear4bit in the trace):",
        "",
    ]
    out += [
        "| model | targets | ckpt | analytic peak GiB | trace peak GiB | worst phase diff | weights GiB |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for name, targets, ckpt in itertools.product(MODELS, TARGETS, CHECKPOINTING):
        spec = load_model(name)
        a, b = finetune_setup("qlora", rank=16, targets=targets)
        s = Strategy(adapter=a, base_weights=b, checkpointing=ckpt, micro_batch=1, seq_len=2048)
        t0 = time.perf_counter()
        ra, rt = estimate(spec, s), estimate(spec, s, method="trace")
        worst = max(
            ((pa.total_bytes - pt.total_bytes) / pt.total_bytes for pa, pt in zip(ra.phases, rt.phases, strict=True)),
            key=abs,
        )
        w = ra.phases[0].get(Component.WEIGHTS)
        out.append(
            f"| {name} | {targets} | {ckpt} | {ra.peak_bytes / GIB:.2f} | {rt.peak_bytes / GIB:.2f} "
            f"| {worst * 100:+.2f}% | {w / GIB:.2f} |"
        )
        print(out[-1], f"({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    return out


def main() -> None:
    table = "\n".join(rows(qlora_only="--qlora-only" in sys.argv))
    print(table)
    if "--write" in sys.argv:
        doc = Path(__file__).resolve().parent.parent / "docs" / "accuracy.md"
        text = doc.read_text()
        new = f"{BEGIN}\n{table}\n{END}"
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), new, text, flags=re.S) if BEGIN in text else text
        doc.write_text(text)


if __name__ == "__main__":
    main()

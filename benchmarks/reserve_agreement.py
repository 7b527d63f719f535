"""One GPU: the analytic method's reserved memory against the trace method's (docs/allocator.md, "Where it is used").

Both replay an allocator event stream through the same caching-allocator simulation; the analytic one is synthesised
from the closed form's tensors (trainfit.analytic.events), the trace one recorded from real transformers modules on
fake tensors and stitched to full depth (trainfit.trace.events). Per case: the closed form's allocated peak, the
analytic stream's own allocated peak (no workspaces), each method's ``reserved_estimate_bytes`` and their ratio.
The default cases are amp recipes with full checkpointing (autocast's weight cache across checkpointed layers).
``--finetune``: PEFT adapters instead (rank 16, PEFT's fp32 adapters over the recipe's base; the first is the
H200 case of issue 11, qwen2.5-0.5b pure-bf16 LoRA on all linears, 4 × 1024), docs/accuracy.md "Fine-tuning:
reserved memory".

Usage: python benchmarks/reserve_agreement.py [MODEL RECIPE CKPT BATCH SEQ ...]   (five at a time, e.g.
       python benchmarks/reserve_agreement.py llama-3.2-3b amp-bf16 full 1 4096)
       python benchmarks/reserve_agreement.py --finetune [--write]   (--write replaces the marked table of
       docs/accuracy.md)
       python benchmarks/reserve_agreement.py --offload-ckpt   (activation offloading under checkpointing)
       python benchmarks/reserve_agreement.py --savers [--write]   (the memory savers on llama-3.2-1b, 2 × 1024:
       full amp-bf16 and pure-bf16, LoRA and QLoRA under amp-bf16; 1 × 512: full and QLoRA)
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import replace
from pathlib import Path

from trainfit import Strategy, estimate
from trainfit.allocator import simulate
from trainfit.analytic.events import training_events
from trainfit.arch import ModelSpec, load_model
from trainfit.strategy import Checkpointing, LossImpl, MemorySavers, Precision, finetune_setup

CASES: tuple[tuple[str, str, str, int, int], ...] = (
    ("llama-3.2-1b", "amp-bf16", "full", 1, 1024),
    ("llama-3.2-1b", "amp-bf16", "full", 2, 2048),
    ("qwen2.5-0.5b", "amp-bf16", "full", 4, 2048),
    ("gpt2", "amp-fp16", "full", 8, 1024),
    ("llama-3.2-3b", "amp-bf16", "full", 1, 4096),
)
#: (model, recipe, checkpointing, batch, seq, method, targets, dropout, base dtype); method qdora: QLoRA's DoRA
FINETUNE: tuple[tuple[str, str, str, int, int, str, str, float, str | None], ...] = (
    ("qwen2.5-0.5b", "pure-bf16", "none", 4, 1024, "lora", "all-linear", 0.0, None),
    ("qwen2.5-0.5b", "amp-bf16", "none", 4, 1024, "lora", "all-linear", 0.0, None),
    ("qwen2.5-0.5b", "pure-bf16", "none", 4, 1024, "lora", "q_proj,v_proj", 0.0, None),
    ("qwen2.5-0.5b", "pure-bf16", "full", 4, 1024, "lora", "all-linear", 0.0, None),
    ("llama-3.2-1b", "amp-bf16", "none", 2, 1024, "lora", "all-linear", 0.05, "bf16"),
    ("llama-3.2-1b", "amp-bf16", "full", 2, 2048, "lora", "all-linear", 0.0, "bf16"),
    ("llama-3.2-1b", "pure-bf16", "none", 2, 1024, "dora", "q_proj,v_proj", 0.0, None),
    ("llama-3.2-1b", "amp-bf16", "none", 2, 1024, "qlora", "all-linear", 0.0, "nf4"),
    # added in session 29 with the DoRA and bitsandbytes flows: cells the flows were not built on
    ("llama-3.2-1b", "amp-bf16", "none", 2, 1024, "dora", "all-linear", 0.0, None),
    ("llama-3.2-1b", "pure-bf16", "none", 2, 1024, "dora", "q_proj,v_proj", 0.05, None),  # dropout: a flow since s30
    ("qwen2.5-0.5b", "amp-bf16", "none", 4, 1024, "qlora", "q_proj,v_proj", 0.0, "nf4"),
    ("llama-3.2-1b", "pure-bf16", "none", 2, 1024, "qlora", "all-linear", 0.0, "nf4"),
    ("llama-3.2-1b", "amp-bf16", "full", 2, 1024, "qlora", "all-linear", 0.0, "nf4"),
    ("qwen2.5-0.5b", "amp-bf16", "none", 4, 1024, "qlora", "all-linear", 0.05, "nf4"),
    # added in session 30 with the DoRA-with-dropout flow: under autocast (its casts of x and of the weight)
    ("qwen2.5-0.5b", "amp-bf16", "none", 4, 1024, "dora", "q_proj,v_proj", 0.05, None),
    # added in session 31 (issue 11's gaps): DoRA over a 4-bit base (a flow since), LLM.int8 bases (its ctx-held
    # inputs kept to the end of backward since; no flow yet)
    ("llama-3.2-1b", "amp-bf16", "none", 2, 1024, "qdora", "q_proj,v_proj", 0.0, "nf4"),
    ("llama-3.2-1b", "amp-bf16", "full", 2, 1024, "qdora", "all-linear", 0.0, "nf4"),
    ("llama-3.2-1b", "amp-bf16", "none", 2, 1024, "lora", "all-linear", 0.0, "int8"),
    ("llama-3.2-1b", "amp-bf16", "full", 2, 1024, "lora", "all-linear", 0.0, "int8"),
    ("llama-3.2-1b", "amp-bf16", "none", 2, 1024, "dora", "q_proj,v_proj", 0.0, "int8"),
    # added in session 35 with the LLM.int8 linears' chains (events.int8_quant): q,v only, so most linears are
    # unadapted int8 ones (+9.1%, +12.9% and +12.5% before)
    ("llama-3.2-1b", "amp-bf16", "none", 2, 1024, "lora", "q_proj,v_proj", 0.0, "int8"),
    ("llama-3.2-1b", "pure-bf16", "none", 2, 1024, "lora", "q_proj,v_proj", 0.0, "int8"),
    ("qwen2.5-0.5b", "amp-bf16", "none", 4, 1024, "lora", "q_proj,v_proj", 0.0, "int8"),
)
#: --savers: (model, recipe, batch, seq, what trains: full | lora | qlora (all linears, rank 16, PEFT's base))
SAVER_SETUPS: tuple[tuple[str, str, int, int, str], ...] = (
    ("llama-3.2-1b", "amp-bf16", 2, 1024, "full"),
    ("llama-3.2-1b", "pure-bf16", 2, 1024, "full"),
    ("llama-3.2-1b", "amp-bf16", 2, 1024, "lora"),
    ("llama-3.2-1b", "amp-bf16", 2, 1024, "qlora"),
    ("llama-3.2-1b", "amp-bf16", 1, 512, "full"),
    ("llama-3.2-1b", "pure-bf16", 1, 512, "full"),
    ("llama-3.2-1b", "amp-bf16", 1, 512, "qlora"),
)
#: --offload-ckpt: activation offloading under checkpointing (model, recipe, batch, seq, trains — full, lora, qlora
#: or int8: LoRA over LLM.int8 —, checkpointing)
OFFLOAD_CKPT: tuple[tuple[str, str, int, int, str, str], ...] = (
    ("llama-3.2-1b", "amp-bf16", 2, 1024, "full", "full"),
    ("llama-3.2-1b", "pure-bf16", 2, 1024, "full", "full"),
    ("llama-3.2-1b", "amp-bf16", 2, 1024, "lora", "full"),
    ("llama-3.2-1b", "amp-bf16", 2, 1024, "qlora", "full"),
    ("llama-3.2-1b", "pure-bf16", 2, 1024, "qlora", "full"),
    ("llama-3.2-1b", "pure-bf16", 2, 1024, "full", "sqrt"),
    ("llama-3.2-1b", "amp-bf16", 2, 1024, "lora", "sqrt"),
    ("qwen2.5-0.5b", "pure-bf16", 4, 1024, "full", "full"),
    ("qwen2.5-0.5b", "amp-bf16", 4, 1024, "full", "full"),
    ("qwen2.5-0.5b", "amp-bf16", 4, 1024, "lora", "full"),
    ("llama-3.2-3b", "amp-bf16", 1, 2048, "full", "full"),
    ("llama-3.2-3b", "pure-bf16", 1, 2048, "lora", "full"),
    ("llama-3.2-1b", "amp-bf16", 2, 1024, "int8", "full"),  # LoRA over an LLM.int8 base
    ("llama-3.2-1b", "amp-bf16", 2, 1024, "int8", "sqrt"),
)
#: --savers: the savers, as the CLI spells them
SAVERS: tuple[tuple[str, MemorySavers], ...] = (
    ("--loss chunked", MemorySavers(loss=LossImpl.CHUNKED)),
    ("--loss chunked:4", MemorySavers(loss=LossImpl.CHUNKED, loss_chunks=4)),
    ("--loss fused-linear", MemorySavers(loss=LossImpl.FUSED_LINEAR)),
    ("--activation-offload", MemorySavers(activation_offload=True)),
    ("--optimizer-in-backward", MemorySavers(optimizer_in_backward=True)),
)
GIB = 2**30
BEGIN, END = "<!-- reserve-finetune:begin -->", "<!-- reserve-finetune:end -->"
SAVERS_BEGIN, SAVERS_END = "<!-- reserve-savers:begin -->", "<!-- reserve-savers:end -->"


def _both(spec: ModelSpec, s: Strategy) -> str:
    """The row's tail: each method's reserved GiB, their difference, the allocated peaks (an H100's workspaces)."""
    ra = estimate(spec, s, gpu="h100-sxm-80gb")
    rt = estimate(spec, s, gpu="h100-sxm-80gb", method="trace")
    assert ra.reserved_estimate_bytes is not None and rt.reserved_estimate_bytes is not None
    return (
        f"{ra.reserved_estimate_bytes / GIB:.2f} | {rt.reserved_estimate_bytes / GIB:.2f} | "
        f"{ra.reserved_estimate_bytes / rt.reserved_estimate_bytes - 1:+.2%} | "
        f"{ra.peak_bytes / GIB:.2f} / {rt.peak_bytes / GIB:.2f} |"
    )


def _write(rows: list[str], begin: str, end: str) -> None:
    doc = Path(__file__).resolve().parents[1] / "docs" / "accuracy.md"
    text = doc.read_text()
    new = begin + "\n" + "\n".join(rows) + "\n" + end
    doc.write_text(re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: new, text, flags=re.S))


def savers_main(write: bool) -> None:
    """The memory savers' reserved memory, analytic against the trace (docs/accuracy.md, "Memory savers: reserved
    memory")."""
    rows = [
        "| model | recipe | b×s | trains | saver | analytic reserved GiB | trace reserved GiB | diff | "
        "allocated GiB (analytic / trace) |",
        "|---|---|---|---|---|---:|---:|---:|---:|",
    ]
    print("\n".join(rows))
    for slug, recipe, batch, seq, how in SAVER_SETUPS:
        spec = load_model(slug)
        adapter, base_weights = finetune_setup(how, rank=16, targets="all-linear") if how != "full" else (None, None)
        for flag, savers in SAVERS:
            t0 = time.perf_counter()
            s = Strategy(precision=Precision(recipe), micro_batch=batch, seq_len=seq, savers=savers)
            if adapter is not None and base_weights is not None:
                s = replace(s, adapter=adapter, base_weights=base_weights)
            rows.append(f"| {slug} | {recipe} | {batch}×{seq} | {how} | `{flag}` | {_both(spec, s)}")
            print(f"{rows[-1]}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    if write:
        _write(rows, SAVERS_BEGIN, SAVERS_END)


def offload_ckpt_main() -> None:
    """Activation offloading under checkpointing, analytic against the (full-depth) trace (docs/accuracy.md,
    "Activation offloading under checkpointing")."""
    print(
        "| model | recipe | b×s | trains | ckpt | analytic reserved GiB | trace reserved GiB | diff | allocated GiB |"
    )
    print("|---|---|---|---|---|---:|---:|---:|---:|")
    for slug, recipe, batch, seq, how, ckpt in OFFLOAD_CKPT:
        t0 = time.perf_counter()
        spec = load_model(slug)
        s = Strategy(
            precision=Precision(recipe),
            checkpointing=Checkpointing(ckpt),
            micro_batch=batch,
            seq_len=seq,
            savers=MemorySavers(activation_offload=True),
        )
        if how != "full":
            int8 = how == "int8"
            adapter, base_weights = finetune_setup(
                "lora" if int8 else how, rank=16, targets="all-linear", base_dtype="int8" if int8 else None
            )
            s = replace(s, adapter=adapter, base_weights=base_weights)
        print(
            f"| {slug} | {recipe} | {batch}×{seq} | {how} | {ckpt} | {_both(spec, s)}"
            f"  ({time.perf_counter() - t0:.0f} s)"
        )


def finetune_main(write: bool) -> None:
    rows = [
        "| model | recipe | ckpt | b×s | adapter | analytic reserved GiB | trace reserved GiB | diff | "
        "allocated GiB (analytic / trace) |",
        "|---|---|---|---|---|---:|---:|---:|---:|",
    ]
    print("\n".join(rows))
    for slug, recipe, ckpt, batch, seq, how, targets, dropout, base in FINETUNE:
        t0 = time.perf_counter()
        spec = load_model(slug)
        adapter, base_weights = finetune_setup(
            "qlora" if how in ("qlora", "qdora") else "lora",
            rank=16,
            targets=targets,
            dropout=dropout,
            dora=how in ("dora", "qdora"),
            base_dtype=base,
        )
        s = Strategy(
            precision=Precision(recipe),
            checkpointing=Checkpointing(ckpt),
            micro_batch=batch,
            seq_len=seq,
            adapter=adapter,
            base_weights=base_weights,
        )
        setup = f"{how} r16 {targets}" + (f" dropout {dropout}" if dropout else "") + (f" {base} base" if base else "")
        rows.append(f"| {slug} | {recipe} | {ckpt} | {batch}×{seq} | {setup} | {_both(spec, s)}")
        print(f"{rows[-1]}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    if write:
        _write(rows, BEGIN, END)


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--finetune":
        finetune_main("--write" in argv[1:])
        return
    if argv and argv[0] == "--offload-ckpt":
        offload_ckpt_main()
        return
    if argv and argv[0] == "--savers":
        savers_main("--write" in argv[1:])
        return
    cases = CASES
    if argv:
        if len(argv) % 5:
            sys.exit("give cases as MODEL RECIPE CKPT BATCH SEQ, five values each")
        cases = tuple(
            (argv[i], argv[i + 1], argv[i + 2], int(argv[i + 3]), int(argv[i + 4])) for i in range(0, len(argv), 5)
        )
    print(
        "| model | recipe | ckpt | b×s | allocated GiB | stream allocated GiB | analytic reserved GiB "
        "| trace reserved GiB "
        "| diff |"
    )
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    for slug, recipe, ckpt, batch, seq in cases:
        t0 = time.perf_counter()
        spec = load_model(slug)
        s = Strategy(precision=Precision(recipe), checkpointing=Checkpointing(ckpt), micro_batch=batch, seq_len=seq)
        ra = estimate(spec, s, gpu="h100-sxm-80gb")
        rt = estimate(spec, s, gpu="h100-sxm-80gb", method="trace")
        stream = simulate(training_events(spec, s))
        assert ra.reserved_estimate_bytes is not None and rt.reserved_estimate_bytes is not None
        print(
            f"| {slug} | {recipe} | {ckpt} | {batch}×{seq} | {ra.peak_bytes / GIB:.2f} | "
            f"{stream.peak_allocated_bytes / GIB:.2f} | {ra.reserved_estimate_bytes / GIB:.2f} | "
            f"{rt.reserved_estimate_bytes / GIB:.2f} | "
            f"{ra.reserved_estimate_bytes / rt.reserved_estimate_bytes - 1:+.2%} |"
            f"  ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])

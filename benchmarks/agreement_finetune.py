"""Analytic vs trace for LoRA fine-tuning at catalog sizes: the table in docs/accuracy.md ("Fine-tuning:
analytic vs trace").

For each model x target set x checkpointing x dropout (rank 16, amp-bf16 over a bf16 base with PEFT's fp32
adapters, micro-batch 1 x 2048 tokens) the peak of each method and the worst per-phase difference. The trace
runs real PEFT modules on fake tensors (trainfit.trace.peft) and extrapolates in depth from two depths.
QLoRA rows trace real bitsandbytes Linear4bit layers quantised on fake tensors.
``--freeze-int8``: the ``--finetune freeze`` and LLM.int8 rows instead (their own marked section).
``--savers``: the memory savers the trace runs (trainfit.trace.savers: selective recompute, Liger's fused linear
cross-entropy, torchtune's activation offloading), full fine-tuning (their own marked section); ``--savers-lora``: the
same savers over LoRA and QLoRA all-linear (their own marked section).
``--layouts``: LoRA on fused-qkv and parallel-block layouts (GPT-2's Conv1D, Phi-2, Falcon, NeoX) and DoRA with
dropout (their own marked section); ``--layouts-qlora``: QLoRA on those layouts (its own marked section).
``--moe``: LoRA on transformers 5 MoE models (Mixtral, Qwen3-MoE; PEFT's target_parameters on the experts).
``--moe-int8``: LoRA over an LLM.int8 base on those MoE models and DeepSeek-V3's MLA + MoE layers (real bitsandbytes
Linear8bitLt on the attention and shared-expert linears, float experts and routers).
``--bert``: LoRA on bert-large-uncased's masked-LM model (q,v and all-linear, with and without checkpointing).
Usage: python benchmarks/agreement_finetune.py [--freeze-int8 | --savers | --savers-lora | --layouts | --layouts-qlora
| --moe | --moe-int8 | --bert] [--write] (--write replaces the marked section of docs/accuracy.md)
"""

from __future__ import annotations

import itertools
import re
import sys
import time
from pathlib import Path

from trainfit import Strategy, estimate
from trainfit.arch import load_model
from trainfit.result import Component, MemoryReport
from trainfit.strategy import MemorySavers, finetune_setup

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
        out.append(_qlora_row(name, targets, ckpt))
    return out


def _qlora_row(name: str, targets: str, ckpt: str, *, dropout: float = 0.0, seq: int = 2048) -> str:
    """One QLoRA row: peaks, the worst phase difference and the analytic's weights (rank 16, micro-batch 1)."""
    spec = load_model(name)
    a, b = finetune_setup("qlora", rank=16, targets=targets, dropout=dropout)
    s = Strategy(adapter=a, base_weights=b, checkpointing=ckpt, micro_batch=1, seq_len=seq)
    t0 = time.perf_counter()
    ra, rt = estimate(spec, s), estimate(spec, s, method="trace")
    w = ra.phases[0].get(Component.WEIGHTS)
    row = (
        f"| {name} | {targets} | {ckpt} | {ra.peak_bytes / GIB:.2f} | {rt.peak_bytes / GIB:.2f} "
        f"| {_worst(ra, rt) * 100:+.2f}% | {w / GIB:.2f} |"
    )
    print(row, f"({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    return row


#: ``--freeze`` patterns per model: the embeddings, the embeddings and the lower half of the layers, everything
#: but the LM head (llama-3.2-1b ties it to the token table: everything but that table).
FREEZE = {
    "llama-3.2-1b": ("embeddings", "embeddings,layers:0-7", "layers:0-15,norm"),  # tied: the table is the head
    "llama-3.1-8b": ("embeddings", "embeddings,layers:0-15", "embeddings,layers:0-31,norm"),
}
FREEZE_BEGIN, FREEZE_END = "<!-- agreement-freeze-int8:begin -->", "<!-- agreement-freeze-int8:end -->"


def _worst(ra: MemoryReport, rt: MemoryReport) -> float:
    pairs = zip(ra.phases, rt.phases, strict=True)
    return max(((pa.total_bytes - pt.total_bytes) / pt.total_bytes for pa, pt in pairs), key=abs)


def freeze_int8_rows() -> list[str]:
    """``--finetune freeze`` (amp-bf16, the trace freezing the real model's parameters) and LoRA over an
    LLM.int8 base (real bitsandbytes Linear8bitLt run as MatMul8bitLt), micro-batch 1 x 2048 tokens."""
    out = [
        "| model | setup | ckpt | analytic peak GiB | trace peak GiB | worst phase diff |",
        "|---|---|---|---:|---:|---:|",
    ]
    cases: list[tuple[str, str, Strategy]] = []
    for name, patterns in FREEZE.items():
        for freeze, ckpt in itertools.product(patterns, CHECKPOINTING):
            _, b = finetune_setup("freeze", freeze=freeze)
            s = Strategy(base_weights=b, checkpointing=ckpt, micro_batch=1, seq_len=2048)
            cases.append((name, f"freeze {freeze}", s))
    for name, targets, ckpt in itertools.product(FREEZE, TARGETS, CHECKPOINTING):
        a, b = finetune_setup("lora", rank=16, targets=targets, base_dtype="int8")
        s = Strategy(adapter=a, base_weights=b, checkpointing=ckpt, micro_batch=1, seq_len=2048)
        cases.append((name, f"int8 lora {targets}", s))
    for name, setup, s in cases:
        spec = load_model(name)
        t0 = time.perf_counter()
        ra, rt = estimate(spec, s), estimate(spec, s, method="trace")
        out.append(
            f"| {name} | {setup} | {s.checkpointing.value} | {ra.peak_bytes / GIB:.2f} | {rt.peak_bytes / GIB:.2f} "
            f"| {_worst(ra, rt) * 100:+.2f}% |"
        )
        print(out[-1], f"({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    return out


SAVERS_BEGIN, SAVERS_END = "<!-- agreement-savers:begin -->", "<!-- agreement-savers:end -->"
SAVER_MODELS = ("llama-3.2-1b", "qwen2.5-0.5b")
#: (label, precision, checkpointing, attention, savers) — micro-batch 1 x 2048 tokens, full fine-tuning
SAVER_CASES = (
    ("selective (flash)", "amp-bf16", "selective", "sdpa", MemorySavers()),
    ("selective (eager)", "pure-bf16", "selective", "eager", MemorySavers()),
    ("selective (eager)", "amp-bf16", "selective", "eager", MemorySavers()),
    ("fused-linear", "pure-bf16", "none", "sdpa", MemorySavers(loss="fused-linear")),
    ("fused-linear", "amp-bf16", "full", "sdpa", MemorySavers(loss="fused-linear")),
    ("chunked", "pure-bf16", "none", "sdpa", MemorySavers(loss="chunked")),
    ("chunked", "amp-bf16", "none", "sdpa", MemorySavers(loss="chunked")),
    ("activation offload", "pure-bf16", "full", "sdpa", MemorySavers(activation_offload=True)),
    ("activation offload", "amp-bf16", "full", "sdpa", MemorySavers(activation_offload=True)),
    ("activation offload", "pure-bf16", "none", "sdpa", MemorySavers(activation_offload=True)),
    ("activation offload (eager)", "amp-bf16", "none", "eager", MemorySavers(activation_offload=True)),
)


def saver_rows() -> list[str]:
    out = [
        "| model | saver | recipe | ckpt | analytic peak GiB | trace peak GiB | worst phase diff "
        "| host GiB analytic / trace |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for name, (label, precision, ckpt, attention, savers) in itertools.product(SAVER_MODELS, SAVER_CASES):
        spec = load_model(name)
        s = Strategy(
            precision=precision,  # type: ignore[arg-type]
            checkpointing=ckpt,  # type: ignore[arg-type]
            attention=attention,  # type: ignore[arg-type]
            micro_batch=1,
            seq_len=2048,
            savers=savers,
        )
        t0 = time.perf_counter()
        # Allocated bytes only: the table compares allocated peaks (the allocator replay adds minutes per row).
        ra = estimate(spec, s, simulate_allocator=False)
        rt = estimate(spec, s, method="trace", simulate_allocator=False)
        host = f"{ra.phases[0].host_bytes / GIB:.2f} / {rt.phases[0].host_bytes / GIB:.2f}" if savers.any else "-"
        out.append(
            f"| {name} | {label} | {precision} | {ckpt} | {ra.peak_bytes / GIB:.2f} | {rt.peak_bytes / GIB:.2f} "
            f"| {_worst(ra, rt) * 100:+.2f}% | {host} |"
        )
        print(out[-1], f"({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    return out


SAVERS_LORA_BEGIN, SAVERS_LORA_END = "<!-- agreement-savers-lora:begin -->", "<!-- agreement-savers-lora:end -->"
#: (finetune, label, precision, checkpointing, savers) — the savers over LoRA/QLoRA all-linear (rank 16, PEFT's fp32
#: adapters; LoRA over a bf16 base), micro-batch 1 x 2048 tokens
SAVER_ADAPTER_CASES = (
    ("lora", "selective (flash)", "amp-bf16", "selective", MemorySavers()),
    ("lora", "fused-linear", "amp-bf16", "none", MemorySavers(loss="fused-linear")),
    ("lora", "chunked", "amp-bf16", "none", MemorySavers(loss="chunked")),
    ("lora", "activation offload", "amp-bf16", "full", MemorySavers(activation_offload=True)),
    ("lora", "activation offload", "amp-bf16", "none", MemorySavers(activation_offload=True)),
    ("qlora", "fused-linear", "amp-bf16", "full", MemorySavers(loss="fused-linear")),
    ("qlora", "chunked", "pure-bf16", "full", MemorySavers(loss="chunked")),
    ("qlora", "activation offload", "amp-bf16", "full", MemorySavers(activation_offload=True)),
    ("lora", "optimizer in backward", "amp-bf16", "none", MemorySavers(optimizer_in_backward=True)),
    ("qlora", "optimizer in backward", "amp-bf16", "full", MemorySavers(optimizer_in_backward=True)),
)


def saver_adapter_rows() -> list[str]:
    """``--savers-lora``: the memory savers the trace runs, over LoRA and QLoRA (allocated peaks, as ``--savers``)."""
    out = [
        "| model | adapter | saver | recipe | ckpt | analytic peak GiB | trace peak GiB | worst phase diff "
        "| host GiB analytic / trace |",
        "|---|---|---|---|---|---:|---:|---:|---:|",
    ]
    for name, (kind, label, precision, ckpt, savers) in itertools.product(SAVER_MODELS, SAVER_ADAPTER_CASES):
        spec = load_model(name)
        a, b = finetune_setup(kind, rank=16, targets="all-linear", base_dtype="bf16" if kind == "lora" else None)
        s = Strategy(
            precision=precision,  # type: ignore[arg-type]
            checkpointing=ckpt,  # type: ignore[arg-type]
            micro_batch=1,
            seq_len=2048,
            savers=savers,
            adapter=a,
            base_weights=b,
        )
        t0 = time.perf_counter()
        ra = estimate(spec, s, simulate_allocator=False)
        rt = estimate(spec, s, method="trace", simulate_allocator=False)
        host = f"{ra.phases[0].host_bytes / GIB:.2f} / {rt.phases[0].host_bytes / GIB:.2f}"
        out.append(
            f"| {name} | {kind} | {label} | {precision} | {ckpt} | {ra.peak_bytes / GIB:.2f} "
            f"| {rt.peak_bytes / GIB:.2f} | {_worst(ra, rt) * 100:+.2f}% | {host} |"
        )
        print(out[-1], f"({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    return out


LAYOUTS_BEGIN, LAYOUTS_END = "<!-- agreement-layouts:begin -->", "<!-- agreement-layouts:end -->"
#: Fused qkv (GPT-2 c_attn as a Conv1D, Falcon/NeoX query_key_value) and parallel blocks (Phi-2, Falcon, NeoX).
LAYOUT_MODELS = ("gpt2-large", "phi-2", "falcon-7b", "pythia-6.9b")
#: DoRA with dropout: PEFT's second base linear on the dropped input (trainfit.analytic.adapters.dora_weight_copy_bytes)
DORA_MODELS = ("llama-3.2-1b", "qwen2.5-1.5b")


def layout_rows() -> list[str]:
    """LoRA all-linear, dropout 0.05, and DoRA with dropout 0.05 (amp-bf16 over a bf16 base, PEFT's fp32 adapters,
    rank 16, micro-batch 1 x 2048 tokens)."""
    out = [
        "| model | adapter | targets | ckpt | analytic peak GiB | trace peak GiB | worst phase diff |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    cases = [(m, False, "all-linear", c) for m, c in itertools.product(LAYOUT_MODELS, CHECKPOINTING)]
    cases += [(m, True, t, c) for m, t, c in itertools.product(DORA_MODELS, TARGETS, CHECKPOINTING)]
    for name, dora, targets, ckpt in cases:
        spec = load_model(name)
        a, b = finetune_setup("lora", rank=16, targets=targets, dropout=0.05, base_dtype="bf16", dora=dora)
        s = Strategy(adapter=a, base_weights=b, checkpointing=ckpt, micro_batch=1, seq_len=2048)
        t0 = time.perf_counter()
        ra, rt = estimate(spec, s), estimate(spec, s, method="trace")
        out.append(
            f"| {name} | {'dora' if dora else 'lora'} | {targets} | {ckpt} | {ra.peak_bytes / GIB:.2f} "
            f"| {rt.peak_bytes / GIB:.2f} | {_worst(ra, rt) * 100:+.2f}% |"
        )
        print(out[-1], f"({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    return out


MOE_BEGIN, MOE_END = "<!-- agreement-moe:begin -->", "<!-- agreement-moe:end -->"
#: transformers 5 MoE layers under PEFT's target_parameters conversion (trainfit.analytic.activations.frozen_moe_terms)
MOE_MODELS = ("mixtral-8x7b-v0.1", "qwen3-30b-a3b", "deepseek-v3")
#: DeepSeek-V3's attention is MLA (no q_proj/v_proj): its q and kv projections stand in for "q,v"
MOE_TARGETS = {"deepseek-v3": ("q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj", "all-linear")}


def moe_rows(*, base: str = "bf16") -> list[str]:
    """LoRA on MoE models, no dropout (PEFT's ParamWrapper refuses it): amp-bf16 over a ``base`` base (bf16; or
    ``int8``: LLM.int8 linears, the experts and routers in the recipe's fp32), PEFT's fp32 adapters, rank 16,
    micro-batch 1 x 2048 tokens; the worst phase also without the cuBLAS workspaces."""
    out = [
        "| model | targets | ckpt | analytic peak GiB | trace peak GiB | worst phase diff | without workspaces |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    cells = [(m, t, c) for m in MOE_MODELS for t in MOE_TARGETS.get(m, TARGETS) for c in CHECKPOINTING]
    for name, targets, ckpt in cells:
        spec = load_model(name)
        a, b = finetune_setup("lora", rank=16, targets=targets, base_dtype=base)
        s = Strategy(adapter=a, base_weights=b, checkpointing=ckpt, micro_batch=1, seq_len=2048)
        t0 = time.perf_counter()
        ra, rt = estimate(spec, s), estimate(spec, s, method="trace")
        ws = max(
            ((pa.total_bytes - pt.total_bytes) / (pt.total_bytes - pt.get(Component.WORKSPACES)) for pa, pt in
             zip(ra.phases, rt.phases, strict=True)),
            key=abs,
        )  # fmt: skip
        out.append(
            f"| {name} | {targets} | {ckpt} | {ra.peak_bytes / GIB:.2f} | {rt.peak_bytes / GIB:.2f} "
            f"| {_worst(ra, rt) * 100:+.2f}% | {ws * 100:+.2f}% |"
        )
        print(out[-1], f"({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    return out


MOE_INT8_BEGIN, MOE_INT8_END = "<!-- agreement-moe-int8:begin -->", "<!-- agreement-moe-int8:end -->"


def moe_int8_rows() -> list[str]:
    """``--moe-int8``: the MoE rows over an LLM.int8 base (trainfit.analytic.activations.int8_layer_inputs)."""
    return moe_rows(base="int8")


QLAYOUTS_BEGIN, QLAYOUTS_END = "<!-- agreement-layouts-qlora:begin -->", "<!-- agreement-layouts-qlora:end -->"
#: QLoRA on those layouts (Falcon refused: transformers leaves its FalconLinear layers float; no Phi-3 in the catalog)
QLORA_LAYOUT_MODELS = ("gpt2-large", "phi-2", "pythia-6.9b")


def qlora_layout_rows() -> list[str]:
    """QLoRA (nf4 + double quant, prepare_model_for_kbit_training) all-linear, dropout 0.05 on GPT-2's Conv1D,
    Phi-2 and NeoX layouts (amp-bf16, PEFT's fp32 adapters, rank 16, micro-batch 1 x 2048 tokens; GPT-2's
    context is 1024)."""
    out = [
        "| model | targets | ckpt | analytic peak GiB | trace peak GiB | worst phase diff | weights GiB |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for name, ckpt in itertools.product(QLORA_LAYOUT_MODELS, CHECKPOINTING):
        seq = min(2048, load_model(name).max_position_embeddings or 2048)
        out.append(_qlora_row(name, "all-linear", ckpt, dropout=0.05, seq=seq))
    return out


BERT_BEGIN, BERT_END = "<!-- agreement-bert-lora:begin -->", "<!-- agreement-bert-lora:end -->"


def bert_rows() -> list[str]:
    """``--bert``: LoRA on bert-large-uncased's masked-LM model (rank 16, dropout 0.05, amp-bf16 over a bf16 base,
    PEFT's fp32 adapters, micro-batch 8 x 512); allocated bytes only."""
    out = [
        "| targets | ckpt | trainable params | analytic peak GiB | trace peak GiB | forward | backward "
        "| optimizer step |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    spec = load_model("bert-large-uncased")
    for targets, ckpt in itertools.product(("query,value", "all-linear"), CHECKPOINTING):
        a, b = finetune_setup("lora", rank=16, targets=targets, dropout=0.05, base_dtype="bf16")
        s = Strategy(precision="amp-bf16", adapter=a, base_weights=b, checkpointing=ckpt, micro_batch=8, seq_len=512)
        t0 = time.perf_counter()
        ra = estimate(spec, s, simulate_allocator=False)
        rt = estimate(spec, s, method="trace", simulate_allocator=False)
        diffs = " | ".join(
            f"{(pa.total_bytes - pt.total_bytes) / pt.total_bytes * 100:+.2f}%"
            for pa, pt in zip(ra.phases, rt.phases, strict=True)
        )
        out.append(
            f"| {targets} | {ckpt} | {ra.trainable_params:,} | {ra.peak_bytes / GIB:.2f} | {rt.peak_bytes / GIB:.2f} "
            f"| {diffs} |"
        )
        print(out[-1], f"({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    return out


def _write(begin: str, end: str, table: str) -> None:
    doc = Path(__file__).resolve().parent.parent / "docs" / "accuracy.md"
    text = doc.read_text()
    new = f"{begin}\n{table}\n{end}"
    text = re.sub(re.escape(begin) + ".*?" + re.escape(end), new, text, flags=re.S) if begin in text else text
    doc.write_text(text)


def main() -> None:
    """``--freeze-int8`` / ``--savers`` / ``--layouts`` / ``--layouts-qlora`` / ``--moe`` / ``--moe-int8`` / ``--bert``
    run only their own table (each its own marked section)."""
    sections = {
        "--moe-int8": (moe_int8_rows, MOE_INT8_BEGIN, MOE_INT8_END),
        "--savers-lora": (saver_adapter_rows, SAVERS_LORA_BEGIN, SAVERS_LORA_END),
        "--savers": (saver_rows, SAVERS_BEGIN, SAVERS_END),
        "--freeze-int8": (freeze_int8_rows, FREEZE_BEGIN, FREEZE_END),
        "--layouts": (layout_rows, LAYOUTS_BEGIN, LAYOUTS_END),
        "--moe": (moe_rows, MOE_BEGIN, MOE_END),
        "--layouts-qlora": (qlora_layout_rows, QLAYOUTS_BEGIN, QLAYOUTS_END),
        "--bert": (bert_rows, BERT_BEGIN, BERT_END),
    }
    make, begin, end = next(
        (v for k, v in sections.items() if k in sys.argv),
        (lambda: rows(qlora_only="--qlora-only" in sys.argv), BEGIN, END),
    )
    table = "\n".join(make())
    print(table)
    if "--write" in sys.argv:
        _write(begin, end, table)


if __name__ == "__main__":
    main()

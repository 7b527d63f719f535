"""Analytic vs trace for one rank of a many-GPU run at catalog sizes: the table in docs/accuracy.md
("Many GPUs: analytic vs trace").

Each row traces rank 0 of the real FSDP2 ``fully_shard`` or torch DDP on PyTorch's fake process group
(trainfit.trace.distributed; 1–2 layers, extrapolated in depth) and compares every phase with the
closed-form model (trainfit.analytic.parallel). The trace time is the wall time of the whole trace; it
does not grow with the world size. The fine-tuning rows wrap real PEFT LoRA models (QLoRA: bitsandbytes
4-bit layers) before the framework does.
Usage: python benchmarks/agreement_distributed.py [--quick] [--finetune]
"""

from __future__ import annotations

import sys
import time

from trainfit.analytic.parallel import estimate_parallel
from trainfit.arch import load_model
from trainfit.strategy import EngineOptions, Parallelism, Strategy, finetune_setup
from trainfit.trace.distributed import trace_distributed

# (model, sharding, world size, reshard_after_forward / gradient_as_bucket_view, checkpointing)
CASES = (
    ("llama-3.1-8b", "fsdp", 8, True, "none"),
    ("llama-3.1-8b", "fsdp", 8, False, "none"),
    ("llama-3.1-8b", "fsdp", 64, True, "full"),
    ("qwen2.5-7b", "fsdp", 2, True, "none"),
    ("qwen2.5-7b", "ddp", 2, False, "none"),
    ("qwen2.5-7b", "ddp", 8, True, "none"),
    ("llama-3.2-1b", "ddp", 64, False, "full"),
    ("llama-3.1-70b", "fsdp", 64, True, "full"),
)
QUICK = CASES[:1]
# (model, sharding, world size, flag, checkpointing, finetune, LoRA targets): rank 16, PEFT's fp32 adapters
FINETUNE = (
    ("llama-3.1-8b", "fsdp", 8, True, "none", "lora", "all-linear"),
    ("llama-3.1-8b", "fsdp", 8, False, "full", "lora", "q_proj,v_proj"),
    ("llama-3.1-8b", "fsdp", 64, True, "full", "lora", "all-linear"),
    ("llama-3.1-8b", "fsdp", 8, True, "full", "qlora", "all-linear"),
    ("llama-3.1-8b", "ddp", 8, False, "full", "lora", "all-linear"),
    ("qwen2.5-7b", "hsdp", 16, True, "none", "lora", "q_proj,v_proj"),
)


def gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def strategy(sharding: str, w: int, flag: bool, ckpt: str, how: str = "full", targets: str = "all-linear") -> Strategy:
    adapter, base = finetune_setup(how, rank=16, targets=targets) if how != "full" else (None, None)
    extra = {"adapter": adapter, "base_weights": base} if adapter is not None else {}
    return Strategy(
        **extra,  # type: ignore[arg-type]
        parallelism=Parallelism(data=w),
        sharding=sharding,
        checkpointing=ckpt,
        micro_batch=1,
        seq_len=2048,
        engine=EngineOptions(
            reshard_after_forward=flag if sharding in ("fsdp", "hsdp") else True,
            gradient_as_bucket_view=flag if sharding == "ddp" else False,
        ),
    )


def main(argv: list[str]) -> None:
    cases: tuple[tuple[object, ...], ...] = QUICK if "--quick" in argv else CASES
    if "--finetune" in argv:
        cases = FINETUNE
    print(
        "| model | setup | W | ckpt | analytic GiB (phase) | trace GiB (phase) | Δ peak | worst Δ of a phase "
        "| trace s |"
    )
    print("|---|---|---:|---|---:|---:|---:|---:|---:|")
    for slug, sharding, w, flag, ckpt, *ft in cases:
        spec = load_model(str(slug))
        s = strategy(str(sharding), int(w), bool(flag), str(ckpt), *map(str, ft))  # type: ignore[call-overload]
        t0 = time.perf_counter()
        tr = trace_distributed(spec, s)
        secs = time.perf_counter() - t0
        an = estimate_parallel(spec, s)
        setup = (
            f"{'HSDP' if sharding == 'hsdp' else 'FSDP2'}, reshard_after_forward={flag}"
            if sharding in ("fsdp", "hsdp")
            else f"DDP, gradient_as_bucket_view={flag}"
        )
        if ft:
            setup += f", {ft[0]} r16 {ft[1]}"
        worst = max(
            abs(a.total_bytes - t.total_bytes) / t.total_bytes for a, t in zip(an.phases, tr.phases, strict=True)
        )
        d = (an.peak_bytes - tr.peak_bytes) / tr.peak_bytes
        print(
            f"| {slug} | {setup} | {w} | {ckpt} | {gib(an.peak_bytes)} ({an.peak_phase.value}) | "
            f"{gib(tr.peak_bytes)} ({tr.peak_phase.value}) | {d:+.2%} | {worst:.2%} | {secs:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])

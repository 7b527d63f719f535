"""Analytic vs trace for one rank of a many-GPU run at catalog sizes: the table in docs/accuracy.md
("Many GPUs: analytic vs trace").

Each row traces rank 0 of the real FSDP2 ``fully_shard`` or torch DDP on PyTorch's fake process group
(trainfit.trace.distributed; 1–2 layers, extrapolated in depth) and compares every phase with the
closed-form model (trainfit.analytic.parallel). The trace time is the wall time of the whole trace; it
does not grow with the world size.
DeepSpeed ZeRO-1/2 rows run rank 0 of the real DeepSpeed engine (trainfit.trace.deepspeed).
Usage: python benchmarks/agreement_distributed.py [--quick | --deepspeed]
"""

from __future__ import annotations

import sys
import time

from trainfit.analytic.parallel import estimate_parallel
from trainfit.arch import load_model
from trainfit.strategy import EngineOptions, Parallelism, Strategy
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
    # DeepSpeed ZeRO (trainfit.trace.deepspeed; the flag is unused): the exported ds_config.json, default buckets
    ("llama-2-7b", "zero2", 8, False, "none"),
    ("llama-2-7b", "zero1", 64, False, "none"),
    ("qwen2.5-7b", "zero2", 2, False, "full"),
)
QUICK = CASES[:1]


def gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def strategy(sharding: str, w: int, flag: bool, ckpt: str) -> Strategy:
    return Strategy(
        parallelism=Parallelism(data=w),
        sharding=sharding,
        checkpointing=ckpt,
        micro_batch=1,
        seq_len=2048,
        engine=EngineOptions(
            reshard_after_forward=flag if sharding == "fsdp" else True,
            gradient_as_bucket_view=flag if sharding == "ddp" else False,
        ),
    )


def main(argv: list[str]) -> None:
    cases = QUICK if "--quick" in argv else CASES
    if "--deepspeed" in argv:
        cases = tuple(c for c in CASES if c[1].startswith("zero"))
    print(
        "| model | setup | W | ckpt | analytic GiB (phase) | trace GiB (phase) | Δ peak | worst Δ of a phase "
        "| trace s |"
    )
    print("|---|---|---:|---|---:|---:|---:|---:|---:|")
    for slug, sharding, w, flag, ckpt in cases:
        spec = load_model(slug)
        s = strategy(sharding, w, flag, ckpt)
        t0 = time.perf_counter()
        tr = trace_distributed(spec, s)
        secs = time.perf_counter() - t0
        an = estimate_parallel(spec, s)
        setup = (
            f"FSDP2, reshard_after_forward={flag}"
            if sharding == "fsdp"
            else f"DeepSpeed ZeRO-{sharding[-1]}"
            if sharding.startswith("zero")
            else f"DDP, gradient_as_bucket_view={flag}"
        )
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

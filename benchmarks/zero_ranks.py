"""DeepSpeed ZeRO-1/2 ranks at catalog sizes: every distinct rank's allocated peak from the closed form
(trainfit.analytic.parallel, ``MemoryReport.ranks``), from its own event stream (trainfit.analytic.rank_events with
``dp_rank``) and, with ``--trace``, from the real engine traced at full depth for that rank
(trainfit.trace.deepspeed ``rank=``). docs/accuracy.md "ZeRO-1/2 ranks differ".

Usage: python benchmarks/zero_ranks.py [--trace]
"""

from __future__ import annotations

import sys
import time

from trainfit.allocator import AllocatorConfig
from trainfit.analytic.parallel import estimate_parallel, plan
from trainfit.analytic.rank_events import simulate_rank
from trainfit.arch import load_model
from trainfit.report.table import rank_ranges
from trainfit.strategy import Offload, Parallelism, Strategy

# (model, sharding, W, --offload, micro-batch × sequence), amp-bf16, full recompute
CASES = (
    ("llama-3.2-1b", "zero2", 8, "none", 1024),
    ("llama-3.2-1b", "zero1", 8, "none", 1024),
    ("llama-3.1-8b", "zero2", 8, "optimizer", 2048),
    ("llama-3.1-8b", "zero1", 8, "optimizer", 2048),
)


def main(argv: list[str]) -> None:
    trace = "--trace" in argv
    print("| model | setup | W | ranks | closed GiB | stream GiB (Δ) | trace GiB (Δ) | trace s |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    for slug, sharding, w, offload, seq in CASES:
        spec = load_model(slug)
        s = Strategy(
            precision="amp-bf16",
            parallelism=Parallelism(data=w),
            sharding=sharding,  # type: ignore[arg-type]
            micro_batch=1,
            seq_len=seq,
            checkpointing="full",  # type: ignore[arg-type]
            offload=Offload.parse(offload),
        )
        closed = estimate_parallel(spec, s)
        entries = closed.ranks or (closed.rank(0),)
        setup = f"ZeRO-{sharding[-1]}" + (f", --offload {offload}" if offload != "none" else "")
        for e in entries:
            r = e.ranks[0]
            sim = simulate_rank(spec, s, plan(spec, s), AllocatorConfig(), dp_rank=r).peak_allocated_bytes
            traced, secs = "—", ""
            if trace:
                from trainfit.trace.deepspeed import trace_deepspeed

                t0 = time.perf_counter()
                t = trace_deepspeed(spec, s, rank=r, extrapolate=False).peak_bytes
                secs = f"{time.perf_counter() - t0:.1f}"
                traced = f"{t / 2**30:.3f} ({(e.peak_bytes - t) / t:+.2%})"
            print(
                f"| {slug} | {setup} | {w} | {rank_ranges(e.ranks)} | {e.peak_bytes / 2**30:.3f} | "
                f"{sim / 2**30:.3f} ({(e.peak_bytes - sim) / sim:+.2%}) | {traced} | {secs} |",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1:])

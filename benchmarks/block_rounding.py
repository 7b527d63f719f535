"""Why ``--method analytic`` is a little under ``torch.cuda.max_memory_allocated`` on the H200: block rounding.

    PYTHONPATH=src python benchmarks/block_rounding.py [--truth DIR]
    PYTHONPATH=src python benchmarks/block_rounding.py --matrix

``--matrix``: the 16 cells of ``benchmarks/gpu_matrix.py``'s H200 run (``benchmarks/h200/2026-12-04b/matrix``,
``measure_spec`` at full depth, so blocks), per phase, against the analytic estimate with the H200's torch 2.11
workspaces, its tensors' requests alone (before 2026-12-05) and with the allocator's rounding
(``Component.ALLOCATOR_ROUNDING``, :mod:`trainfit.analytic.blocks`).

``max_memory_allocated`` counts the *blocks* the caching allocator hands out (c10/cuda/CUDACachingAllocator.cpp:
``stats.allocated_bytes`` grows by ``block->size``), and a block is larger than its request when it was served from a
cached block whose remainder was too small to split off (large pool: ≤ 1 MiB, ``shouldSplit``). trainfit's closed
form counts requests (rounded to 512 B). This script replays the real event trace of ``q05-amp-foreach-b4s2048``
(../shared/gpu-truth, default allocator) once as requests and once through the allocator simulation (which
reproduces the real trace's blocks exactly: benchmarks/allocator_replay.py), and prints each step's backward and
optimizer-step peaks both ways beside the measured peaks and the analytic estimate. Absolute bytes: the recording
starts after the model and optimizer were built, so the runs are anchored at the end of the last step, whose live
requests and blocks the snapshot's segments list (``requested_size``, ``size``).
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path

from h200_data import case, find_truth, measured_strategy

from trainfit import Strategy, estimate
from trainfit.allocator import AllocatorConfig, Simulator
from trainfit.result import Component, Phase

CASE = "q05-amp-foreach-b4s2048"
MATRIX = Path(__file__).parent / "h200" / "2026-12-04b" / "matrix" / "results.jsonl"


def matrix() -> int:
    """The gpu_matrix cells: measured blocks per phase against the analytic requests and requests + rounding."""
    print("| model | recipe | ckpt | phase | measured MB | requests | + rounding | rounding MB |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    worst = {"requests": 0.0, "blocks": 0.0}
    for line in MATRIX.read_text().splitlines():
        row = json.loads(line)
        if "measured" not in row:
            continue
        st = Strategy(
            precision=row["precision"],
            checkpointing=row["checkpointing"],
            micro_batch=row["batch"],
            seq_len=row["seq"],
            optimizer_impl=row["optimizer_impl"],
        )
        rep = estimate(
            row["model"], st, gpu="h200-sxm-141gb", allocator="", torch_version=(2, 11), search_micro_batch=False
        )
        for ph in Phase:
            real = row["measured"][ph.value]
            blocks = rep.phase(ph).total_bytes
            rounding = rep.phase(ph).get(Component.ALLOCATOR_ROUNDING)
            before, after = (blocks - rounding) / real - 1, blocks / real - 1
            worst["requests"] = max(worst["requests"], abs(before))
            worst["blocks"] = max(worst["blocks"], abs(after))
            print(
                f"| {row['model']} | {row['precision']} | {row['checkpointing']} | {ph.value} | {real / 1e6:,.1f} "
                f"| {before:+.2%} | {after:+.2%} | {rounding / 1e6:.1f} |"
            )
    print(f"worst: requests {worst['requests']:.2%}, with the rounding {worst['blocks']:.2%}")
    return 0


MARKER = range(123457, 123461)  # measure_training.py's step marker: an allocation of 123457 + step bytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--truth", type=Path, default=find_truth())
    ap.add_argument("--matrix", action="store_true", help="the gpu_matrix cells instead (no calibration data needed)")
    a = ap.parse_args()
    if a.matrix:
        return matrix()
    if a.truth is None:
        sys.exit("block_rounding.py: the H200 calibration data is not here (pass --truth DIR)")
    pickled = a.truth / f"allocator-trace-{CASE}-default.pickle"
    if not pickled.is_file():
        sys.exit(f"block_rounding.py: no such file: {pickled} (pass --truth DIR)")
    with pickled.open("rb") as fh:
        snap = pickle.load(fh)
    process, row = case(a.truth, CASE)
    blocks = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    end_requested, end_blocks = sum(b["requested_size"] for b in blocks), sum(b["size"] for b in blocks)

    sim = Simulator(AllocatorConfig())
    live: dict[int, int] = {}
    requested = 0
    marks: list[int] = []
    series: list[tuple[int, int]] = []  # (requested, blocks) after each event
    for e in snap["device_traces"][0]:
        act = e["action"]
        if act == "alloc":
            live[e["addr"]] = e["size"]
            requested += e["size"]
            sim.malloc(e["addr"], e["size"], 0)
            if e["size"] in MARKER:
                marks.append(len(series))
        elif act == "free_requested":
            requested -= live.pop(e["addr"])
            sim.free_requested(e["addr"])
        elif act == "free_completed":
            sim.free_completed(e["addr"])
        series.append((requested, sim.allocated_bytes))
    r_off, b_off = end_requested - series[-1][0], end_blocks - series[-1][1]

    rep = estimate(
        row["model"], measured_strategy(row), gpu="h200-sxm-141gb", allocator="", torch_version=process.torch_version
    )
    analytic = {ph: rep.phase(ph).total_bytes for ph in (Phase.BACKWARD, Phase.OPTIMIZER_STEP)}
    print(f"{CASE}, default allocator (MB = 10^6 B; the steps' peaks, requested and in blocks)")
    print(
        f"  end of a step: {end_requested:,} B requested, {end_blocks:,} B in blocks "
        f"(+{(end_blocks - end_requested) / 1e6:.1f} MB)"
    )
    for step, (lo, hi) in enumerate(zip(marks, [*marks[1:], len(series)], strict=True)):
        span = series[lo:hi]
        top = max(range(len(span)), key=lambda i: span[i][0])
        # the optimizer step: after the backward has freed what it made, back near the states and gradients
        after = next(i for i in range(top, len(span)) if span[i][0] < span[-1][0] + 2.2e9)
        bwd = (span[top][0] + r_off, max(b for _, b in span[:after]) + b_off)
        opt = (max(r for r, _ in span[after:]) + r_off, max(b for _, b in span[after:]) + b_off)
        measured = row["steps"][step]
        for name, (req, blk), phase in (
            ("backward", bwd, Phase.BACKWARD),
            ("optimizer-step", opt, Phase.OPTIMIZER_STEP),
        ):
            real = measured[phase.value]["max_allocated"]
            # the estimate is of a step with the optimizer's states made (steps 1-2), not of the first
            ours = f"analytic {analytic[phase] / real - 1:+.3%}" if step else ""
            print(
                f"  step {step} {name:<15} requested {req:>14,}  blocks {blk:>14,} (+{(blk - req) / 1e6:.1f} MB)  "
                f"measured {real:>14,} (blocks {blk / real - 1:+.3%})  {ours}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

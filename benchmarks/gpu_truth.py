"""Compare trainfit's estimates with real GPU measurements: per case and phase, the analytic allocated peak
against ``torch.cuda.max_memory_allocated``, and the reserved/nvidia-smi estimates against
``max_memory_reserved`` and the device's used memory.

    python benchmarks/gpu_truth.py ../shared/gpu-truth/h200-training.jsonl

The file holds lines from ``measure_training.py`` (a plain PyTorch loop, independent of trainfit): a ``meta``
line per run, then one line per case with ``model``, ``recipe``, ``optimizer_impl``, ``checkpointing``,
``attention``, ``batch``, ``seq``, ``phases`` (peak allocated per phase), ``max_reserved`` and
``device_used_end``. Prints a markdown table; ratios, not absolute timings.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from trainfit import Strategy, estimate
from trainfit.result import Phase


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", type=Path, help="a JSON-lines file of measured cases")
    args = ap.parse_args()
    allocator = "default"
    print("| case | allocator | phase | measured GiB | analytic GiB | analytic/measured − 1 |")
    print("|---|---|---|---:|---:|---:|")
    worst = 0.0
    reserved_rows = []
    for line in args.data.read_text().splitlines():
        row = json.loads(line)
        if "meta" in row:
            allocator = row.get("allocator", "default")
            continue
        s = Strategy(
            precision=row["recipe"],
            optimizer_impl=row["optimizer_impl"],
            checkpointing=row["checkpointing"],
            attention=row["attention"],
            micro_batch=row["batch"],
            seq_len=row["seq"],
        )
        conf = "" if allocator == "default" else allocator
        r = estimate(row["model"], s, gpu="h200-sxm-141gb", allocator=conf)
        for ph in Phase:
            measured = row["phases"][ph.value]
            ours = r.phase(ph).total_bytes
            rel = ours / measured - 1
            worst = max(worst, abs(rel))
            print(
                f"| {row['id']} | {allocator} | {ph.value} | {measured / 2**30:.2f} | {ours / 2**30:.2f} | {rel:+.2%} |"
            )
        reserved_rows.append(
            (
                row["id"],
                allocator,
                row["max_reserved"],
                r.reserved_estimate_bytes,
                row["device_used_end"],
                r.nvidia_smi_estimate_bytes,
            )
        )
    print(f"\nworst |analytic/measured − 1| over every phase: {worst:.2%}\n")
    print(
        "| case | allocator | max_memory_reserved GiB | reserved estimate GiB | error | device used GiB "
        "| nvidia-smi estimate GiB | error |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for case, alloc, res, res_est, used, est in reserved_rows:
        print(
            f"| {case} | {alloc} | {res / 2**30:.2f} | {res_est / 2**30:.2f} | {res_est / res - 1:+.1%} "
            f"| {used / 2**30:.2f} | {est / 2**30:.2f} | {est / used - 1:+.1%} |"
        )


if __name__ == "__main__":
    main()

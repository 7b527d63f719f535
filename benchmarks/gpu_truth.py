"""Compare trainfit's estimates with real GPU measurements: per case and phase, the analytic allocated peak
against ``torch.cuda.max_memory_allocated``, and the reserved/nvidia-smi estimates against
``max_memory_reserved`` and the device's used memory.

    python benchmarks/gpu_truth.py ../shared/gpu-truth/h200-training.jsonl [--trace]

The file holds lines from ``measure_training.py`` (a plain PyTorch loop, independent of trainfit): a ``meta``
line per run, then one line per case with ``model``, ``recipe``, ``optimizer_impl``, ``checkpointing``,
``attention``, ``batch``, ``seq``, ``phases`` (peak allocated per phase), ``max_reserved`` and
``device_used_end``. Prints markdown tables; ratios, not absolute timings. ``--trace`` adds the trace method's
reserved and nvidia-smi estimates (a fake-tensor trace per case: minutes).
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
    ap.add_argument("--trace", action="store_true", help="also run the trace method on every case")
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
        measured = (row["max_reserved"], row["device_used_end"])
        reserved_rows.append((row["id"], allocator, "analytic", *measured, r))
        if args.trace:
            t = estimate(row["model"], s, gpu="h200-sxm-141gb", allocator=conf, method="trace")
            reserved_rows.append((row["id"], allocator, "trace", *measured, t))
    print(f"\nworst |analytic/measured − 1| over every phase: {worst:.2%}\n")
    print(
        "| case | allocator | method | max_memory_reserved GiB | reserved estimate GiB | error | device used GiB "
        "| nvidia-smi estimate GiB | error |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for case, alloc, method, res, used, rep in reserved_rows:
        res_est, est = rep.reserved_estimate_bytes, rep.nvidia_smi_estimate_bytes
        print(
            f"| {case} | {alloc} | {method} | {res / 2**30:.2f} | {res_est / 2**30:.2f} | {res_est / res - 1:+.1%} "
            f"| {used / 2**30:.2f} | {est / 2**30:.2f} | {est / used - 1:+.1%} |"
        )


if __name__ == "__main__":
    main()

"""Reserved memory of a GPU session's one-GPU training cases, recomputed here from its committed output.

``benchmarks/gpu_session.py`` writes, for every case it runs alone in a fresh process, the measured
``max_memory_reserved``, and for two of them the allocator snapshot. This script needs no GPU: for each such case
of ``DIR/session.jsonl`` it prints the measured figure against

* ``estimate`` (analytic and, with ``--trace``, trace): a training job with no history before its first step;
* the same streams *as measured*: after the measuring child's warm-up matmul (the main thread's cuBLAS
  workspace) and with the model built by ``from_config`` on the GPU, a tied head's own weight made and freed
  before training (``trainfit.allocator.process.built_on_device``);

and replays every ``DIR/snapshot_*.pickle[.xz]`` through the allocator simulation (simulated against real
peak reserved, and how many blocks landed at their real address).

Usage: PYTHONPATH=src:benchmarks python benchmarks/session_reserved.py benchmarks/h200/2026-12-04 [--trace]
"""

from __future__ import annotations

import argparse
import json
import lzma
import pickle
import sys
from pathlib import Path
from typing import Any

import gpu_session as gs

from trainfit import estimate
from trainfit.allocator import replay_snapshot

GiB = 2**30


def _load_snapshot(path: Path) -> Any:
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rb") as fh:
        return pickle.load(fh)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="a GPU session's output folder (session.jsonl, snapshot_*.pickle[.xz])")
    ap.add_argument("--trace", action="store_true", help="also the trace method (a few seconds per case)")
    a = ap.parse_args()
    jsonl = a.dir / "session.jsonl"
    if not jsonl.is_file():
        print(f"session_reserved.py: no session.jsonl in {a.dir}", file=sys.stderr)
        return 2
    by_id = {c.id: c for c in gs.CASES}
    measured = [
        r
        for r in map(json.loads, jsonl.read_text().splitlines())
        if r.get("record") == "measured" and r.get("max_reserved") and r.get("case") in by_id
    ]
    methods = ("analytic", "trace") if a.trace else ("analytic",)
    print("| case | method | measured GiB | estimate GiB | error | as measured GiB | error |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for m in measured:
        case = by_id[m["case"]]
        if case.kind not in ("train", "lora", "tied") or case.preceded_by:
            continue
        spec, st = gs.case_spec(case, False), gs.strategy_of(case, False)
        real = m["max_reserved"]
        for method in methods:
            fresh = estimate(spec, st, method=method, gpu=gs.GPU, search_micro_batch=False, fixes=False)
            built = gs.as_measured(case, spec, st, method)["reserved_as_measured_bytes"]
            print(
                f"| {case.id} | {method} | {real / GiB:.3f} | {fresh.reserved_estimate_bytes / GiB:.3f} | "
                f"{fresh.reserved_estimate_bytes / real - 1:+.2%} | {built / GiB:.3f} | {built / real - 1:+.2%} |"
            )
    snaps = sorted(a.dir.glob("snapshot_*.pickle*"))
    if snaps:
        print("\n| snapshot | real peak reserved GiB | simulated GiB | error | blocks at their real address |")
        print("|---|---:|---:|---:|---:|")
    for path in snaps:
        r = replay_snapshot(_load_snapshot(path))
        sim = r.simulated.peak_reserved_bytes
        print(
            f"| {path.name} | {r.real_peak_reserved_bytes / GiB:.3f} | {sim / GiB:.3f} | "
            f"{r.peak_reserved_error:+.3%} | {r.address_matches} of {r.alloc_events} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Reserved memory from the allocator model against the H200 calibration data (shared/gpu-truth).

1. Replays the two real ``torch.cuda.memory._snapshot()`` traces of ``q05-amp-foreach-b4s2048`` (default
   allocator, expandable segments) and compares the simulated peak reserved with the real one.
2. With ``--trace``: traces the same case with trainfit (three layers, stitched to 24), adds the cuBLAS
   workspaces, replays the events and compares with ``max_reserved`` of ``h200-training.jsonl``;
   ``--all-cases`` does that for every case of the file (each allocator setting it was measured with).

3. With ``--phases CASE``: traces CASE at full depth for 3 steps and prints simulated against real reserved
   and allocated bytes at the end of every phase (where a gap first appears).

Usage: python benchmarks/allocator_replay.py [--trace [--all-cases]] [--phases CASE] [--truth DIR]
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from pathlib import Path
from typing import Any

from h200_data import Process, case, find_truth, measured_strategy, processes

from trainfit.allocator import AllocatorConfig, replay_snapshot

CASE = "q05-amp-foreach-b4s2048"
KINDS = ("default", "expandable")
GiB = 2**30


def _truth(arg: str | None) -> Path:
    found = find_truth(arg)
    if found is None:
        sys.exit("gpu-truth data not found (pass --truth DIR)")
    return found


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--all-cases", action="store_true")
    ap.add_argument("--phases", metavar="CASE")
    ap.add_argument("--truth")
    a = ap.parse_args()
    truth = _truth(a.truth)
    measured = {kind: case(truth, CASE, expandable=kind == "expandable")[1]["max_reserved"] for kind in KINDS}
    print(f"{'input':<28} {'allocator':<11} {'simulated':>12} {'real':>12} {'error':>8}")
    for kind in KINDS:
        with open(truth / f"allocator-trace-{CASE}-{kind}.pickle", "rb") as fh:
            snap = pickle.load(fh)
        for real_addr in (True, False):
            t = time.perf_counter()
            r = replay_snapshot(snap, real_addresses=real_addr)
            dt = time.perf_counter() - t
            sim, real = r.simulated.peak_reserved_bytes, measured[kind]
            what = "snapshot replay" + ("" if real_addr else " (own addrs)")
            print(
                f"{what:<28} {kind:<11} {sim / GiB:>10.3f} G {real / GiB:>10.3f} G {(sim - real) / real:>+8.3%}"
                f"   addresses {r.address_matches}/{r.alloc_events}, {dt:.2f} s"
            )
    if a.trace:
        for p in processes(truth):
            for row in p.cases:
                if a.all_cases or row["id"] == CASE:
                    _trace_case(row, p)
    if a.phases:
        _phases(*case(truth, a.phases))
    return 0


def _phases(process: Process, row: dict[str, Any]) -> None:
    from trainfit.allocator import Simulator
    from trainfit.arch import load_model
    from trainfit.trace import depth
    from trainfit.trace.events import tracker_events, with_workspaces

    spec = load_model(str(row["model"]))
    st = measured_strategy(row)
    plan = depth.plan_depth(spec, st, extrapolate=False)
    _, lay = plan.layouts[0]
    run = depth.run_layout(spec, st, plan, lay, steps=3, adamw_impl=str(row["optimizer_impl"])).run
    plain = tracker_events(run)
    events = with_workspaces(plain, run, (9, 0), torch_version=process.torch_version)
    tr = run.tracker
    kept = sorted({t for rec in tr.records if tr.component(rec) is not None for t in (rec.alloc_t, rec.free_t) if t})
    sim = Simulator(AllocatorConfig())
    pos = 0
    real_steps: list[dict[str, dict[str, int]]] = row["steps"]  # type: ignore[assignment]
    print(f"{'step':>4} {'phase':<15} {'reserved sim':>12} {'real':>9} {'allocated sim':>14} {'real':>9}  (GiB)")
    for sm in run.timeline.steps:
        pm = sm.passes[0]
        for phase, tick in (("forward", pm.fwd_end), ("backward", pm.bwd_end), ("optimizer-step", sm.opt_end)):
            target = sum(1 for t in kept if t <= tick) + (len(events) - len(plain))  # workspaces come first
            while pos < min(target, len(events)):
                sim.run((events[pos],))
                pos += 1
            real = real_steps[sm.step][phase]
            print(
                f"{sm.step:>4} {phase:<15} {sim.reserved_bytes / GiB:>12.3f} {real['reserved'] / GiB:>9.3f} "
                f"{sim.allocated_bytes / GiB:>14.3f} {real['allocated'] / GiB:>9.3f}"
            )


def _trace_case(row: dict[str, Any], process: Process) -> None:
    from trainfit.arch import load_model
    from trainfit.trace.events import reserved_from_trace

    spec = load_model(str(row["model"]))
    st = measured_strategy(row)
    kind = "expandable" if "expandable" in process.allocator else "default"
    t = time.perf_counter()
    tr = reserved_from_trace(
        spec,
        st,
        AllocatorConfig.parse(process.alloc_conf),
        compute_capability=(9, 0),
        torch_version=process.torch_version,  # the measurements' torch: up to 2.11 a cuBLASLt workspace of its own
    )
    dt = time.perf_counter() - t
    sim, real = tr.result.peak_reserved_bytes, int(str(row["max_reserved"]))
    alloc_sim, alloc_real = tr.result.peak_allocated_bytes, int(str(row["peak_allocated"]))
    print(
        f"{'trace ' + str(row['id']):<40} {kind:<11} {sim / GiB:>8.3f} G {real / GiB:>8.3f} G "
        f"{(sim - real) / real:>+8.3%}   ({sim:,} B; allocated {(alloc_sim - alloc_real) / alloc_real:+.2%}; "
        f"{tr.layers_traced}/{tr.layers_full} layers{' stitched' if tr.stitched else ''}, "
        f"{tr.events} events, {dt:.1f} s)",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())

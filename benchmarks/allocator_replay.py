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
import json
import pickle
import sys
import time
from pathlib import Path

from trainfit.allocator import AllocatorConfig, replay_snapshot
from trainfit.strategy import Strategy

CASE = "q05-amp-foreach-b4s2048"
GiB = 2**30


def _truth(arg: str | None) -> Path:
    repo = Path(__file__).resolve().parents[1]
    for d in ([Path(arg)] if arg else []) + [repo.parent / "shared" / "gpu-truth", Path("/work/shared/gpu-truth")]:
        if (d / "h200-training.jsonl").is_file():
            return d
    sys.exit("gpu-truth data not found (pass --truth DIR)")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--all-cases", action="store_true")
    ap.add_argument("--phases", metavar="CASE")
    ap.add_argument("--truth")
    a = ap.parse_args()
    truth = _truth(a.truth)
    measured = {}
    for line in (truth / "h200-training.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("id") == CASE:
            measured["expandable" if "expandable" in row.get("allocator", "") else "default"] = row["max_reserved"]
    print(f"{'input':<28} {'allocator':<11} {'simulated':>12} {'real':>12} {'error':>8}")
    for kind in ("default", "expandable"):
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
        rows = [json.loads(line) for line in (truth / "h200-training.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "id" in r and "max_reserved" in r and (a.all_cases or r["id"] == CASE)]
        for row in rows:
            _trace_case(row)
    if a.phases:
        rows = [json.loads(line) for line in (truth / "h200-training.jsonl").read_text().splitlines()]
        row = next(r for r in rows if r.get("id") == a.phases and r.get("allocator") == "default")
        _phases(row)
    return 0


def measured_strategy(row: dict[str, object]) -> Strategy:
    """The strategy of one case of ``h200-training.jsonl`` (also used by ``gpu_truth.py``)."""
    return Strategy(
        precision=str(row["recipe"]),
        optimizer_impl=str(row["optimizer_impl"]),
        checkpointing=str(row["checkpointing"]),
        attention=str(row["attention"]),
        micro_batch=int(str(row["batch"])),
        seq_len=int(str(row["seq"])),
    )


def _phases(row: dict[str, object]) -> None:
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
    events = with_workspaces(plain, run, (9, 0))
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


def _trace_case(row: dict[str, object]) -> None:
    from trainfit.arch import load_model
    from trainfit.trace.events import reserved_from_trace

    spec = load_model(str(row["model"]))
    st = measured_strategy(row)
    conf = str(row.get("allocator", ""))
    kind = "default" if conf in ("", "default") else "expandable"
    t = time.perf_counter()
    tr = reserved_from_trace(
        spec,
        st,
        AllocatorConfig.parse("" if kind == "default" else conf),
        compute_capability=(9, 0),
        torch_version=(2, 11),  # the measurements' torch (shared/gpu-truth): a cuBLASLt workspace of its own
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

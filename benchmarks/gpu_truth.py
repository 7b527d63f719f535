"""Compare trainfit's estimates with real GPU measurements: per case and phase, the analytic allocated peak
against ``torch.cuda.max_memory_allocated``, and the reserved/nvidia-smi estimates against
``max_memory_reserved`` and the device's used memory.

    python benchmarks/gpu_truth.py ../shared/gpu-truth/h200-training.jsonl [--trace]

The file holds lines from ``measure_training.py`` (a plain PyTorch loop, independent of trainfit): a ``meta``
line per run, then one line per case with ``model``, ``recipe``, ``optimizer_impl``, ``checkpointing``,
``attention``, ``batch``, ``seq``, ``phases`` (peak allocated per phase), ``max_reserved`` and
``device_used_end``. Prints markdown tables; ratios, not absolute timings. ``--trace`` adds the trace method's
reserved and nvidia-smi estimates (a fake-tensor trace per case: minutes).

The reserved figures come twice: ``fresh`` is what ``trainfit estimate`` reports (the run alone in a new process,
what a user's job is); ``in process`` simulates the measuring process as it ran
(:func:`trainfit.allocator.process.simulate_process`): the warm-up matmul, then the cases of each ``meta`` block
in the file's order, each one's tensors freed and ``empty_cache()`` called before the next, the cuBLAS workspaces
kept — so a later case starts with whatever segment a workspace pinned. ``data`` may be the folder holding
``h200-training.jsonl``.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

from allocator_replay import measured_strategy

from trainfit import estimate
from trainfit.allocator import AllocatorConfig, Event
from trainfit.allocator.process import built_on_device, matmul_warm_up, simulate_process
from trainfit.analytic.activations import effective_strategy
from trainfit.analytic.events import built_on_device_sizes, training_events
from trainfit.arch import load_model
from trainfit.estimate import gpu_workspaces
from trainfit.hardware import get_gpu
from trainfit.result import MemoryReport, Phase

GPU = "h200-sxm-141gb"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", type=Path, help="a JSON-lines file of measured cases (or the folder holding one)")
    ap.add_argument("--trace", action="store_true", help="also run the trace method on every case")
    args = ap.parse_args()
    data = args.data / "h200-training.jsonl" if args.data.is_dir() else args.data
    if not data.is_file():
        raise SystemExit(f"gpu_truth.py: no such file: {data}")
    workspaces = gpu_workspaces(get_gpu(GPU))
    print("| case | allocator | phase | measured GiB | analytic GiB | analytic/measured − 1 |")
    print("|---|---|---|---:|---:|---:|")
    worst = 0.0
    # per measuring process (a meta line): its allocator setting and its cases in order
    processes: list[tuple[str, list[dict[str, object]]]] = []
    for line in data.read_text().splitlines():
        row = json.loads(line)
        if "meta" in row:
            processes.append((row.get("allocator", "default"), []))
        elif "phases" in row:
            processes[-1][1].append(row)
    rows: list[tuple[str, str, str, int, int, MemoryReport, int]] = []
    for allocator, cases in processes:
        conf = "" if allocator == "default" else allocator
        streams: dict[str, list[list[Event]]] = {"analytic": [], "trace": []}
        reports: list[tuple[int, dict[str, object], str, MemoryReport]] = []
        for k, row in enumerate(cases):
            s = measured_strategy(row)
            r = estimate(row["model"], s, gpu=GPU, allocator=conf)
            for ph in Phase:
                measured = row["phases"][ph.value]
                ours = r.phase(ph).total_bytes
                rel = ours / measured - 1
                worst = max(worst, abs(rel))
                print(
                    f"| {row['id']} | {allocator} | {ph.value} | {measured / 2**30:.2f} | {ours / 2**30:.2f} "
                    f"| {rel:+.2%} |"
                )
            spec = load_model(row["model"])
            effective, _ = effective_strategy(spec, s)
            # measure_training.py builds each model with from_config on the GPU: a tied head's own weight is made
            # and freed before training (trainfit.allocator.process.built_on_device)
            n_weights, head_bytes = built_on_device_sizes(spec, effective)
            built = functools.partial(built_on_device, weights=n_weights, transient_bytes=head_bytes)
            streams["analytic"].append(built(training_events(spec, effective, workspaces)))
            reports.append((k, row, "analytic", r))
            if args.trace:
                from trainfit.trace.events import reserved_from_trace

                t = estimate(row["model"], s, gpu=GPU, allocator=conf, method="trace")
                reports.append((k, row, "trace", t))
                traced = reserved_from_trace(spec, effective, AllocatorConfig.parse(conf), compute_capability=(9, 0))
                streams["trace"].append(built(list(traced.stream)))
        in_process = {
            method: simulate_process(evs, AllocatorConfig.parse(conf), warm_up=matmul_warm_up(workspaces))
            for method, evs in streams.items()
            if evs
        }
        for k, row, method, rep in reports:
            run = in_process[method][k].peak_reserved_bytes
            rows.append((str(row["id"]), allocator, method, row["max_reserved"], row["device_used_end"], rep, run))
    print(f"\nworst |analytic/measured − 1| over every phase: {worst:.2%}\n")
    print(
        "| case | allocator | method | max_memory_reserved GiB | fresh estimate GiB | error | in process GiB | error "
        "| device used GiB | nvidia-smi estimate GiB (in process) | error |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for case, alloc, method, res, used, rep, run in rows:
        fresh = rep.reserved_estimate_bytes
        smi = rep.nvidia_smi_estimate_bytes - fresh + run
        print(
            f"| {case} | {alloc} | {method} | {res / 2**30:.2f} | {fresh / 2**30:.2f} | {fresh / res - 1:+.1%} "
            f"| {run / 2**30:.2f} | {run / res - 1:+.1%} | {used / 2**30:.2f} | {smi / 2**30:.2f} "
            f"| {smi / used - 1:+.1%} |"
        )


if __name__ == "__main__":
    main()

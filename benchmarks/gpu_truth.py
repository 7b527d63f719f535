"""Compare trainfit's estimates with real GPU measurements: per case and phase, the analytic allocated peak
against ``torch.cuda.max_memory_allocated``, and the reserved/nvidia-smi estimates against
``max_memory_reserved`` and the device's used memory.

    python benchmarks/gpu_truth.py ../shared/gpu-truth/h200-training.jsonl [--trace] [--phases [--write]]

The file holds lines from ``measure_training.py`` (a plain PyTorch loop, independent of trainfit): a ``meta`` line
per run, then one line per case with ``model``, ``recipe``, ``optimizer_impl``, ``checkpointing``, ``attention``,
``batch``, ``seq``, ``phases`` (peak allocated per phase), ``max_reserved`` and ``device_used_end``. Prints markdown
tables; ratios, not absolute timings. ``--trace`` adds the trace method (a fake-tensor trace per case: minutes).
``--phases``: only the allocated table, per case and phase, measured against the analytic method (and the trace's,
with ``--trace``); ``--write`` puts it between the ``gpu-truth-phases`` markers of docs/accuracy.md.

The reserved figures come twice: ``fresh`` is what ``trainfit estimate`` reports (the run alone in a new process,
what a user's job is); ``in process`` simulates the measuring process as it ran
(:func:`trainfit.allocator.process.simulate_process`): the warm-up matmul, then the cases of each ``meta`` block
in the file's order, each model built by ``from_config`` on the GPU (``trainfit.history.Build.ON_DEVICE``), its
tensors freed and ``empty_cache()`` called before the next, the cuBLAS workspaces kept — so a later case starts with
whatever segment a workspace pinned. Each case's stream is the library's (``trainfit.estimate.run_events``,
``built_events``), the one ``trainfit estimate --build on-device --warm-up --after ...`` replays; the whole process
is simulated once rather than each case after its predecessors. ``data`` may be the folder holding
``h200-training.jsonl``.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from h200_data import Process, measured_strategy, processes

from trainfit import estimate
from trainfit.allocator import AllocatorConfig, Event
from trainfit.allocator.process import matmul_warm_up, simulate_process
from trainfit.arch import load_model
from trainfit.estimate import built_events, gpu_workspaces, resolved_strategy, run_events
from trainfit.hardware import get_gpu
from trainfit.history import Build
from trainfit.result import MemoryReport, Method, Phase

GPU = "h200-sxm-141gb"
BEGIN, END = "<!-- gpu-truth-phases:begin -->", "<!-- gpu-truth-phases:end -->"


def phase_rows(procs: list[Process], trace: bool) -> list[str]:
    """The per-phase allocated table: each case × phase, measured, analytic and (``trace``) trace, with errors.
    The allocated phases are blocks (``max_memory_allocated``), which depend on the allocator setting (expandable
    segments split every remainder: no rounding above the requests), so each run of the file is a row of its own;
    both methods take the rounding from their simulated event streams (the trace's: ``simulate_allocator``)."""
    head = "| case | allocator | phase | measured GiB | analytic GiB | analytic | trace GiB | trace |"
    rows = [head, "|---|---|---|---:|---:|---:|---:|---:|"]
    traced: dict[tuple[str, str], MemoryReport] = {}
    for proc in procs:
        allocator, conf, torch = proc.allocator, proc.alloc_conf, proc.torch_version
        for row in proc.cases:
            s = measured_strategy(row)
            kw = {"gpu": GPU, "allocator": conf, "torch_version": torch}
            ra = estimate(str(row["model"]), s, search_micro_batch=False, **kw)  # type: ignore[arg-type]
            rt = None
            if trace:
                key = (str(row["id"]), conf)
                if key not in traced:
                    traced[key] = estimate(
                        str(row["model"]),
                        s,
                        method="trace",
                        search_micro_batch=False,
                        **kw,  # type: ignore[arg-type]
                    )
                rt = traced[key]
            phases = row["phases"]
            assert isinstance(phases, dict)
            for ph in Phase:
                measured = int(phases[ph.value])
                a = ra.phase(ph).total_bytes
                t = (
                    f"{rt.phase(ph).total_bytes / 2**30:.3f} | {rt.phase(ph).total_bytes / measured - 1:+.2%}"
                    if rt
                    else "— | —"
                )
                rows.append(
                    f"| {row['id']} | {allocator} | {ph.value} | {measured / 2**30:.3f} | {a / 2**30:.3f} "
                    f"| {a / measured - 1:+.2%} | {t} |"
                )
            print(rows[-3], rows[-2], rows[-1], sep="\n", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", type=Path, help="a JSON-lines file of measured cases (or the folder holding one)")
    ap.add_argument("--trace", action="store_true", help="also run the trace method on every case")
    ap.add_argument("--phases", action="store_true", help="only the per-phase allocated table")
    ap.add_argument("--write", action="store_true", help="with --phases: replace the table in docs/accuracy.md")
    args = ap.parse_args()
    data = args.data / "h200-training.jsonl" if args.data.is_dir() else args.data
    if not data.is_file():
        raise SystemExit(f"gpu_truth.py: no such file: {data}")
    if args.write and not args.phases:
        raise SystemExit("gpu_truth.py: --write writes the --phases table")
    procs = processes(data)
    if args.phases:
        table = phase_rows(procs, args.trace)
        if args.write:
            doc = Path(__file__).resolve().parents[1] / "docs" / "accuracy.md"
            new = BEGIN + "\n" + "\n".join(table) + "\n" + END
            text = doc.read_text()
            if BEGIN not in text:
                raise SystemExit(f"gpu_truth.py: no {BEGIN} marker in {doc}")
            doc.write_text(re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: new, text, flags=re.S))
        return
    gpu = get_gpu(GPU)
    print("| case | allocator | phase | measured GiB | analytic GiB | analytic/measured − 1 |")
    print("|---|---|---|---:|---:|---:|")
    worst = 0.0
    rows: list[tuple[str, str, str, int, int, MemoryReport, int]] = []
    for proc in procs:
        allocator, conf, torch, cases = proc.allocator, proc.alloc_conf, proc.torch_version, proc.cases
        config = AllocatorConfig.parse(conf)
        workspaces = gpu_workspaces(gpu, torch)
        streams: dict[str, list[list[Event]]] = {"analytic": [], "trace": []}
        reports: list[tuple[int, dict[str, object], str, MemoryReport]] = []
        for k, row in enumerate(cases):
            s = measured_strategy(row)
            r = estimate(str(row["model"]), s, gpu=GPU, allocator=conf, torch_version=torch)
            phases = row["phases"]
            assert isinstance(phases, dict)
            for ph in Phase:
                measured = int(phases[ph.value])
                ours = r.phase(ph).total_bytes
                rel = ours / measured - 1
                worst = max(worst, abs(rel))
                print(
                    f"| {row['id']} | {allocator} | {ph.value} | {measured / 2**30:.2f} | {ours / 2**30:.2f} "
                    f"| {rel:+.2%} |"
                )
            spec = load_model(str(row["model"]))
            effective, _, _ = resolved_strategy(spec, s, gpu)
            methods = (Method.ANALYTIC, Method.TRACE) if args.trace else (Method.ANALYTIC,)
            for method in methods:
                if method is Method.TRACE:
                    t = estimate(spec, s, gpu=GPU, allocator=conf, method="trace", torch_version=torch)
                    reports.append((k, row, "trace", t))
                else:
                    reports.append((k, row, "analytic", r))
                # measure_training.py builds each model with from_config on the GPU (trainfit.history.Build)
                own = run_events(spec, effective, method, gpu, config, torch)
                streams[method.value].append(built_events(spec, effective, Build.ON_DEVICE, own))
        in_process = {
            method: simulate_process(evs, config, warm_up=matmul_warm_up(workspaces))
            for method, evs in streams.items()
            if evs
        }
        for k, row, method, rep in reports:
            run = in_process[method][k].peak_reserved_bytes
            rows.append(
                (
                    str(row["id"]),
                    allocator,
                    method,
                    int(str(row["max_reserved"])),
                    int(str(row["device_used_end"])),
                    rep,
                    run,
                )
            )
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

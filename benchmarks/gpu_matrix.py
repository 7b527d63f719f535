"""The GPU matrix of the trace-engine issue: measured vs trace vs analytic, one prepared run.

On a CUDA machine (the device tool's H200 has torch and transformers; nothing to install):

    PYTHONUNBUFFERED=1 PYTHONPATH=src python3 benchmarks/gpu_matrix.py --out "$OUT"

The analytic and trace columns are ``estimate_analytic`` / ``trace_spec`` without a GPU, so without the cuBLAS
workspaces the measured peaks include (65 MiB on sm90): about −0.07 GiB on every cell (2026-12-04, H200).

Here, to check the plumbing without a GPU (trace + analytic only, the measure column left empty):

    python benchmarks/gpu_matrix.py --dry-run --limit 2 --out /tmp/gpu-matrix

For every cell (4 models × amp-bf16/pure-bf16 × checkpointing none/full) it records the peak allocated
bytes per phase measured with ``torch.cuda.max_memory_allocated`` at full depth (``--method measure``), the
depth-extrapolated trace and the analytic estimate, and the measured ``max_memory_reserved`` — so the
allocator-reserve constant can be calibrated — plus, once, the memory the CUDA context takes outside
PyTorch's allocator (``mem_get_info`` against ``memory_reserved``). Results go to ``results.jsonl`` (one
line per cell, written as soon as the cell is done, so a run cut short keeps what it measured) and
``results.md`` (the table for docs/accuracy.md). A failing cell is recorded with its error and the run
goes on.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from trainfit.analytic import estimate_analytic
from trainfit.arch import load_model
from trainfit.hardware import get_gpu
from trainfit.overhead import context_bytes
from trainfit.result import MemoryReport
from trainfit.strategy import Strategy
from trainfit.trace import trace_spec

MODELS = ("qwen2.5-0.5b", "llama-3.2-1b", "gpt2", "bert-base-uncased")
RECIPES = ("amp-bf16", "pure-bf16")
CHECKPOINTING = ("none", "full")


def shape(model: str) -> tuple[int, int]:
    """BERT 8 × 512 and GPT-2 4 × 1024 (their position tables end there: 2048 tokens made GPT-2's embedding index
    past its 1024 rows, a device-side assert that then failed every later cell in the process), the rest 2 × 2048."""
    if model.startswith("bert"):
        return 8, 512
    return (4, 1024) if model == "gpt2" else (2, 2048)


def by_phase(r: MemoryReport) -> dict[str, int]:
    return {p.phase.value: p.total_bytes for p in r.phases}


def cuda_context_bytes() -> dict[str, Any] | None:
    """Device memory in use that PyTorch's allocator does not hold: the CUDA context, cuBLAS handles..."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    x = torch.ones(1, device="cuda") @ torch.ones(1, 1, device="cuda")  # create the cuBLAS handle too
    del x
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    reserved = torch.cuda.memory_reserved()
    return {
        "total": total,
        "used": total - free,
        "reserved": reserved,
        "outside_allocator": total - free - reserved,
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version() or 0,  # type: ignore[no-untyped-call]
    }


def run_cell(model: str, rec: str, ck: str, *, dry_run: bool) -> dict[str, Any]:
    b, s = (1, 64) if dry_run else shape(model)
    spec = load_model(model)
    st = Strategy(precision=rec, checkpointing=ck, micro_batch=b, seq_len=s)
    row: dict[str, Any] = {"model": model, "precision": rec, "checkpointing": ck, "batch": b, "seq": s}
    row["optimizer_impl"] = st.optimizer_impl.value  # the HF Trainer default (fused) since issue 15 #15
    t0 = time.perf_counter()
    an = estimate_analytic(spec, st)
    row["analytic"] = by_phase(an)
    tr = trace_spec(spec, st)
    row["trace"] = by_phase(tr)
    row["trace_seconds"] = round(time.perf_counter() - t0, 1)
    if not dry_run:
        from trainfit.measure import measure_spec

        t1 = time.perf_counter()
        me = measure_spec(spec, st, extrapolate=False, with_trace=False)
        row["measured"] = by_phase(me)
        row["measured_reserved"] = me.extra.get("max_memory_reserved", {})
        row["device"] = me.extra.get("device")
        row["measure_seconds"] = round(time.perf_counter() - t1, 1)
        if me.warnings:  # e.g. memory left allocated between measured runs
            row["measure_warnings"] = list(me.warnings)
    return row


def pct(a: int, b: int) -> str:
    return f"{(a - b) / b * 100:+.1f}%" if b else "—"


def table(rows: list[dict[str, Any]], context: dict[str, Any] | None) -> str:
    gib = 2**30
    out = [
        "| model | recipe | ckpt | b×s | measured GiB | trace GiB | analytic GiB | trace vs measured "
        "| analytic vs measured | reserved / allocated |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['precision']} | {r['checkpointing']} | | error: {r['error']} | | | | | |")
            continue
        tp, ap = max(r["trace"].values()), max(r["analytic"].values())
        cell = f"| {r['model']} | {r['precision']} | {r['checkpointing']} | {r['batch']}×{r['seq']} "
        m = r.get("measured")
        if not m:
            out.append(cell + f"| — | {tp / gib:.2f} | {ap / gib:.2f} | — | — | — |")
            continue
        mp = max(m.values())
        res = max(r.get("measured_reserved", {}).values(), default=0)
        nums = f"| {mp / gib:.2f} | {tp / gib:.2f} | {ap / gib:.2f} | {pct(tp, mp)} | {pct(ap, mp)} "
        out.append(cell + nums + f"| {res / mp:.3f} |")
    if context:
        out += [
            "",
            f"Outside PyTorch's allocator after CUDA and cuBLAS initialisation: "
            f"{context['outside_allocator'] / 2**20:.0f} MiB (trainfit's H200 context: "
            f"{context_bytes(get_gpu('h200-sxm-141gb'))[0] / 2**20:.0f} MiB).",
        ]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for results.jsonl and results.md")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: trace + analytic on 1×64 tokens")
    ap.add_argument("--limit", type=int, default=0, help="run only the first N cells")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    context = None if args.dry_run else cuda_context_bytes()
    if not args.dry_run and context is None:
        print("no CUDA device: run with --dry-run to check the plumbing", file=sys.stderr)
        return 2
    cells = list(itertools.product(MODELS, RECIPES, CHECKPOINTING))
    if args.limit:
        cells = cells[: args.limit]
    rows: list[dict[str, Any]] = []
    jsonl = args.out / "results.jsonl"
    with jsonl.open("w") as fh:
        if context:
            fh.write(json.dumps({"cuda_context": context}) + "\n")
        for i, (model, rec, ck) in enumerate(cells, start=1):
            try:
                row = run_cell(model, rec, ck, dry_run=args.dry_run)
            except Exception as exc:  # one broken cell must not lose the others
                row = {"model": model, "precision": rec, "checkpointing": ck, "error": f"{type(exc).__name__}: {exc}"}
                traceback.print_exc()
            rows.append(row)
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            peaks = {k: max(v.values()) for k in ("measured", "trace", "analytic") if isinstance(v := row.get(k), dict)}
            print(f"[{i}/{len(cells)}] {model} {rec} {ck}: {peaks or row.get('error')}", flush=True)
    (args.out / "results.md").write_text(table(rows, context))
    print(table(rows, context))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Seconds for `trainfit estimate llama-3.1-70b --gpus W --sharding fsdp --checkpointing full --method trace`,
W = 8 and 64, each in a fresh process (issue 10: "the trace of a 70B model at W = 64 takes under 60 s"); with
``--zero3``, `trainfit estimate llama-3.2-1b --gpus W --sharding zero3 --method trace --batch 1 --seq 512`,
W = 2, 8 and 64 (issue 10: "the per-step trace cost must not grow with the world size"); with ``--zero3-70b``,
`trainfit estimate llama-3.1-70b --gpus 64 --sharding zero3 --checkpointing full --method trace` (the 60 s bound for
DeepSpeed's engine).

A new interpreter per run, so the wall figure is what a user waits for: importing torch and transformers, the
fake-tensor steps of one rank on the fake process group, the depth extrapolation and the report. The "trace s" column
is the report's own ``extra.trace_seconds`` (the trace alone, without the imports and the report); "CPU s" the child's
user + system time (less sensitive than wall time to other jobs on a shared machine). The trace's
per-step cost should not depend on W (one rank is traced; shards are 1/W of each tensor). Not a test.
Usage: python benchmarks/trace_speed_distributed.py [--zero3 | --zero3-70b] [W ...]
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

CODE = "import sys; from trainfit.cli.app import main; sys.argv = ['trainfit', 'estimate', *sys.argv[1:]]; main()"
SETUPS = {
    "fsdp": ("llama-3.1-70b", (8, 64), ["--sharding", "fsdp", "--checkpointing", "full"]),
    "zero3": ("llama-3.2-1b", (2, 8, 64), ["--sharding", "zero3", "--batch", "1", "--seq", "512"]),
    "zero3-70b": ("llama-3.1-70b", (64,), ["--sharding", "zero3", "--checkpointing", "full"]),
}


def main() -> None:
    argv = sys.argv[1:]
    setup = next((a[2:] for a in argv if a in ("--zero3", "--zero3-70b")), "fsdp")
    model, default_worlds, flags = SETUPS[setup]
    worlds = [int(w) for w in argv if not w.startswith("--")] or list(default_worlds)
    print(f"{os.cpu_count()} CPU cores; trainfit estimate {model} {' '.join(flags)} --method trace --gpus W")
    print("| model | W | wall s (fresh process) | CPU s | trace s | peak GiB |")
    print("|---|---:|---:|---:|---:|---|")
    for w in worlds:
        args = [model, "--gpus", str(w), *flags, "--method", "trace", "--json"]
        t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        out = subprocess.run([sys.executable, "-c", CODE, *args], capture_output=True, text=True, check=True)
        wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
        r = json.loads(out.stdout)
        trace_s = r.get("extra", {}).get("trace_seconds", float("nan"))
        print(f"| {model} | {w} | {wall:.1f} | {cpu:.1f} | {trace_s:.1f} | {r['peak_bytes'] / 2**30:.2f} |", flush=True)


if __name__ == "__main__":
    main()

"""Seconds for `trainfit estimate llama-3.1-70b --gpus W --sharding fsdp --checkpointing full --method trace`,
W = 8 and 64, each in a fresh process (issue 10: "the trace of a 70B model at W = 64 takes under 60 s").

A new interpreter per run, so the figure is what a user waits for: importing torch and transformers, the
two fake-tensor steps of one rank on the fake process group, the depth extrapolation and the report. The
trace's per-step cost should not depend on W (one rank is traced; shards are 1/W of each tensor). Not a test.
Usage: python benchmarks/trace_speed_distributed.py [W ...]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

MODEL = "llama-3.1-70b"
WORLDS = (8, 64)
CODE = "import sys; from trainfit.cli.app import main; sys.argv = ['trainfit', 'estimate', *sys.argv[1:]]; main()"


def main() -> None:
    worlds = [int(w) for w in sys.argv[1:]] or list(WORLDS)
    print(f"{os.cpu_count()} CPU cores")
    print("| model | W | wall s (fresh process) | peak GiB |")
    print("|---|---:|---:|---|")
    for w in worlds:
        args = [MODEL, "--gpus", str(w), "--sharding", "fsdp", "--checkpointing", "full", "--method", "trace", "--json"]
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", CODE, *args], capture_output=True, text=True, check=True)
        wall = time.perf_counter() - t0
        r = json.loads(out.stdout)
        print(f"| {MODEL} | {w} | {wall:.1f} | {r['peak_bytes'] / 2**30:.2f} |")


if __name__ == "__main__":
    main()

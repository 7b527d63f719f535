"""Seconds for `trainfit estimate MODEL --method trace` (b=1, s=4096, amp-bf16), each in a fresh process.

Each run is a new interpreter, so the figure includes importing torch and transformers (several seconds
on a 2-core machine) — what a user waits for. Target: under 30 s per model. Not a test.
Usage: python benchmarks/trace_speed.py [model ...]
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

MODELS = ("qwen2.5-0.5b", "llama-3.1-70b", "llama-3.1-405b")
CODE = """
import json, sys, time
t0 = time.perf_counter()
from trainfit.arch import load_model
from trainfit.strategy import Strategy
from trainfit.trace import trace_spec
r = trace_spec(load_model(sys.argv[1]), Strategy(precision="amp-bf16", micro_batch=1, seq_len=4096))
print(json.dumps({"peak": r.peak_bytes, "phase": r.peak_phase.value, "layers": r.extra["layers_traced"],
                  "in_process": round(time.perf_counter() - t0, 2), "trace": r.extra["trace_seconds"]}))
"""


def main() -> None:
    models = sys.argv[1:] or list(MODELS)
    print("| model | wall s (fresh process) | of which trace s | layers traced | peak GiB (phase) |")
    print("|---|---:|---:|---|---|")
    for m in models:
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", CODE, m], capture_output=True, text=True, check=True)
        wall = time.perf_counter() - t0
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {m} | {wall:.1f} | {r['trace']:.1f} | {r['layers']} | {r['peak'] / 2**30:.2f} ({r['phase']}) |")


if __name__ == "__main__":
    main()

"""Time ``trainfit infer`` (analytic, with the capacity searches and a paged server) against
``python -c "import torch"``. The target: under half the time of importing torch.

Prints seconds (median of N runs) and the ratios. Not a test: the machines are shared and noisy.
Usage: PYTHONPATH=src python benchmarks/infer_speed.py [runs]
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

INFER = [sys.executable, "-m", "trainfit.cli.app", "infer"]
CASES = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "infer qwen2.5-72b --gpus 4 --gpu h100 --max-batch --json": [
        *INFER,
        "qwen2.5-72b",
        "--gpus",
        "4",
        "--tp",
        "4",
        "--gpu",
        "h100-sxm-80gb",
        "--max-batch",
        "--json",
    ],
    "infer llama-3.1-70b --server paged --gpu h200 --json": [
        *INFER,
        "llama-3.1-70b",
        "--server",
        "paged",
        "--gpus",
        "2",
        "--gpu",
        "h200-sxm-141gb",
        "--json",
    ],
    "infer deepseek-v3 --kv-dtype fp8 --gpus 8 --gpu h200 --json": [
        *INFER,
        "deepseek-v3",
        "--kv-dtype",
        "fp8",
        "--prompt",
        "8192",
        "--gpus",
        "8",
        "--gpu",
        "h200-sxm-141gb",
        "--json",
    ],
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
}


def median_seconds(cmd: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    res = {name: median_seconds(cmd, runs) for name, cmd in CASES.items()}
    for name, s in res.items():
        print(f"{name:62s} {s:7.3f} s")
    torch_s = res["python -c 'import torch'"]
    for name, s in res.items():
        if name.startswith("infer"):
            print(f"{name:62s} / import torch = {s / torch_s:.2f}")


if __name__ == "__main__":
    main()

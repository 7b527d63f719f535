"""Time `trainfit estimate` (analytic, with a GPU fit search) against `python -c "import torch"`.

Prints seconds (median of N runs) and the ratio. Not a test: the machines are shared and noisy.
Usage: python benchmarks/estimate_speed.py [runs]
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time


def median_seconds(cmd: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    est = [
        sys.executable,
        "-m",
        "trainfit.cli.app",
        "estimate",
        "llama-3.1-70b",
        "--gpu",
        "h100-sxm-80gb",
        "--batch",
        "4",
        "--seq",
        "4096",
        "--json",
    ]
    cases = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "trainfit estimate llama-3.1-70b --gpu h100 --json": est,
        "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    }
    res = {name: median_seconds(cmd, runs) for name, cmd in cases.items()}
    for name, s in res.items():
        print(f"{name:55s} {s:7.3f} s")
    ratio = res["trainfit estimate llama-3.1-70b --gpu h100 --json"] / res["python -c 'import torch'"]
    print(f"estimate / import torch = {ratio:.2f}")


if __name__ == "__main__":
    main()

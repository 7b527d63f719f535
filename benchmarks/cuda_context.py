"""Measure the CUDA context the way the GPU catalog's ``cuda_context`` entries record it, with lazy and with eager
module loading, so that the figures docs/accuracy.md ("The CUDA context") could not find publicly get measured.

On a GPU machine with torch (nothing else; no trainfit import):

    python3 benchmarks/cuda_context.py > context.json

Each loading mode runs in a fresh child process (``CUDA_MODULE_LOADING`` is read when CUDA starts): CUDA and cuBLAS
initialisation (one 256 × 256 matmul, as ``benchmarks/gpu_session.py`` does), then ``mem_get_info`` used −
``memory_reserved``. The output is one JSON object: the GPU (name, SMs, compute capability), the software (torch,
CUDA, driver), ``lazy_bytes`` (what the catalog's ``cuda_context`` takes, with the software fields) and
``eager_bytes``; ``eager_bytes − lazy_bytes`` on the same GPU and torch is the figure ``trainfit.overhead`` has
only as PyTorch's #86509 lower bound. Run it once per torch/CUDA wheel (cu126, cu128, cu130) to separate the CUDA
majors. Other processes on the GPU count in ``used``: run it on an idle device. Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

_CHILD = """
import json, torch
x = torch.ones(256, 256, device="cuda") @ torch.ones(256, 256, device="cuda")
del x
torch.cuda.synchronize()
free, total = torch.cuda.mem_get_info()
p = torch.cuda.get_device_properties(0)
print(json.dumps({
    "gpu": p.name, "sm_count": p.multi_processor_count, "compute_capability": f"{p.major}.{p.minor}",
    "torch": torch.__version__, "cuda": torch.version.cuda,
    "used_bytes": total - free, "reserved_bytes": torch.cuda.memory_reserved(),
}))
"""


def _child(loading: str) -> dict[str, object]:
    env = {**os.environ, "CUDA_MODULE_LOADING": loading}
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    lazy, eager = _child("LAZY"), _child("EAGER")
    keys = ("gpu", "sm_count", "compute_capability", "torch", "cuda")
    result = {k: lazy[k] for k in keys}
    result["driver"] = _driver()
    result["lazy_bytes"] = int(str(lazy["used_bytes"])) - int(str(lazy["reserved_bytes"]))
    result["eager_bytes"] = int(str(eager["used_bytes"])) - int(str(eager["reserved_bytes"]))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

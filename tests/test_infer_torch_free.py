"""``trainfit infer`` (analytic, capacity searches and paged servers included) never imports torch,
transformers or huggingface_hub, like ``estimate --method analytic`` (tests/test_torch_free.py)."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
from trainfit import infer
from trainfit.cli.app import main
infer("llama-3.1-8b", batch=4, prompt=1024, gpu="a100-sxm-80gb")
for argv in (["infer", "qwen2.5-72b", "--gpus", "4", "--gpu", "h100-sxm-80gb", "--max-batch", "--json"],
             ["infer", "llama-3.1-8b", "--server", "paged", "--gpu", "h200-sxm-141gb"]):
    try:
        main(argv)
    except SystemExit as e:
        assert e.code in (0, None), e.code
heavy = [m for m in ("torch", "transformers", "huggingface_hub") if m in sys.modules]
print("HEAVY:" + ",".join(heavy))
"""


def test_infer_does_not_import_heavy_modules() -> None:
    res = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "HEAVY:"

"""`import trainfit`, the analytic / rule-of-thumb estimate (one GPU or many, fine-tuning included) and
``trainfit infer`` (capacity searches and paged servers included) never import torch, transformers or
huggingface_hub (they must be usable, and fast, on a laptop without them)."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
import trainfit, trainfit.cli.app
from trainfit import infer
from trainfit.cli.app import main
infer("llama-3.1-8b", batch=4, prompt=1024, gpu="a100-sxm-80gb")
for argv in (["estimate", "llama-3.1-8b", "--gpu", "a100-sxm-80gb", "--json"],
             ["estimate", "--params", "7e9", "--hidden-size", "4096", "--num-layers", "32",
              "--method", "rule-of-thumb"],
             ["estimate", "llama-3.1-8b", "--gpus", "8", "--sharding", "fsdp", "--gpu", "h100-sxm-80gb"],
             ["estimate", "llama-3.1-8b", "--finetune", "qlora", "--gpu", "rtx-4090", "--segments"],
             ["infer", "qwen2.5-72b", "--gpus", "4", "--gpu", "h100-sxm-80gb", "--max-batch", "--json"],
             ["infer", "llama-3.1-8b", "--server", "paged", "--gpu", "h200-sxm-141gb"],
             ["plan", "qwen2.5-0.5b", "--gpu", "rtx-4090", "--seq", "1024", "--global-batch", "8", "--json"],
             ["models"], ["gpus"]):
    try:
        main(argv)
    except SystemExit as e:
        assert e.code in (0, None), e.code
heavy = [m for m in ("torch", "transformers", "huggingface_hub") if m in sys.modules]
print("HEAVY:" + ",".join(heavy))
"""


def test_core_does_not_import_heavy_modules() -> None:
    res = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "HEAVY:"

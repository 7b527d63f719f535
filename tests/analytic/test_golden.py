"""Golden JSON for a few model × recipe × shape cases. A change in any number fails here; when the
change is intended, regenerate on purpose with ``TRAINFIT_UPDATE_GOLDENS=1 pytest tests/analytic/test_golden.py``
and explain the difference in the commit message."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from trainfit.arch import load_model
from trainfit.estimate import estimate
from trainfit.report.json import report_json
from trainfit.strategy import Strategy

GOLDEN = Path(__file__).parents[1] / "golden"
CASES = {
    "llama-3.1-8b_amp-bf16_b4_s2048_a100": (
        "llama-3.1-8b",
        dict(precision="amp-bf16", micro_batch=4, seq_len=2048),
        "a100-sxm-80gb",
    ),
    "qwen2.5-7b_pure-bf16_full_b2_s4096": (
        "qwen2.5-7b",
        dict(precision="pure-bf16", checkpointing="full", micro_batch=2, seq_len=4096),
        "h100-sxm-80gb",
    ),
    "gpt2_fp32_b8_s1024": ("gpt2", dict(precision="fp32", micro_batch=8, seq_len=1024), "rtx-4090"),
    "bert-base_amp-fp16_b32_s512": (
        "bert-base-uncased",
        dict(precision="amp-fp16", micro_batch=32, seq_len=512),
        "t4",
    ),
    "mixtral_master-bf16_sqrt_8bit": (
        "mixtral-8x7b-v0.1",
        dict(precision="master-bf16", checkpointing="sqrt", optimizer="adamw-8bit", micro_batch=1, seq_len=4096),
        None,
    ),
    "gemma-2b_amp-bf16_eager_adafactor": (
        "gemma-2b",
        dict(precision="amp-bf16", attention="eager", optimizer="adafactor", micro_batch=2, seq_len=1024),
        "l4",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case: str) -> None:
    slug, kw, gpu = CASES[case]
    spec = load_model(slug)
    strategy = Strategy(**kw)  # type: ignore[arg-type]
    got = report_json(estimate(spec, strategy, gpu=gpu), spec, strategy)
    path = GOLDEN / f"{case}.json"
    if os.environ.get("TRAINFIT_UPDATE_GOLDENS") == "1":
        path.write_text(json.dumps(got, indent=2, sort_keys=True) + "\n")
    assert path.exists(), f"missing golden {path.name}; generate with TRAINFIT_UPDATE_GOLDENS=1"
    assert got == json.loads(path.read_text())

"""``trainfit precision``: catalog lookup (torch-free), detection on this machine, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.cli._cli_helper import run_cli


def test_v100_gets_fp16_with_loss_scaling(capsys):
    res = run_cli(capsys, "precision", "--gpu", "v100-sxm2-32gb", "--json")
    assert res.code == 0, res.err
    data = json.loads(res.out)
    assert data["schema_version"] == 1
    rec = data["recommendation"]
    assert rec["precision"] == "amp-fp16" and rec["loss_scaling"] is True
    assert rec["accelerator"]["native_bf16"] is False
    assert rec["accelerator"]["compute_capability"] == "7.0"


def test_h100_gets_bf16_and_fp8_note(capsys):
    res = run_cli(capsys, "precision", "--gpu", "h100-sxm-80gb", "--json")
    rec = json.loads(res.out)["recommendation"]
    assert rec["precision"] == "amp-bf16" and rec["loss_scaling"] is False
    assert any("FP8" in n for n in rec["notes"])


def test_human_output_gives_reasons(capsys):
    res = run_cli(capsys, "precision", "--gpu", "t4")
    assert res.code == 0
    assert "amp-fp16" in res.out and "GradScaler" in res.out and "unscale_" in res.out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this test describes a CPU-only machine")
def test_detects_cpu_only_machine(capsys):
    res = run_cli(capsys, "precision", "--json")
    rec = json.loads(res.out)["recommendation"]
    assert rec["accelerator"]["kind"] == "cpu" and rec["precision"] == "fp32"


def test_unknown_gpu_is_one_line_exit_2(capsys):
    res = run_cli(capsys, "precision", "--gpu", "v1000")
    assert res.code == 2
    assert res.err.startswith("error: unknown GPU 'v1000'")
    assert len(res.err.strip().splitlines()) == 1 and "Traceback" not in res.err


def test_precision_with_gpu_does_not_import_torch():
    root = Path(__file__).resolve().parents[2]
    code = (
        f"import sys; sys.path.insert(0, {str(root)!r}); from tests.cli._cli_helper import _load_main\n"
        "main = _load_main()\n"
        "try:\n    main(['precision', '--gpu', 'a100-sxm-80gb', '--json'])\nexcept SystemExit:\n    pass\n"
        "print('TORCH', 'torch' in sys.modules, file=sys.stderr)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "TORCH False" in out.stderr

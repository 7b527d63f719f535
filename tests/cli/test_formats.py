"""``trainfit formats``: table and JSON, checked against torch.finfo (an independent source)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from tests.cli._cli_helper import run_cli


def test_json_matches_torch_finfo(capsys):
    res = run_cli(capsys, "formats", "--json")
    assert res.code == 0, res.err
    data = json.loads(res.out)
    assert data["schema_version"] == 1
    by_id = {f["id"]: f for f in data["formats"]}
    assert set(by_id) >= {"fp32", "tf32", "fp16", "bf16", "fp8-e4m3", "fp8-e5m2"}
    for fid, dtype in [("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32),
                       ("fp8-e4m3", torch.float8_e4m3fn), ("fp8-e5m2", torch.float8_e5m2)]:  # fmt: skip
        fi = torch.finfo(dtype)
        assert by_id[fid]["max_finite"] == fi.max
        assert by_id[fid]["min_normal"] == fi.smallest_normal
        assert by_id[fid]["epsilon"] == fi.eps
    assert data["integer_formats"][0]["max_value"] == torch.iinfo(torch.int8).max
    facts = {f["id"]: f for f in data["edge_facts"]}
    assert facts["fp16-overflow-threshold"]["result"] == 65520
    assert facts["fp16-adam-eps"]["result"] == 0
    assert facts["bf16-256-plus-1"]["result"] == 256
    assert facts["fp8-e4m3-no-inf"]["result"] == "nan"  # NaN is a string in JSON, not invalid 'NaN'
    assert "inference" in data["int8_vs_bf16"]


def test_table_shows_formats_and_edge_facts(capsys):
    res = run_cli(capsys, "formats")
    assert res.code == 0
    for needle in ("fp16", "bf16", "fp8-e4m3", "int8", "65504", "65520", "int8 vs bf16"):
        assert needle in res.out


def test_formats_command_does_not_import_torch():
    root = Path(__file__).resolve().parents[2]
    code = (
        f"import sys; sys.path.insert(0, {str(root)!r}); from tests.cli._cli_helper import _load_main\n"
        "main = _load_main()\n"
        "try:\n    main(['formats', '--json'])\nexcept SystemExit:\n    pass\n"
        "print('TORCH', 'torch' in sys.modules, file=sys.stderr)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "TORCH False" in out.stderr

"""``trainfit doctor``: JSON findings for the demo and a user factory; one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.cli._cli_helper import run_cli

CASES = Path(__file__).resolve().parents[1] / "doctor" / "cases.py"


def test_demo_json_names_the_overflowing_module(capsys):
    res = run_cli(capsys, "doctor", "--demo", "--steps", "12", "--json")
    assert res.code == 0, res.err
    data = json.loads(res.out)
    assert data["schema_version"] == 1 and data["cause"] == "precision"
    overflow = [f for f in data["findings"] if f["kind"] == "overflow"]
    assert overflow and {f["module"] for f in overflow} == {"amplify"}
    assert data["nonfinite"]["forward"]["module"] == "amplify"
    assert len(data["loss_scale_history"]) == 12


def test_user_factory_with_nan_batch(capsys):
    res = run_cli(capsys, "doctor", f"{CASES}:nan_batch", "--precision", "amp-fp16", "--steps", "16", "--json")
    assert res.code == 0, res.err
    data = json.loads(res.out)
    assert data["cause"] == "data"
    assert [f["batch"] for f in data["findings"] if f["kind"] == "data"] == [5]


def test_human_output(capsys):
    res = run_cli(capsys, "doctor", f"{CASES}:healthy", "--precision", "amp-bf16", "--steps", "10")
    assert res.code == 0, res.err
    assert "Diagnosis" in res.out and "Healthy" in res.out


def test_bad_inputs_are_one_line_errors(capsys):
    for args, needle in [
        (["doctor", f"{CASES}:raises"], "raised RuntimeError"),
        (["doctor", "nowhere.py:setup"], "no such file"),
        (["doctor"], "--demo"),
        (["doctor", "--demo", f"{CASES}:healthy"], "--demo"),
        (["doctor", f"{CASES}:healthy", "--precision", "fp32"], "compares a half-precision"),
        (["doctor", f"{CASES}:healthy", "--precision", "fp6"], "unknown precision"),
    ]:
        res = run_cli(capsys, *args)
        assert res.code == 2, (args, res.out, res.err)
        assert res.err.startswith("error: ") and needle in res.err, res.err
        assert len(res.err.strip().splitlines()) == 1


def test_cli_app_import_is_torch_free():
    root = Path(__file__).resolve().parents[2]
    code = (
        f"import sys; sys.path.insert(0, {str(root)!r}); from tests.cli._cli_helper import _load_main\n"
        "_load_main(); import trainfit.cli.doctor, trainfit.cli.formats, trainfit.cli.precision\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_unknown_precision_lists_only_what_the_doctor_accepts(capsys):
    res = run_cli(capsys, "doctor", "--demo", "--precision", "bogus")
    assert res.code == 2
    assert res.err.strip() == "error: unknown precision 'bogus'; choose one of: auto, amp-fp16, amp-bf16, pure-bf16"


def test_demo_runs_in_pure_bf16(capsys):
    """The model was cast to bf16 and the batches were not: 'mat1 and mat2 must have the same dtype'."""
    res = run_cli(capsys, "doctor", "--demo", "--precision", "pure-bf16", "--steps", "4", "--json")
    assert res.code == 0, res.err
    data = json.loads(res.out)
    assert data["precision"] == "pure-bf16" and data["format"] == "bf16"
    assert all(isinstance(x, float) for x in data["runs"][1]["losses"])


def test_docs_give_the_demo_the_steps_it_runs():
    """docs/precision.md said the demo runs 30 steps; it runs the --steps default."""
    import inspect

    from trainfit.cli.doctor import doctor

    steps = inspect.signature(doctor).parameters["steps"].default
    docs = (Path(__file__).resolve().parents[2] / "docs" / "precision.md").read_text()
    (line,) = [ln for ln in docs.splitlines() if ln.startswith("`trainfit doctor --demo`")]
    assert f"{steps} steps" in line

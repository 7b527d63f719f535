"""``benchmarks/gpu_session.py`` — the prepared GPU run — must not rot between the sessions that get a GPU.

Each section runs its dry run here (CPU, tiny configs, no CUDA numbers) in this process: every case must
produce its measured record (or a reasoned skip), its analytic and trace predictions and a comparison, with
no error. The orchestration is checked too: the time shares, the output-file limit, and that a child past
its deadline is killed."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests._benchmarks import load_benchmark

gs = load_benchmark("gpu_session")


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "session.jsonl").read_text().splitlines()]


def test_sections_and_cases_are_consistent() -> None:
    shares = [share for _, _, share in gs.SECTIONS]
    assert abs(sum(shares) - 1) < 1e-9
    assert {c.section for c in gs.CASES} == {name for name, _, _ in gs.SECTIONS}
    assert len(gs.BY_ID) == len(gs.CASES)  # ids are unique


#: The lora section's cases the dry run covers: the paths its other cases share.
LORA_PATHS = (
    "q05-lora-r16-all-linear-pure-b4s1024",
    "q05-qlora-nf4-r16-all-linear-amp-b4s1024",
    "q05-lora-full-ckpt-pure-b4s1024",
    "l1b-dora-qv-drop05-pure-b2s1024",
)


@pytest.mark.slow
@pytest.mark.parametrize("section", [name for name, _, _ in gs.SECTIONS])
def test_dry_run_of_each_section(section: str, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    args = ["--dry-run", "--inline", "--sections", section, "--out", str(tmp_path)]
    cases = [c for c in gs.CASES if c.section == section]
    if section == "lora":
        pytest.importorskip("peft")
        # one case per code path (plain LoRA, QLoRA, checkpointing, DoRA with dropout): each runs ~10 s here
        cases = [c for c in cases if c.id in LORA_PATHS]
        args += ["--cases", ",".join(LORA_PATHS)]
    assert gs.main(args) == 0
    rows = _rows(tmp_path)
    errors = [r for r in rows if r.get("record") == "error"]
    assert not errors, errors
    assert {r["case"] for r in rows if r.get("case")} == {c.id for c in cases}
    for case in cases:
        got = {r["record"] for r in rows if r.get("case") == case.id}
        if case.kind == "pytest":
            assert got == {"skipped"}, (case.id, got)
            continue
        if case.kind == "qlora":  # predicted here; measured only on CUDA with bitsandbytes
            assert got == {"predicted", "skipped"}, (case.id, got)
            continue
        assert {"measured", "predicted", "comparison"} <= got, (case.id, got)
        methods = {r.get("method") for r in rows if r.get("case") == case.id and r["record"] == "predicted"}
        want = {"speed-model"} if case.kind == "speed" else {"analytic", "trace"} if case.trace else {"analytic"}
        assert methods == want, (case.id, methods)
        if case.kind in ("train", "lora", "tied") and not case.preceded_by:  # reserved as the child measures it
            predicted = [r for r in rows if r.get("case") == case.id and r["record"] == "predicted"]
            assert all(r["reserved_as_measured_bytes"] > 0 for r in predicted), case.id
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) <= 8, files  # the device tool brings back at most 8 files
    assert f"## {section}" in (tmp_path / "summary.md").read_text()


def test_comparison_is_predicted_over_measured() -> None:
    case = gs.BY_ID["bertl-fp32-foreach-eager-b4s512"]
    measured = {
        "record": "measured",
        "phases": {"forward": 100, "backward": 200},
        "max_reserved": 400,
        "device_used_end": 1000,
    }
    analytic = {
        "record": "predicted",
        "method": "analytic",
        "phases": {"forward": 110, "backward": 150},
        "reserved_estimate_bytes": 300,
        "nvidia_smi_estimate_bytes": 1100,
    }
    (c,) = gs.compare(case, [measured, analytic], Path("."))
    assert c["analytic_rel_error"] == {"forward": 0.1, "backward": -0.25}
    assert c["analytic_reserved"]["rel_error"] == -0.25
    assert c["analytic_reserved"]["device_used_rel_error"] == 0.1
    assert "trace" not in c


def test_a_child_past_its_deadline_is_killed(tmp_path: Path) -> None:
    with (tmp_path / "log.txt").open("w") as log:
        proc = gs._spawn([sys.executable, "-c", "import time; time.sleep(60)"], log)
        t0 = time.monotonic()
        err = gs._wait(proc, time.monotonic() + 1)
    assert err is not None and err.startswith("timeout")
    assert time.monotonic() - t0 < 20
    assert proc.poll() is not None


def test_an_unknown_case_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gs.main(["--dry-run", "--cases", "no-such-case", "--out", str(tmp_path)]) == 2
    assert "unknown case(s) ['no-such-case']" in capsys.readouterr().err

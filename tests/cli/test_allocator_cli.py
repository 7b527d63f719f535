"""`--alloc-conf` and `--segments`: the allocator simulation behind the reserved estimate, from the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from trainfit.cli.app import app

runner = CliRunner()


def _json(*args: str) -> dict[str, object]:
    res = runner.invoke(app, ["estimate", "qwen2.5-0.5b", "--batch", "2", "--seq", "1024", *args, "--json"])
    assert res.exit_code == 0, res.stderr
    out: dict[str, object] = json.loads(res.stdout)
    return out


def test_segments_add_up_to_the_reserved_peak() -> None:
    out = _json("--segments")
    alloc = out["extra"]["allocator"]  # type: ignore[index]
    layout = alloc["layout"]
    assert len(layout) == alloc["segments"]
    assert sum(x["size_bytes"] for x in layout) == alloc["reserved_peak_bytes"]
    for x in layout:
        assert x["allocated_bytes"] + x["free_bytes"] == x["size_bytes"]
        assert 0 <= x["largest_free_bytes"] <= x["free_bytes"]
    # The estimate's reserved figure is that peak (the phases hold the workspaces the stream holds).
    assert out["reserved_estimate_bytes"] == max(out["peak_bytes"], alloc["reserved_peak_bytes"])  # type: ignore[call-overload]
    assert "layout" not in _json()["extra"]["allocator"]  # type: ignore[index]


def test_alloc_conf_is_simulated_and_echoed() -> None:
    default, expandable = _json(), _json("--alloc-conf", "expandable_segments:True")
    assert expandable["extra"]["allocator"]["config"] == "expandable_segments:True"  # type: ignore[index]
    assert default["extra"]["allocator"]["config"] == ""  # type: ignore[index]
    # the allocated peak differs only by the blocks the default allocator keeps whole (expandable segments split
    # every remainder): the same tensors' requests
    rounding = default["components"]["allocator_rounding"]  # type: ignore[index]
    assert expandable["components"]["allocator_rounding"] == 0  # type: ignore[index]
    assert expandable["peak_bytes"] == default["peak_bytes"] - rounding


def test_segments_table_and_one_line_errors() -> None:
    res = runner.invoke(app, ["estimate", "gpt2", "--segments"])
    assert res.exit_code == 0 and "Allocator segments at the reserved peak" in res.stdout
    for args in (["--alloc-conf", "expandable_segments:maybe"], ["--segments", "--gpus", "2", "--sharding", "fsdp"]):
        proc = subprocess.run(
            [sys.executable, "-m", "trainfit.cli.app", "estimate", "gpt2", *args], capture_output=True, text=True
        )
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ")

"""The fine-tuning flags from the CLI: docs/finetuning.md's examples run (or fail) as the page says, and the
flags reach the Strategy (JSON echo)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from tests.cli._cli_helper import run_cli

DOC = (Path(__file__).parents[2] / "docs" / "finetuning.md").read_text()
EXAMPLES = re.findall(r"^\$ trainfit (.+)$", DOC, re.M)


@pytest.mark.parametrize("line", [x for x in EXAMPLES if "--method trace" not in x])
def test_documented_examples(line: str, capsys: pytest.CaptureFixture[str]) -> None:
    r = run_cli(capsys, *shlex.split(line))
    after = DOC.split(f"$ trainfit {line}\n", 1)[1].split("\n", 1)[0]
    if after.startswith("error:"):
        assert r.code == 2 and " ".join(r.err.split()) == " ".join(after.split())
    else:
        assert r.code == 0, r.err


def test_flags_reach_the_strategy(capsys: pytest.CaptureFixture[str]) -> None:
    line = (
        "estimate llama-3.2-1b --finetune qlora --lora-rank 32 --lora-targets q_proj,v_proj --lora-dropout 0.05 "
        "--no-double-quant --seq 256 --json"
    )
    r = run_cli(capsys, *line.split())
    assert r.code == 0, r.err
    ft = json.loads(r.out)["strategy"]["finetune"]
    assert ft["adapter"]["rank"] == 32 and ft["adapter"]["alpha"] == 64
    assert ft["adapter"]["targets"] == ["q_proj", "v_proj"] and ft["adapter"]["dropout"] == 0.05
    assert ft["base_quantization"] == "nf4" and ft["double_quant"] is False and ft["kbit_prepared"] is True


def test_full_fine_tuning_json_has_no_finetune_key(capsys: pytest.CaptureFixture[str]) -> None:
    r = run_cli(capsys, *["estimate", "llama-3.2-1b", "--seq", "256", "--json"])
    assert r.code == 0 and "finetune" not in json.loads(r.out)["strategy"]


@pytest.mark.parametrize(
    "args",
    [
        "--finetune lora --lora-rank 0",
        "--finetune lora --lora-targets qkv",
        "--finetune freeze --freeze layers:3-2",
        "--finetune lora --adapter-dtype int4",
        "--finetune bogus",
        "--finetune freeze --freeze embeddings,lm_head,norm,layers:0-15",  # nothing left to train
    ],
)
def test_bad_fine_tuning_flags_exit_2_with_one_line(args: str, capsys: pytest.CaptureFixture[str]) -> None:
    r = run_cli(capsys, "estimate", "llama-3.2-1b", *args.split())
    assert r.code == 2 and len(r.err.strip().splitlines()) == 1 and r.err.startswith("error:")


@pytest.mark.parametrize("saver", ["--activation-offload", "--optimizer paged-adamw-8bit"])
def test_one_gpu_text_report_shows_the_host_memory(saver: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Offloaded activations and paged optimizer states live outside the device peak: the table says how much (it
    printed host memory for many GPUs only), the largest of JSON's per-phase ``host_bytes``."""
    args = ["estimate", "llama-3.2-1b", "--seq", "256", *saver.split()]
    r = run_cli(capsys, *args, "--json")
    assert r.code == 0, r.err
    host = max(p.get("host_bytes", 0) for p in json.loads(r.out)["phases"].values())
    text = run_cli(capsys, *args)
    assert text.code == 0, text.err
    shown = re.search(r"host memory: ([\d.]+) GiB", " ".join(text.out.split()))
    assert host > 0 and shown is not None
    assert float(shown.group(1)) == pytest.approx(host / 2**30, abs=0.006)
    plain = run_cli(capsys, "estimate", "llama-3.2-1b", "--seq", "256")
    assert "host memory" not in plain.out

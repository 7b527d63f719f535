"""The fine-tuning flags from the CLI: docs/finetuning.md's examples run (or fail) as the page says, and the
flags reach the Strategy (JSON echo)."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from tests.cli._cli_helper import run_cli

DOC = (Path(__file__).parents[2] / "docs" / "finetuning.md").read_text()
EXAMPLES = re.findall(r"^\$ trainfit (.+)$", DOC, re.M)


def _library_report(line: str, **changes: Any) -> Any:
    """The documented command's setup through the library's public API (``finetune_setup``, ``with_head``,
    ``MemorySavers``, ``Strategy``, ``estimate``), its flags read here rather than by the CLI: the CLI has to reach
    the same figures through its own parsing. ``changes`` replaces flag values (another ``base_dtype``)."""
    from trainfit import Strategy, estimate, load_model
    from trainfit.arch.heads import with_head
    from trainfit.estimate import default_seq_len
    from trainfit.strategy import MemorySavers, finetune_setup

    p = argparse.ArgumentParser(exit_on_error=False)
    p.add_argument("command", choices=["estimate"])
    p.add_argument("model")
    for flag, default in (
        ("--finetune", "full"),
        ("--lora-targets", "all-linear"),
        ("--base-dtype", None),
        ("--freeze", None),
        ("--checkpointing", "none"),
        ("--gpu", None),
        ("--head", None),
        ("--precision", "amp-bf16"),
        ("--loss", "standard"),
        ("--attention", "sdpa"),
        ("--optimizer", "adamw"),
    ):
        p.add_argument(flag, default=default)
    for flag, default in (("--lora-rank", 16), ("--batch", 1), ("--seq", None), ("--num-labels", None)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--lora-dropout", type=float, default=0.0)
    for flag in ("--dora", "--optimizer-in-backward", "--activation-offload"):
        p.add_argument(flag, action="store_true")
    ns = vars(p.parse_args(shlex.split(line)))  # a flag this list does not know fails here: teach it the flag
    ns.update(changes)
    spec = load_model(ns["model"])
    if ns["head"] is not None or ns["num_labels"] is not None:
        spec = with_head(spec, ns["head"], ns["num_labels"])
    fields: dict[str, Any] = {}
    if ns["finetune"] != "full" or ns["freeze"] is not None or ns["base_dtype"] is not None:
        finetune = "freeze" if ns["freeze"] is not None and ns["finetune"] == "full" else ns["finetune"]
        fields["adapter"], fields["base_weights"] = finetune_setup(
            finetune,
            rank=ns["lora_rank"],
            targets=ns["lora_targets"],
            dropout=ns["lora_dropout"],
            dora=ns["dora"],
            base_dtype=ns["base_dtype"],
            freeze=ns["freeze"] or (),
        )
    loss, chunks = MemorySavers.parse_loss(ns["loss"])
    paged = ns["optimizer"].startswith("paged-")
    strategy = Strategy(
        precision=ns["precision"],
        optimizer=ns["optimizer"].removeprefix("paged-"),
        attention=ns["attention"],
        micro_batch=ns["batch"],
        seq_len=ns["seq"] or default_seq_len(spec),
        checkpointing=ns["checkpointing"],
        savers=MemorySavers(
            loss=loss,
            loss_chunks=chunks,
            optimizer_in_backward=ns["optimizer_in_backward"],
            activation_offload=ns["activation_offload"],
            paged_optimizer=paged,
        ),
        **fields,
    )
    return estimate(spec, strategy, gpu=ns["gpu"])


@pytest.mark.parametrize("line", [x for x in EXAMPLES if "--method trace" not in x])
def test_documented_examples(line: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Each documented command runs (or fails with the documented line); one that runs gives, in its JSON, the
    library API's report for the same arguments, and its key components are there with plausible bytes: the
    adapters' fp32 tensors (4 bytes per trainable parameter and their allocator rounding), a quantised base smaller
    than the same base in bf16, a frozen range's gradients fewer than full fine-tuning's, activations and the
    adapters' optimizer states non-zero."""
    from trainfit import load_model
    from trainfit.report.json import report_json

    r = run_cli(capsys, *shlex.split(line))
    after = DOC.split(f"$ trainfit {line}\n", 1)[1].split("\n", 1)[0]
    if after.startswith("error:"):
        assert r.code == 2 and " ".join(r.err.split()) == " ".join(after.split())
        return
    assert r.code == 0, r.err
    r = run_cli(capsys, *shlex.split(line), "--json")
    assert r.code == 0, r.err
    cli = json.loads(r.out)
    library = _library_report(line)
    assert cli == json.loads(json.dumps(report_json(library)))  # every figure, and the strategy echoed

    peak = cli["components"]
    most = {k: max(ph["components"][k] for ph in cli["phases"].values()) for k in peak}  # each one's largest
    trainable, params = cli["trainable_params"], cli["params"]
    assert cli["peak_bytes"] == sum(peak.values()) > 0
    assert 0 < trainable <= params
    assert most["weights"] > 0 and most["activations"] > 0
    ft = cli["strategy"].get("finetune")
    if ft is None:
        return
    assert trainable < params and most["optimizer_states"] > 0
    if ft.get("adapter"):
        # PEFT's fp32 adapters: 4 bytes a trainable parameter, each tensor rounded up to 512 bytes
        assert 4 * trainable <= most["adapter_weights"] <= 4 * trainable * 1.05 + (1 << 20)
    else:
        assert most["adapter_weights"] == 0
        full = report_json(_library_report(line, finetune="full", freeze=None))["phases"]
        assert 0 < most["gradients"] < max(ph["components"]["gradients"] for ph in full.values())
    quant = ft.get("base_quantization")
    if quant not in (None, "none") and load_model(cli["model"]["name"]).moe is None:
        # packed layer linears (a MoE stack's experts are not bitsandbytes layers: adapters.bnb_converted)
        bf16 = report_json(_library_report(line, finetune="lora", base_dtype="bf16"))["components"]["weights"]
        assert peak["weights"] < (0.75 if quant in ("nf4", "fp4") else 1.0) * bf16, (peak["weights"], bf16)


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


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        ("--dora", "--dora"),
        ("--lora-rank 8", "--lora-rank"),
        ("--lora-alpha 32", "--lora-alpha"),
        ("--freeze embeddings --lora-targets q_proj", "--lora-targets"),
        ("--lora-dropout 0.1", "--lora-dropout"),
        ("--adapter-dtype bf16", "--adapter-dtype"),
        ("--no-double-quant", "--double-quant"),
    ],
)
def test_a_fine_tuning_flag_that_would_do_nothing_is_refused(
    args: str, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An adapter's flag, or ``--double-quant``, in a command that names no ``--finetune`` was ignored silently (the
    run estimated as full training); now one line names it, in estimate and plan. A command that names
    ``--finetune`` keeps them (a plan's changes appended to a LoRA command: test_plan_baseline)."""
    for cmd in (["estimate", "llama-3.2-1b"], ["plan", "llama-3.2-1b", "--gpu", "a100-sxm-80gb"]):
        r = run_cli(capsys, *cmd, *args.split())
        assert r.code == 2 and len(r.err.strip().splitlines()) == 1 and flag in r.err, (cmd, r.err)
    assert run_cli(capsys, "estimate", "llama-3.2-1b", "--finetune", "qlora", "--no-double-quant").code == 0


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


def test_an_fp32_frozen_base_under_amp_is_noted_with_the_bf16_figure(capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's first example under amp-bf16 stores the frozen base in fp32 (the recipe's weights): the report
    says so, with what ``--base-dtype bf16`` would store (the weights of that run, computed), in JSON's notes and in
    the table without ``--explain``; not with ``--base-dtype bf16``, not under pure-bf16, not for full training."""
    line = "estimate llama-3.1-8b --finetune lora --lora-rank 16 --lora-targets all-linear --batch 4 --seq 2048"
    r = run_cli(capsys, *line.split(), "--checkpointing", "full", "--json")
    assert r.code == 0, r.err
    notes = [n for n in json.loads(r.out)["notes"] if n.startswith("frozen base stored in fp32")]
    half = run_cli(capsys, *line.split(), "--checkpointing", "full", "--base-dtype", "bf16", "--json")
    assert half.code == 0, half.err
    weights = json.loads(r.out)["phases"]["forward"]["components"]["weights"]
    weights_bf16 = json.loads(half.out)["phases"]["forward"]["components"]["weights"]
    assert weights == pytest.approx(2 * weights_bf16, rel=0.001)  # nearly all of it is the frozen base
    assert notes == [
        f"frozen base stored in fp32 (the recipe's weights, {weights / 2**30:.2f} GiB); --base-dtype bf16 halves it "
        f"({weights_bf16 / 2**30:.2f} GiB, {(weights - weights_bf16) / 2**30:.2f} GiB less)"
    ]
    assert not [n for n in json.loads(half.out)["notes"] if n.startswith("frozen base")]
    text = run_cli(capsys, *line.split(), "--checkpointing", "full")
    assert text.code == 0 and "frozen base stored in fp32" in " ".join(text.out.split())
    for other in (["--precision", "pure-bf16"], ["--finetune", "full"]):
        args = ["estimate", "llama-3.2-1b", "--seq", "256", *other, "--json"]
        if other[0] == "--precision":
            args += ["--finetune", "lora"]
        out = run_cli(capsys, *args)
        assert out.code == 0, out.err
        assert not [n for n in json.loads(out.out)["notes"] if n.startswith("frozen base")]

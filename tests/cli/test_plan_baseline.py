"""``trainfit plan`` with the user's run as the baseline: ``trainfit estimate``'s run flags, the changes relative to
them, the estimate's refusals, and the same search as ``trainfit estimate --fixes`` for the same command."""

from __future__ import annotations

import json
import shlex

import pytest

from tests.cli._cli_helper import run_cli

# qwen2.5-0.5b on one RTX 4090, 8 sequences of 1024 tokens: a search of a few tenths of a second
SMALL = ("plan", "qwen2.5-0.5b", "--gpu", "rtx-4090", "--gpus", "1", "--seq", "1024", "--global-batch", "8")


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    r = run_cli(capsys, *SMALL, "--top", "4", *args, "--json")
    assert r.code == 0, r.err
    out = json.loads(r.out)
    assert isinstance(out, dict)
    return out


def test_the_baseline_decides_what_the_changes_say(capsys: pytest.CaptureFixture[str]) -> None:
    """The same ranking (the search space does not move), but the changes are now from an fp32, fully checkpointed
    run with micro-batch 2: a bf16 plan says its recipe, an unchecked one says --checkpointing none."""
    default = _plan(capsys)
    mine = _plan(capsys, "--precision", "fp32", "--checkpointing", "full", "--batch", "2")
    plans, base = mine["plans"], default["plans"]
    assert isinstance(plans, list) and isinstance(base, list) and plans
    # the same speeds, rank for rank; between plans that tie, the one nearer the baseline wins (here a fully
    # checkpointed plan instead of the default's sqrt one)
    assert [p["step_seconds"] for p in plans] == [p["step_seconds"] for p in base]
    assert [p["changes"] for p in plans] != [p["changes"] for p in base]
    for p in plans:
        s = p["strategy"]
        assert (f"--precision {s['precision']}" in p["changes"]) == (s["precision"] != "fp32")
        assert (f"--checkpointing {s['checkpointing']}" in p["changes"]) == (s["checkpointing"] != "full")
    # JSON names the baseline (the default's too)
    assert mine["baseline"]["precision"] == "fp32" and mine["baseline"]["checkpointing"] == "full"  # type: ignore[index]
    assert mine["baseline"]["micro_batch"] == 2  # type: ignore[index]
    assert "--precision fp32" in mine["baseline_flags"] and "--checkpointing full" in mine["baseline_flags"]  # type: ignore[operator]
    assert default["baseline"]["precision"] == "amp-bf16" and default["baseline"]["micro_batch"] == 8  # type: ignore[index]


def test_the_text_says_what_the_changes_are_from(capsys: pytest.CaptureFixture[str]) -> None:
    r = run_cli(capsys, *SMALL, "--top", "2", "--precision", "fp32", "--checkpointing", "full")
    assert r.code == 0, r.err
    assert "note: changes are from the baseline: --precision fp32 --checkpointing full --batch 8" in r.out


@pytest.mark.parametrize(
    "run",
    [
        ["--precision", "fp32", "--checkpointing", "full", "--batch", "2"],
        ["--attention", "eager", "--optimizer-impl", "foreach"],
        # a LoRA on an 8-bit base: the LoRA plans run on it; QLoRA and full plans say what replaces --base-dtype
        ["--finetune", "lora", "--lora-rank", "8", "--base-dtype", "int8"],
        # paged by the flag: a plan that does not page says "without --paged-optimizer"
        ["--optimizer", "adamw-8bit", "--paged-optimizer"],
    ],
    ids=["fp32-full", "eager-foreach", "lora-int8", "paged"],
)
def test_each_plan_is_the_baseline_command_with_its_changes(run: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """The changes apply to the user's own command: ``trainfit estimate`` with the baseline's flags followed by a
    plan's changes estimates exactly that plan (its bytes and speed)."""
    out = _plan(capsys, *run)
    assert out["plans"]
    for p in out["plans"]:  # type: ignore[attr-defined]
        own = list(run)
        changes: list[str] = []
        for c in p["changes"]:
            add, _, drop = c.partition("without ")
            changes += shlex.split(add)
            if drop == "--base-dtype":  # the command's own --base-dtype (and its value) dropped
                i = own.index("--base-dtype")
                del own[i : i + 2]
            elif drop == "--paged-optimizer":
                own.remove("--paged-optimizer")
            else:
                assert not drop, c
        cmd = ["estimate", "qwen2.5-0.5b", "--gpu", "rtx-4090", "--seq", "1024", "--batch", "8", *own, *changes]
        e = run_cli(capsys, *cmd, "--json")
        assert e.code == 0, (cmd, e.err)
        est = json.loads(e.out)
        assert est["required_bytes"] == p["required_bytes"], cmd
        assert est["step_seconds"] == pytest.approx(p["step_seconds"]), cmd
        assert est["strategy"] == p["strategy"], cmd


def test_a_lora_baseline_keeps_its_adapter_and_base(capsys: pytest.CaptureFixture[str]) -> None:
    """An adapter in the baseline allows LoRA/QLoRA as ``--allow lora,qlora`` would, with the baseline's rank and
    8-bit base; a QLoRA plan says the 4-bit base that replaces it, a full one drops --base-dtype."""
    out = _plan(capsys, "--finetune", "lora", "--lora-rank", "8", "--base-dtype", "int8", "--top", "8")
    plans = out["plans"]
    assert isinstance(plans, list)
    for p in plans:
        s, changes = p["strategy"], " ".join(p["changes"])
        if s.get("adapter"):
            assert s["adapter"]["rank"] == 8
        if "--finetune qlora" in changes:
            assert "--finetune qlora --base-dtype nf4" in changes
        if "--finetune full" in changes:
            assert "--finetune full without --base-dtype" in changes
    assert any("--finetune" not in " ".join(p["changes"]) for p in plans), "the baseline's own LoRA is searched"


@pytest.mark.parametrize(
    "run",
    [
        ["--checkpointing", "sac", "--attention", "eager"],
        ["--base-dtype", "nf4"],
        ["--no-reshard-after-forward"],
        ["--precision", "fp9"],
        ["--fp8", "tensorwise"],
        ["--finetune", "freeze"],
    ],
    ids=["sac-eager", "base-dtype-full", "fsdp-flag-without-fsdp", "unknown-precision", "fp8-on-turing", "freeze-bare"],
)
def test_a_baseline_the_estimate_refuses_is_refused_alike(run: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """One line, exit 2, the estimate's own message for the same run (one GPU, the whole batch per GPU)."""
    gpu = ["--gpu", "t4"] if "--fp8" in run else ["--gpu", "rtx-4090"]
    args = [a if a != "rtx-4090" else gpu[1] for a in SMALL]
    r = run_cli(capsys, *args, *run)
    e = run_cli(capsys, "estimate", "qwen2.5-0.5b", *gpu, "--seq", "1024", "--batch", "8", *run)
    assert r.code == 2 and e.code == 2
    assert r.err.count("\n") == 1 and r.err.startswith("error: ")
    assert r.err == e.err


@pytest.mark.parametrize(
    ("estimate", "plan"),
    [
        (
            ["qwen2.5-1.5b", "--gpu", "t4", "--precision", "amp-fp16", "--seq", "2048", "--batch", "8"],
            ["--global-batch", "8"],
        ),
        (
            ["gemma-2b", "--gpu", "l4", "--attention", "eager", "--optimizer", "adafactor", "--batch", "2"],
            ["--seq", "2048", "--global-batch", "2"],
        ),
    ],
    ids=["qwen-t4-fp16", "gemma-eager-adafactor"],
)
def test_plan_from_the_command_is_estimates_fixes(
    estimate: list[str], plan: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``trainfit estimate CMD`` that does not fit lists the planner's top three fixes for CMD as the baseline;
    ``trainfit plan`` with the same run flags, GPUs, batch and sequence is that search: the same changes."""
    e = run_cli(capsys, "estimate", *estimate, "--json")
    fixes = json.loads(e.out)["fixes"]
    assert fixes, "the case must not fit"
    r = run_cli(capsys, "plan", *estimate, "--gpus", "1", *plan, "--top", "3", "--json")
    assert r.code == 0, r.err
    changes = [
        [f"--alloc-conf {c.removeprefix('PYTORCH_CUDA_ALLOC_CONF=')}" if c.startswith("PYTORCH_") else c
         for c in p["changes"]]
        for p in json.loads(r.out)["plans"]
    ]  # fmt: skip
    assert changes == [f["flags"] for f in fixes]


def test_help_describes_the_baseline_with_an_example(capsys: pytest.CaptureFixture[str]) -> None:
    r = run_cli(capsys, "plan", "--help")
    assert r.code == 0
    text = " ".join(r.out.split())
    assert "Your current run (the baseline)" in text and "--checkpointing full --batch 2" in text
    for flag in ("--precision", "--optimizer-impl", "--attention", "--finetune", "--lora-rank", "--base-dtype"):
        assert flag in r.out

"""``trainfit plan`` from the command line: the examples, JSON, one-line errors; ``estimate``'s checked fixes."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from tests.cli._cli_helper import run_cli


def test_plan_json_top_plan_fits_when_estimated_with_its_flags(capsys: pytest.CaptureFixture[str]) -> None:
    r = run_cli(capsys, "plan", "llama-3.2-1b", "--gpu", "a100-sxm-40gb", "--gpus", "8", "--seq", "4096",
                "--global-batch", "64", "--json")  # fmt: skip
    assert r.code == 0, r.err
    out = json.loads(r.out)
    assert out["schema_version"] == 1 and out["plans"]
    top = out["plans"][0]
    assert top["fits"] and top["required_bytes"] <= top["usable_bytes"]
    assert top["tokens_per_second"] > 0 and 0 < top["mfu"] < 1
    # the same flags through `trainfit estimate` (baseline: amp-bf16, DDP over 8 GPUs, micro-batch 8)
    flags = ["--gpus", "8", "--sharding", "ddp", "--batch", "8"]
    for change in top["changes"]:
        flags += shlex.split(change)
    e = run_cli(capsys, "estimate", "llama-3.2-1b", "--gpu", "a100-sxm-40gb", "--seq", "4096", *flags, "--json")
    assert e.code == 0, e.err
    est = json.loads(e.out)
    assert est["fits"] and est["required_bytes"] == top["required_bytes"]
    assert est["step_seconds"] == pytest.approx(top["step_seconds"])


def test_plan_table_and_two_line_explanation(capsys: pytest.CaptureFixture[str]) -> None:
    r = run_cli(capsys, "plan", "qwen2.5-0.5b", "--gpu", "rtx-4090", "--seq", "1024", "--global-batch", "16")
    assert r.code == 0, r.err
    assert "tokens/s" in r.out and "usable" in r.out and "MFU" in r.out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--global-batch", "8", "--tokens-per-step", "8192"], "not both"),
        (["--tokens-per-step", "1000"], "whole number of sequences"),
        (["--global-batch", "8", "--objective", "quickest"], "unknown --objective"),
        (["--global-batch", "8", "--allow", "fp8"], "t4 has no fp8 tensor cores"),
        (["--global-batch", "8", "--gpus", "3", "--nodes", "1"], "--gpus-per-node"),
        (["--top", "0"], "--top must be at least 1"),
        (["--headroom", "1"], "--headroom must be in [0, 1)"),
        (["--objective", "cheapest", "--price-per-gpu-hour", "0"], "--price-per-gpu-hour must be positive"),
        (["--network-gbps", "-5"], "--network-gbps must be positive"),
        (["--gpus", "2", "--global-batch", "0"], "--global-batch must be positive"),
        (["--export", "/dev/null/plan"], "--export /dev/null/plan: cannot write there"),
        (["--host-memory-gib", "0"], "--host-memory-gib must be positive"),
        (["--host-memory-gib", "nan"], "--host-memory-gib must be positive"),
    ],
)
def test_plan_errors_are_one_line(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    r = run_cli(capsys, "plan", "gpt2", "--gpu", "t4", "--seq", "1024", *args)
    assert r.code == 2
    assert message in r.err and r.err.count("\n") == 1


def test_plan_shows_host_memory_per_node_and_holds_a_host_limit(capsys: pytest.CaptureFixture[str]) -> None:
    """Llama 3.2 3B on one RTX 4090 fits only with ZeRO-3 offload: the table has a host GiB/node column and a note
    that the host was not checked; JSON has each plan's host_peak_bytes; --host-memory-gib 64 (44.8 GiB usable with
    the headroom) rules them all out and says what would do."""
    args = ("plan", "llama-3.2-3b", "--gpu", "rtx-4090", "--gpus", "1", "--seq", "1024", "--global-batch", "8")
    r = run_cli(capsys, *args, "--top", "2")
    assert r.code == 0, r.err
    assert "host GiB/node" in r.out and "note: host memory not checked" in r.out
    j = run_cli(capsys, *args, "--top", "2", "--json")
    out = json.loads(j.out)
    assert all(p["host_peak_bytes"] > 40 * 2**30 for p in out["plans"]) and "host_memory_bytes" not in out
    t = run_cli(capsys, *args, "--host-memory-gib", "64")
    assert t.code == 0 and "nothing fits" in t.out
    assert "would fit with --host-memory-gib" in t.out and "ruled out by their host memory per node" in t.out
    tj = json.loads(run_cli(capsys, *args, "--host-memory-gib", "64", "--json").out)
    assert tj["plans"] == [] and tj["host_memory_bytes"] == 64 * 2**30 and tj["host_rejected"] > 0
    # a plan without offload has no host column
    small = run_cli(capsys, "plan", "qwen2.5-0.5b", "--gpu", "a100-sxm-80gb", "--seq", "1024", "--global-batch", "8")
    assert "host GiB/node" not in small.out


def test_plan_without_a_batch_plans_8_sequences_per_gpu_and_exports(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The issue's `--export` example gives no batch: the HF Trainer's defaults (per_device_train_batch_size 8, no
    accumulation) on every GPU given, said in a note; the same search as `--global-batch 8 × GPUs`."""
    args = ["plan", "gpt2", "--gpu", "t4", "--gpus", "2", "--seq", "1024"]
    r = run_cli(capsys, *args, "--export", str(tmp_path))
    assert r.code == 0, r.err
    assert "note: global batch 16 sequences of 1024 tokens" in r.out and "per_device_train_batch_size" in r.out
    # the top plan's engine decides the file: the Trainer's arguments, or Megatron-LM's (its data-parallel plan with
    # fused kernels ranks first here since Megatron is searched without TP/PP too)
    assert (tmp_path / "launch.sh").is_file()
    assert (tmp_path / "training_args.json").is_file() or (tmp_path / "megatron_args.txt").is_file()
    default = json.loads(run_cli(capsys, *args, "--json").out)
    given = json.loads(run_cli(capsys, *args, "--global-batch", "16", "--json").out)
    assert default["global_batch"] == 16 and default["plans"] == given["plans"]


def test_cheapest_shows_each_plans_cost_at_the_price(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "qwen2.5-0.5b", "--gpu", "t4", "--gpus", "4", "--seq", "1024", "--objective", "cheapest"]
    out = json.loads(run_cli(capsys, *args, "--price-per-gpu-hour", "2.5", "--top", "3", "--json").out)
    assert out["price_per_gpu_hour"] == 2.5 and out["plans"]
    costs = [p["cost_per_step"] for p in out["plans"]]
    for p in out["plans"]:  # GPU-hours of one step at the price
        assert p["cost_per_step"] == pytest.approx(p["gpus"] * p["step_seconds"] / 3600 * 2.5)
    assert costs == sorted(costs)
    assert "cost/step" in run_cli(capsys, *args).out
    fastest = json.loads(run_cli(capsys, *args[:-2], "--json").out)
    assert "price_per_gpu_hour" not in fastest and "cost_per_step" not in fastest["plans"][0]


FIXES_CASES = [
    ["qwen2.5-1.5b", "--gpu", "t4", "--precision", "amp-fp16", "--seq", "2048", "--batch", "8"],
    # fragmentation is the difference: some fixes change the allocator (spelled --alloc-conf, replayed below)
    [
        *("llama-3.1-8b", "--gpu", "a100-sxm-80gb", "--precision", "pure-bf16", "--optimizer", "adamw-8bit"),
        *("--checkpointing", "full", "--batch", "1", "--seq", "8192", "--alloc-conf", ""),
    ],
    # what the planner does not search is the command's: eager attention stays (the plans were SDPA's, and one
    # said --checkpointing sac, which the estimate refuses with eager attention)
    ["gemma-2b", "--gpu", "l4", "--attention", "eager", "--optimizer", "adafactor", "--batch", "2", "--seq", "1024"],
]


@pytest.mark.parametrize("case", FIXES_CASES, ids=["qwen-t4", "llama-8b-fragmented", "gemma-eager"])
def test_estimate_that_does_not_fit_lists_checked_fixes_that_fit(
    case: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["estimate", *case]
    r = run_cli(capsys, *base, "--json")
    out = json.loads(r.out)
    assert not out["fits"] and 1 <= len(out["fixes"]) <= 3
    assert out["step_seconds"] > 0 and out["tokens_per_second"] > 0
    for fix in out["fixes"]:
        flags = [f for change in fix["flags"] for f in shlex.split(change)]
        e = run_cli(capsys, *base, *flags, "--json")
        assert e.code == 0 and json.loads(e.out)["fits"], fix


def test_no_fixes_leaves_the_planner_out(capsys: pytest.CaptureFixture[str]) -> None:
    """--no-fixes: the same verdict, and ``fixes`` is null (not searched) rather than an empty list (none found)."""
    base = ["estimate", "qwen2.5-1.5b", "--gpu", "t4", "--precision", "amp-fp16", "--seq", "2048", "--batch", "8"]
    full = json.loads(run_cli(capsys, *base, "--json").out)
    quick = json.loads(run_cli(capsys, *base, "--no-fixes", "--json").out)
    assert quick["fixes"] is None and full["fixes"]
    assert {k: v for k, v in quick.items() if k != "fixes"} == {k: v for k, v in full.items() if k != "fixes"}


def test_plan_records_the_releases_and_the_process_in_json_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "llama-3.2-1b", "--gpu", "a100-sxm-80gb", "--gpus", "1", "--global-batch", "8", "--top", "2"]
    default = json.loads(run_cli(capsys, *base, "--json").out)
    assert default["torch_version"] == "2.13" and default["cuda_version"] == "13.0"
    assert default["history"] == {"build": "from-pretrained", "warm_up": False, "after": []} and not default["notes"]
    given = ["--torch-version", "2.11", "--cuda-version", "11.6", "--warm-up", "--after", "qwen2.5-0.5b -b 4"]
    r = run_cli(capsys, *base, *given, "--json")
    assert r.code == 0, r.err
    out = json.loads(r.out)
    assert out["torch_version"] == "2.11" and out["cuda_version"] == "11.6"
    assert out["history"]["warm_up"] and [a["model"] for a in out["history"]["after"]] == ["qwen2.5-0.5b"]
    assert "warm-up matmul" in out["notes"][0]
    table = run_cli(capsys, *base, *given).out
    assert "torch 2.11, CUDA 11.6" in table and "note: reserved memory simulated" in table
    # each plan is what `trainfit estimate` says with its flags and the same releases and process
    top = out["plans"][0]
    flags = ["--batch", "8", *(f for change in top["changes"] for f in shlex.split(change))]
    e = run_cli(capsys, "estimate", "llama-3.2-1b", "--gpu", "a100-sxm-80gb", *flags, *given, "--json")
    assert e.code == 0, e.err
    assert json.loads(e.out)["required_bytes"] == top["required_bytes"]


def test_estimate_fixes_are_checked_under_its_releases(capsys: pytest.CaptureFixture[str]) -> None:
    """``estimate --fixes`` searches under the estimate's --torch-version/--cuda-version: each fix's required bytes
    are what `trainfit estimate` with the fix's flags and the same releases says (CUDA 11.6 loads every module
    eagerly, a larger context: the fixes' bytes move with it)."""
    base = ["estimate", *FIXES_CASES[0]]
    releases = ["--torch-version", "2.11", "--cuda-version", "11.6"]
    out = json.loads(run_cli(capsys, *base, *releases, "--json").out)
    assert out["torch_version"] == "2.11" and out["cuda_version"] == "11.6"
    assert not out["fits"] and out["fixes"]
    for fix in out["fixes"]:
        flags = [f for change in fix["flags"] for f in shlex.split(change)]
        fixed = json.loads(run_cli(capsys, *base, *flags, *releases, "--json").out)
        fresh = json.loads(run_cli(capsys, *base, *flags, "--json").out)
        assert fixed["fits"]
        assert f"fits with {fixed['required_bytes'] / 2**30:.1f} GiB" in fix["reason"], fix
        assert f"{fixed['required_bytes'] / 2**30:.1f}" != f"{fresh['required_bytes'] / 2**30:.1f}"  # it moved


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--torch-version", "2.5"], "--torch-version: torch 2.5: the workspace rules are known from torch 2.9 on"),
        (["--torch-version", "latest"], "--torch-version: torch version 'latest' is not MAJOR.MINOR"),
        (["--cuda-version", "11.6", "--gpu", "h100-sxm-80gb"], "--cuda-version: h100-sxm-80gb"),
        (["--cuda-version", "13"], "--cuda-version"),
        (["--gpus", "2", "--warm-up"], "modelled for one GPU only"),
        (["--build", "sideways"], "unknown build 'sideways'"),
        (["--after", "gpt2 --gpus 2"], "--after: an earlier run in the process is one GPU's"),
        (["--after", "gpt2 --alloc-conf x"], "--alloc-conf belongs to the whole process"),
    ],
)
def test_plan_release_and_history_errors_are_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    r = run_cli(capsys, "plan", "gpt2", "--gpu", "t4", "--seq", "1024", "--global-batch", "8", *args)
    assert r.code == 2, r.out
    assert message in r.err and r.err.count("\n") == 1, r.err


def test_plan_help_says_where_fp8_is_searched(capsys: pytest.CaptureFixture[str]) -> None:
    """fp8 candidates exist on one GPU and under DDP/FSDP2/HSDP (``planner.space.float8_candidates``): the help said
    "one GPU" only."""
    r = run_cli(capsys, "plan", "--help")
    text = " ".join(r.out.replace("│", " ").split())
    assert "DDP/FSDP2/HSDP" in text and "fp8: torchao linears, one GPU)" not in text


def test_network_gbps_help_says_it_is_a_line_rate_that_nccl_reaches_a_share_of() -> None:
    """``--network-gbps`` is the NICs' line rate (the speed model applies NCCL's efficiency to it,
    ``planner.speed.nccl_network_gbps``): the help says so, with the share formatted from the constant."""
    import inspect
    import typing

    from trainfit.cli.plan import plan_cmd
    from trainfit.planner.speed import DEFAULT_NETWORK_GBPS, NCCL_NETWORK_EFFICIENCY

    param = inspect.signature(plan_cmd, eval_str=True).parameters["network_gbps"]
    (option,) = typing.get_args(param.annotation)[1:]
    assert "line rate" in option.help and "400 Gb/s NIC per GPU" in option.help
    assert f"about {NCCL_NETWORK_EFFICIENCY:.0%} of it" in option.help
    assert param.default == DEFAULT_NETWORK_GBPS


def test_without_seq_the_plan_takes_the_estimates_default(capsys: pytest.CaptureFixture[str]) -> None:
    """``trainfit plan`` without ``--seq`` plans at ``trainfit estimate``'s default: 2048 tokens, or the model's context
    when shorter (GPT-2's learned positions end at 1024; it planned 2048-token runs GPT-2 cannot make). A given
    ``--seq`` is kept; the web API builds the same workload."""
    from trainfit.arch import load_model
    from trainfit.estimate import DEFAULT_SEQ_LEN, default_seq_len

    def seq_of(*args: str) -> int:
        r = run_cli(capsys, "plan", *args, "--gpu", "t4", "--top", "1", "--json")
        assert r.code == 0, r.err
        return int(json.loads(r.out)["seq_len"])

    gpt2 = load_model("gpt2")
    assert gpt2.max_position_embeddings is not None and gpt2.max_position_embeddings < DEFAULT_SEQ_LEN
    assert seq_of("gpt2") == default_seq_len(gpt2) == gpt2.max_position_embeddings
    assert seq_of("gpt2", "--seq", "512") == 512
    assert seq_of("qwen2.5-0.5b") == DEFAULT_SEQ_LEN
    from trainfit.planner.api import plan  # the library without a workload or seq: the same default

    assert plan(gpt2, "t4", top=1).seq_len == gpt2.max_position_embeddings
    from trainfit import Strategy  # a baseline without a workload: its own sequence length, not the default

    assert plan(gpt2, "t4", top=1, baseline=Strategy(seq_len=512, micro_batch=8)).seq_len == 512


def test_a_plan_past_the_models_context_says_so_as_the_estimate_does(capsys: pytest.CaptureFixture[str]) -> None:
    """``trainfit plan gpt2 --seq 4096`` planned silently for a length GPT-2's learned position table cannot reach;
    the plan's notes now carry the estimate's warning, worded for every plan; within the context there is none."""
    from trainfit.arch import load_model
    from trainfit.estimate import context_warning

    def notes(*args: str) -> list[str]:
        r = run_cli(capsys, "plan", "gpt2", "--gpu", "t4", "--top", "1", "--json", *args)
        assert r.code == 0, r.err
        return list(json.loads(r.out)["notes"])

    past = notes("--seq", "4096")
    assert context_warning(load_model("gpt2"), 4096, "every plan") in past
    assert any("learned position table" in n and "every plan is for a table extended to 4096" in n for n in past)
    assert not any("max_position_embeddings" in n for n in notes("--seq", "1024"))

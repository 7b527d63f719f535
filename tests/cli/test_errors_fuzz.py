"""Property test of the CLI's error contract (issue 15 #22) over random command lines and random config.json
files: every run either succeeds (exit 0) or prints exactly one line, ``error: ...``, on stderr, nothing on
stdout, and exits 2. Never a traceback (an exception escaping ``main``), never exit 1.

Covers estimate (analytic and rule-of-thumb; the many-GPU, fine-tuning and saver flags too), infer, plan (small
models and GPU counts, so each search stays fast; not
``--export``, which writes files), models, gpus, formats and precision; not doctor, trace or measure (slow). Hub
ids never touch the network: the reachability probe answers "offline" and the download finds nothing in the cache.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.cli._cli_helper import Result, run_cli
from trainfit.arch import loader
from trainfit.arch.catalog import catalog_config

SETTINGS = settings(
    max_examples=80,
    deadline=None,
    derandomize=True,  # reproducible in CI; failures print the falsifying command line
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(autouse=True, scope="module")
def _offline_hub() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader, "_hub_reachable", lambda endpoint, timeout=0: False)
        try:
            import huggingface_hub
            from huggingface_hub.errors import LocalEntryNotFoundError
        except ImportError:  # pragma: no cover - huggingface_hub is a dev dependency
            yield
            return

        def not_cached(*args: Any, **kwargs: Any) -> str:
            raise LocalEntryNotFoundError("fuzz: nothing cached")

        mp.setattr(huggingface_hub, "hf_hub_download", not_cached)
        yield


def check_contract(res: Result, args: list[str]) -> None:
    assert res.code in (0, 2), f"exit {res.code} for {args!r}: {res.err}"
    assert "Traceback" not in res.err, args
    if res.code == 2:
        lines = res.err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and len(lines[0]) > len("error: "), (args, res.err)
        assert res.out == "", (args, res.out)


# -- command lines ----------------------------------------------------------------------------------------

WEIRD = st.sampled_from(
    ["", " ", "0", "-1", "-0", "1.5", "1e9", "1e400", "nan", "inf", "-inf", "abc", "0x10", "1_000", "10" * 20,
     "∞", "é", "--", "-", "None", "true", "[1]", "{}", "a" * 300, "\t"]
)  # fmt: skip
SANE_INT = st.sampled_from(["1", "2", "4", "8", "32", "128", "1024", "2048", "4096", "32000"])
BAD_INT = st.one_of(
    st.integers(-5, 70_000).map(str),
    st.sampled_from(["0", "-1", str(2**31), str(2**63), str(10**30), "3.0", "2e3"]),
    WEIRD,
)
INTS = st.one_of(SANE_INT, SANE_INT, BAD_INT)  # mostly plausible, so the success path is explored too
COUNTS = st.one_of(
    st.sampled_from(["1.3e9", "7e9", "7000000000", "1_300_000_000", "3e8"]),
    st.sampled_from(["1.5", "1e15", "0", "-7e9", "1e400"]),
    WEIRD,
)
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.sampled_from(["0.3", "0", "1", "0.99"]))
SLUGS = st.sampled_from(
    [
        "gpt2",
        "llama-3.1-8b",
        "mixtral-8x7b-v0.1",
        "deepseek-v3",
        "bert-base-uncased",
        "falcon-7b",
        "gemma-2b",
        "qwen3-30b-a3b",
        "LLAMA-3.2-1B",
        "phi-2",
    ]
)
MODELS = st.one_of(
    SLUGS,
    SLUGS,
    st.sampled_from(["llama-3.1-8bb", "org/model", "a/b/c", "./nope/config.json", "/", ".", "~",
                     "meta-llama/Llama-3.1-8B"]),
    WEIRD,
    st.text(max_size=40),
)  # fmt: skip
GPUS = st.one_of(st.sampled_from(["t4", "a100-sxm-80gb", "mi250x", "h200-sxm-141gb", "A100", "nope"]), WEIRD)
CHOICES = {
    "--precision": ["fp32", "amp-bf16", "amp-fp16", "master-bf16", "master-fp16", "pure-bf16", "fp8", "bf16"],
    "--optimizer": ["adamw", "adamw-8bit", "sgd", "sgd-momentum", "adafactor", "lion", "adam"],
    "--checkpointing": ["none", "full", "sqrt", "half"],
    "--attention": ["sdpa", "eager", "flash"],
    "--optimizer-impl": ["foreach", "fused", "for-each"],
    "--method": ["analytic", "rule-of-thumb", "nope"],
}


@st.composite
def estimate_args(draw: st.DrawFn) -> list[str]:
    args = ["estimate"]
    if draw(st.booleans()):
        args.append(draw(MODELS))
    else:  # what-if numbers: the three required ones usually present, the rest sometimes
        for flag, values, often in (
            ("--params", COUNTS, True),
            ("--hidden-size", st.one_of(st.sampled_from(["1024", "2048", "4096"]), INTS), True),
            ("--num-layers", st.one_of(st.sampled_from(["2", "24", "32"]), INTS), True),
            ("--num-heads", INTS, False),
            ("--num-kv-heads", INTS, False),
            ("--vocab-size", INTS, False),
            ("--intermediate-size", INTS, False),
        ):
            if draw(st.integers(0, 9)) < (9 if often else 3):
                args += [flag, draw(values)]
    options: list[tuple[str, st.SearchStrategy[str]]] = [
        ("--gpu", GPUS),
        ("--batch", INTS),
        ("--seq", INTS),
        ("--grad-accum", INTS),
        ("--headroom", FLOATS),
        *(
            (flag, st.one_of(st.sampled_from(values[:3]), st.sampled_from(values), WEIRD))
            for flag, values in CHOICES.items()
        ),
    ]
    for flag, values in draw(st.lists(st.sampled_from(options), max_size=4, unique_by=lambda o: o[0])):
        args += [flag, draw(values)]
    for flag in draw(st.lists(st.sampled_from(["--json", "--explain", "--modules", "-v"]), max_size=2, unique=True)):
        args.append(flag)
    return args


@st.composite
def other_args(draw: st.DrawFn) -> list[str]:
    command = draw(st.sampled_from(["models", "gpus", "formats", "precision"]))
    args = [command]
    if command == "precision":
        args += ["--gpu", draw(GPUS)]
    if draw(st.booleans()):
        args.append("--json")
    return args


@st.composite
def mangled(draw: st.DrawFn, base: st.SearchStrategy[list[str]]) -> list[str]:
    """A valid-ish command line, sometimes with a junk token, an unknown flag or a lost value."""
    args = draw(base)
    damage = draw(st.integers(0, 8))
    if damage == 1:
        args.insert(
            draw(st.integers(1, len(args))), draw(st.one_of(WEIRD, st.sampled_from(["--bogus", "-z", "--json=1"])))
        )
    elif damage == 2 and len(args) > 1:
        del args[draw(st.integers(1, len(args) - 1))]
    elif damage == 3:
        args[0] = draw(st.sampled_from(["estimat", "model", "GPUS", "help", "--help-me", "--version"]))
    return args


@SETTINGS
@given(args=mangled(st.one_of(estimate_args(), other_args())))
def test_cli_is_ok_or_one_error_line(capsys, args: list[str]) -> None:
    check_contract(run_cli(capsys, *args), args)


GOOD_PLAN_MODELS = st.sampled_from(["gpt2", "llama-3.2-1b", "qwen2.5-0.5b", "LLAMA-3.2-1B"])
PLAN_MODELS = st.one_of(GOOD_PLAN_MODELS, GOOD_PLAN_MODELS, st.sampled_from(["llama-3.1-8bb", "org/model"]), WEIRD)
# small or broken counts only (a plan over thousands of GPUs is a slow valid search, not an error path); mostly
# plausible, so the success path is explored too
GOOD_PLAN_INTS = st.sampled_from(["1", "2", "4", "8"])
PLAN_INTS = st.one_of(
    GOOD_PLAN_INTS,
    GOOD_PLAN_INTS,
    st.sampled_from(["0", "-1", "3", "3.0", "2e3", str(2**63), "1e400"]),
    WEIRD,
)
PLAN_FLOATS = st.one_of(st.sampled_from(["0.3", "0.1", "25", "2.5"]), FLOATS)
GOOD_PLAN_GPUS = st.sampled_from(["a100-sxm-80gb", "rtx-4090", "h100-sxm-80gb", "rtx-3090"])


@st.composite
def plan_args(draw: st.DrawFn) -> list[str]:
    args = ["plan", draw(PLAN_MODELS), "--gpu", draw(st.one_of(GOOD_PLAN_GPUS, GOOD_PLAN_GPUS, GPUS))]  # required
    options: list[tuple[str, st.SearchStrategy[str]]] = [
        ("--gpus", PLAN_INTS),
        ("--nodes", PLAN_INTS),
        ("--gpus-per-node", PLAN_INTS),
        ("--seq", st.one_of(st.sampled_from(["256", "1024"]), PLAN_INTS)),
        ("--global-batch", PLAN_INTS),
        ("--tokens-per-step", st.one_of(st.sampled_from(["4M", "1M", "65536", "2k"]), WEIRD)),
        ("--allow", st.one_of(st.sampled_from(["lora", "qlora", "fp8", "lora,qlora", "lora,,", "nope"]), WEIRD)),
        ("--objective", st.one_of(st.sampled_from(["fastest", "fewest-gpus", "cheapest", "slowest"]), WEIRD)),
        ("--price-per-gpu-hour", PLAN_FLOATS),
        ("--headroom", PLAN_FLOATS),
        ("--network-gbps", PLAN_FLOATS),
        ("--top", PLAN_INTS),
        ("--alloc-conf", st.one_of(st.sampled_from(["", "expandable_segments:True", "expandable_segments:maybe",
                                                    "max_split_size_mb:0", "garbage"]), WEIRD)),
    ]  # fmt: skip
    for flag, values in draw(st.lists(st.sampled_from(options), max_size=3, unique_by=lambda o: o[0])):
        args += [flag, draw(values)]
    if draw(st.booleans()):
        args.append("--json")
    return args


@settings(SETTINGS, max_examples=40)
@given(args=mangled(plan_args()))
def test_plan_is_ok_or_one_error_line(capsys, args: list[str]) -> None:
    check_contract(run_cli(capsys, *args), args)


INFER_MODELS = st.one_of(
    st.sampled_from(["gpt2", "llama-3.2-1b", "mistral-7b-v0.1", "qwen2.5-0.5b", "bert-base-uncased", "deepseek-v3"]),
    st.sampled_from(["llama-3.1-8bb", "org/model"]),
    WEIRD,
)


@st.composite
def infer_args(draw: st.DrawFn) -> list[str]:
    """``trainfit infer``: generate and paged servers, weight and cache formats, TP, the capacity search."""
    args = ["infer", draw(INFER_MODELS)]
    options: list[tuple[str, st.SearchStrategy[str]]] = [
        ("--gpu", GPUS),
        ("--batch", st.one_of(st.sampled_from(["1", "8", "64"]), BAD_INT)),
        ("--prompt", INTS),
        ("--new-tokens", st.one_of(st.sampled_from(["1", "16", "256"]), BAD_INT)),
        ("--dtype", st.one_of(st.sampled_from(["bf16", "fp16", "fp32", "fp8", "int8", "nf4", "fp4", "int3"]), WEIRD)),
        ("--kv-dtype", st.one_of(st.sampled_from(["bf16", "fp8", "fp32", "int4"]), WEIRD)),
        ("--compute-dtype", st.sampled_from(["bf16", "fp16", "fp32", "fp8"])),
        ("--cache", st.one_of(st.sampled_from(["dynamic", "static", "sliding", "paged", "ring"]), WEIRD)),
        ("--block-size", st.one_of(st.sampled_from(["16", "32"]), BAD_INT)),
        ("--attention", st.sampled_from(["sdpa", "eager", "flash"])),
        ("--gpus", PLAN_INTS),
        ("--tp", PLAN_INTS),
        ("--server", st.sampled_from(["generate", "paged", "vllm"])),
        ("--gpu-memory-utilization", FLOATS),
        ("--headroom", FLOATS),
    ]
    for flag, values in draw(st.lists(st.sampled_from(options), max_size=4, unique_by=lambda o: o[0])):
        args += [flag, draw(values)]
    flags = ["--json", "--max-batch", "--padded", "--no-double-quant", "--explain"]
    args += draw(st.lists(st.sampled_from(flags), max_size=2, unique=True))
    return args


@settings(SETTINGS, max_examples=60)
@given(args=mangled(infer_args()))
def test_infer_is_ok_or_one_error_line(capsys, args: list[str]) -> None:
    res = run_cli(capsys, *args)
    if args == ["infer"]:  # no arguments at all: the help, with click's exit status for it (no_args_is_help)
        assert res.code == 2 and "Usage" in res.out and res.err == ""
        return
    check_contract(res, args)


@st.composite
def run_flag_args(draw: st.DrawFn) -> list[str]:
    """``trainfit estimate`` with the many-GPU, fine-tuning and saver flags, valid and clashing."""
    args = ["estimate", draw(st.sampled_from(["llama-3.2-1b", "qwen2.5-0.5b", "gpt2", "mixtral-8x7b-v0.1"]))]
    options: list[tuple[str, st.SearchStrategy[str]]] = [
        ("--gpus", PLAN_INTS),
        ("--tp", PLAN_INTS),
        ("--pp", PLAN_INTS),
        ("--microbatches", PLAN_INTS),
        ("--virtual-stages", PLAN_INTS),
        ("--pp-schedule", st.sampled_from(["1f1b", "interleaved", "gpipe", "zb"])),
        ("--sharding", st.sampled_from(["none", "ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp", "zero4"])),
        ("--offload", st.sampled_from(["none", "optimizer", "optimizer+params", "params"])),
        ("--engine", st.sampled_from(["auto", "torch", "deepspeed", "megatron", "jax"])),
        ("--bucket-cap-mb", PLAN_INTS),
        ("--reduce-bucket-size", st.one_of(st.sampled_from(["5e8", "2e8"]), WEIRD)),
        ("--finetune", st.sampled_from(["full", "lora", "qlora", "freeze", "dpo"])),
        ("--lora-rank", PLAN_INTS),
        ("--lora-targets", st.sampled_from(["q_proj,v_proj", "all-linear", "c_attn", "nope", ","])),
        ("--base-dtype", st.sampled_from(["bf16", "int8", "nf4", "fp4", "int2"])),
        ("--freeze", st.sampled_from(["embeddings", "layers:0-3", "layers:9-2", "nope"])),
        ("--loss", st.sampled_from(["standard", "chunked", "chunked:4", "fused-linear", "chunked:0"])),
        ("--fp8", st.sampled_from(["none", "tensorwise", "rowwise"])),
        ("--precision", st.sampled_from(["amp-bf16", "pure-bf16", "amp-fp16", "fp32"])),
        ("--checkpointing", st.sampled_from(["none", "full", "sac", "selective"])),
        ("--gpu", GOOD_PLAN_GPUS),
    ]
    for flag, values in draw(st.lists(st.sampled_from(options), max_size=5, unique_by=lambda o: o[0])):
        args += [flag, draw(values)]
    switches = ["--sequence-parallel", "--dora", "--optimizer-in-backward", "--activation-offload", "--json",
                "--no-reshard-after-forward", "--double-quant"]  # fmt: skip
    args += draw(st.lists(st.sampled_from(switches), max_size=2, unique=True))
    return args


@settings(SETTINGS, max_examples=60)
@given(args=run_flag_args())
def test_run_flags_are_ok_or_one_error_line(capsys, args: list[str]) -> None:
    check_contract(run_cli(capsys, *args), args)


# -- config files -----------------------------------------------------------------------------------------

BASES = ["llama-3.2-1b", "gpt2", "mixtral-8x7b-v0.1", "qwen2.5-0.5b", "bert-base-uncased", "falcon-7b", "deepseek-v3"]
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 10**400]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.5, 1024.5, 2048.0, -0.0]),
    st.text(max_size=12),
    st.lists(st.integers(0, 4096), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


@st.composite
def config_files(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(st.binary(max_size=200))
    if kind == 1:
        return draw(st.text(max_size=80)).encode()
    cfg: dict[str, Any] = dict(catalog_config(draw(st.sampled_from(BASES))))
    keys = sorted(cfg)
    for key in draw(st.lists(st.sampled_from(keys), min_size=1, max_size=3, unique=True)):
        if draw(st.integers(0, 5)) == 0:
            del cfg[key]
        else:
            cfg[key] = draw(JUNK)
    if kind == 2:
        return json.dumps(draw(st.one_of(st.lists(st.integers(), max_size=3), st.integers(), st.text()))).encode()
    try:
        return json.dumps(cfg).encode()
    except ValueError:  # 10**400 etc. are fine; only NaN-like refusals land here
        return b"{}"


@SETTINGS
@given(content=config_files(), extra=st.sampled_from([[], ["--json"], ["--gpu", "t4"], ["--method", "rule-of-thumb"]]))
def test_any_config_file_is_ok_or_one_error_line(
    capsys, tmp_path_factory: pytest.TempPathFactory, content: bytes, extra: list[str]
) -> None:
    path: Path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_bytes(content)
    args = ["estimate", str(path), *extra]
    check_contract(run_cli(capsys, *args), [*args, content[:200].decode(errors="replace")])

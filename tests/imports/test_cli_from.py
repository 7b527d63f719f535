"""``trainfit estimate --from``: what the text and JSON say about the file, explicit flags over the file's values,
the CLI's Strategy equal to the library's, and one-line errors with exit status 2."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest

from tests.cli._cli_helper import run_cli
from trainfit import load_model
from trainfit.cli.estimate import STRATEGY_FLAGS, estimate_cmd, strategy_from_file

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

from trainfit.imports import import_config

DATA = Path(__file__).parent / "data"
ZERO2 = str(DATA / "ds_config_zero2.json")
ANSWERS = ("--gpus", "8", "--batch", "4", "--grad-accum", "2", "--precision", "master-bf16")


def _defaults() -> dict[str, Any]:
    return {n: p.default for n, p in inspect.signature(estimate_cmd).parameters.items() if n in STRATEGY_FLAGS}


@pytest.mark.parametrize(
    ("name", "hints"),
    [
        ("accelerate_fsdp2.yaml", {}),
        ("accelerate_fsdp2.yaml", {"grad_accum": 4}),  # accelerate's no_sync between micro-steps
        ("accelerate_deepspeed.yaml", {"batch": 2}),
        ("training_args.json", {"seq": 1024}),
        ("training_args_deepspeed.json", {"gpus": 8}),
        ("ds_config_zero3.json", {"gpus": 8, "batch": 4, "grad_accum": 2, "precision": "master-bf16"}),
    ],
)
def test_cli_builds_the_strategy_the_library_imports(name: str, hints: dict[str, Any]) -> None:
    """The CLI lays the file's values over its flags and builds through strategy_from_flags; the library builds
    the Strategy directly (Draft.finish). Both must be the same run."""
    spec = load_model("llama-3.1-8b")
    flags = {**_defaults(), **hints}
    _, cli_strategy, run = strategy_from_file(spec, str(DATA / name), flags, frozenset(hints))
    library = import_config(
        DATA / name,
        gpus=hints.get("gpus"),
        micro_batch=hints.get("batch"),
        grad_accum=hints.get("grad_accum"),
        precision=hints.get("precision"),
        seq_len=hints.get("seq", 2048),
        hidden_size=spec.hidden_size,
    )
    assert cli_strategy == library.strategy
    assert run.used == library.used


def test_text_output_says_what_was_used_and_ignored(capsys: pytest.CaptureFixture[str]) -> None:
    r = run_cli(capsys, "estimate", "llama-3.1-8b", "--from", ZERO2, *ANSWERS)
    assert r.code == 0, r.err
    assert "from ds_config_zero2.json (deepspeed):" in r.out
    assert "used    zero_optimization.stage=2 → --sharding zero2" in r.out
    assert 'used    train_micro_batch_size_per_gpu="auto" → --batch 4 (from --batch)' in r.out
    assert "ignored zero_optimization.reduce_scatter=true" in r.out
    assert "not in the file (defaults): --seq 2048" in r.out
    assert "sharding zero2" in r.out  # the report itself follows


def test_json_has_the_imported_settings_and_the_file_strategy(capsys: pytest.CaptureFixture[str]) -> None:
    r = run_cli(capsys, "estimate", "llama-3.1-8b", "--from", ZERO2, *ANSWERS, "--json")
    assert r.code == 0, r.err
    out = json.loads(r.out)
    imp = out["imported"]
    assert imp["kind"] == "deepspeed" and imp["source"] == "ds_config_zero2.json"
    assert {"key": "zero_optimization.stage", "value": "2", "meaning": "--sharding zero2"} in imp["used"]
    assert any(i["key"] == "scheduler" for i in imp["ignored"])
    plain = run_cli(capsys, "estimate", "llama-3.1-8b", "--gpus", "8", "--batch", "4", "--grad-accum", "2",
                    "--precision", "master-bf16", "--sharding", "zero2", "--offload", "optimizer",
                    "--reduce-bucket-size", "2e8", "--json")  # fmt: skip
    expected = json.loads(plain.out)
    # the file also sets allgather_bucket_size 2e8 and overlap_comm true (no flags): only those may differ
    assert out["strategy"]["sharding"] == expected["strategy"]["sharding"] == "zero2"
    assert out["strategy"]["micro_batch"] == 4 and out["strategy"]["precision"] == "master-bf16"
    assert "imported" not in expected


def test_explicit_flags_override_the_file(capsys: pytest.CaptureFixture[str]) -> None:
    r = run_cli(capsys, "estimate", "llama-3.1-8b", "--from", str(DATA / "accelerate_fsdp2.yaml"),
                "--checkpointing", "none", "--no-reshard-after-forward", "--json")  # fmt: skip
    assert r.code == 0, r.err
    s = json.loads(r.out)["strategy"]
    assert s["checkpointing"] == "none" and s["sharding"] == "fsdp"
    text = run_cli(capsys, "estimate", "llama-3.1-8b", "--from", str(DATA / "accelerate_fsdp2.yaml"),
                   "--checkpointing", "none")  # fmt: skip
    assert "overridden by flags: --checkpointing none" in text.out


def test_accelerate_fsdp2_without_reshard_is_estimated_as_the_flag(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``fsdp_reshard_after_forward: false`` (as ``accelerate config`` writes it) is FSDP2's setting kept off: the run
    is ``--no-reshard-after-forward``'s, byte for byte, and needs more than the same file with ``true``."""
    path = tmp_path / "kept.yaml"
    text = (DATA / "accelerate_fsdp2.yaml").read_text()
    assert "fsdp_reshard_after_forward: true" in text
    path.write_text(text.replace("fsdp_reshard_after_forward: true", "fsdp_reshard_after_forward: false"))
    gpu = ("--gpu", "a100-sxm-80gb")
    kept = json.loads(run_cli(capsys, "estimate", "llama-3.1-8b", "--from", str(path), *gpu, "--json").out)
    assert kept["strategy"]["reshard_after_forward"] is False
    used = {"key": "fsdp_config.fsdp_reshard_after_forward", "value": "false", "meaning": "--no-reshard-after-forward"}
    assert used in kept["imported"]["used"]
    # the file's settings as flags: 8 GPUs, FSDP2, amp-bf16, full checkpointing (accelerate_fsdp2.yaml)
    flags = ("--gpus", "8", "--sharding", "fsdp", "--precision", "amp-bf16", "--checkpointing", "full")
    plain = json.loads(run_cli(capsys, "estimate", "llama-3.1-8b", *flags, "--no-reshard-after-forward", *gpu,
                               "--json").out)  # fmt: skip
    assert kept["required_bytes"] == plain["required_bytes"] and kept["peak_bytes"] == plain["peak_bytes"]
    resharded = json.loads(run_cli(capsys, "estimate", "llama-3.1-8b", "--from", str(DATA / "accelerate_fsdp2.yaml"),
                                   *gpu, "--json").out)  # fmt: skip
    assert resharded["strategy"]["reshard_after_forward"] is True
    assert kept["peak_bytes"] > resharded["peak_bytes"]


@pytest.mark.parametrize(
    ("content", "suffix", "match"),
    [
        (None, ".json", "no such file"),
        ("{not json", ".json", "not valid JSON"),
        ("distributed_type: [x\n", ".yaml", "accelerate cannot load it"),
        ('{"zero_optimization": {"stage": 9}, "train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, '
         '"gradient_accumulation_steps": 8}', ".json", "DeepSpeed refuses it"),
        ('{"output_dir": "x", "optim": "rmsprop"}', ".json", "optim 'rmsprop'"),
        ('{"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}', ".json", "give --batch"),
    ],
)  # fmt: skip
def test_errors_are_one_line_exit_2(
    content: str | None, suffix: str, match: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / f"cfg{suffix}"
    if content is not None:
        path.write_text(content)
    r = run_cli(capsys, "estimate", "gpt2", "--from", str(path))
    assert r.code == 2
    lines = [x for x in r.err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and match in lines[0], r.err
    assert "Traceback" not in r.err


def test_accumulating_accelerate_fsdp_runs_no_sync_unless_the_flag_says(capsys: pytest.CaptureFixture[str]) -> None:
    args = ("estimate", "llama-3.1-8b", "--from", str(DATA / "accelerate_fsdp2.yaml"), "--grad-accum", "4")
    text = run_cli(capsys, *args)
    assert text.code == 0, text.err
    assert "used    GradientAccumulationPlugin.sync_each_batch=false → --no-sync-each-batch" in text.out
    synced = run_cli(capsys, *args, "--sync-each-batch", "--json")
    no_sync = run_cli(capsys, *args, "--json")
    assert json.loads(synced.out)["strategy"]["sync_each_batch"] is True
    assert json.loads(no_sync.out)["strategy"]["sync_each_batch"] is False
    # the kept unsharded gradients between micro-steps cost memory that a reduce-scatter every micro-step frees
    assert json.loads(no_sync.out)["peak_bytes"] > json.loads(synced.out)["peak_bytes"]


@pytest.mark.parametrize(
    ("name", "answers"),
    [
        ("ds_config_zero2.json", ANSWERS),
        ("training_args_deepspeed.json", ("--gpus", "8")),  # names ds_config_zero3.json
        ("accelerate_deepspeed.yaml", ("--batch", "2")),
    ],
)
def test_json_mode_stdout_is_only_the_json(name: str, answers: tuple[str, ...]) -> None:
    """``--from`` a DeepSpeed config in a fresh process: DeepSpeed's logger, made at its import with a handler on
    the stdout of that moment (deepspeed/utils/logging.py ``LoggerFactory.create_logger``), warns "Setting
    accelerator to CPU" on a machine without a GPU; with ``--json`` that line went before the JSON. The libraries'
    output goes to stderr, and stdout parses as JSON."""
    import os
    import subprocess
    import sys

    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run(
        [sys.executable, "-m", "trainfit.cli.app", "estimate", "llama-3.1-8b", "--from", str(DATA / name),
         *answers, "--json"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["imported"]["source"] == name
    assert "Setting accelerator to CPU" not in res.stdout
    # bitsandbytes is imported before transformers/torchao, without the Hugging Face kernel hub (trace/_deps.py
    # import_bitsandbytes_offline; on a CPU with AVX512-BF16 its import otherwise asks the hub and logs the refusal)
    assert "kernels-community" not in res.stderr, res.stderr


def _documented_commands() -> list[list[str]]:
    """The ``trainfit estimate`` lines of docs/imports.md's first code block, as argument lists."""
    import shlex

    doc = (Path(__file__).resolve().parents[2] / "docs" / "imports.md").read_text()
    block = doc.split("```", 2)[1]
    return [shlex.split(line)[1:] for line in block.splitlines() if line.startswith("trainfit estimate ")]


@pytest.mark.parametrize("argv", _documented_commands(), ids=lambda a: a[a.index("--from") + 1])
def test_documented_commands_run_on_the_test_data(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/imports.md's commands, as written, in tests/imports/data (the files they name): each exits 0 and
    ``--json`` prints JSON naming the file."""
    monkeypatch.chdir(DATA)
    r = run_cli(capsys, *argv)
    assert r.code == 0, r.err
    name = argv[argv.index("--from") + 1]
    if "--json" in argv:
        assert json.loads(r.out)["imported"]["source"] == name
    else:
        assert f"from {name} (" in r.out


def test_documented_commands_cover_each_kind_and_the_paged_optimizer_refusal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The doc shows a DeepSpeed, an accelerate and two TrainingArguments files, and says why training_args.json
    (paged 8-bit AdamW, modelled on one GPU) takes no ``--gpus``: with ``--gpus 4`` it is one line, exit 2."""
    names = [a[a.index("--from") + 1] for a in _documented_commands()]
    assert names == ["ds_config_zero3.json", "accelerate_fsdp2.yaml", "training_args.json",
                     "training_args_deepspeed.json"]  # fmt: skip
    r = run_cli(capsys, "estimate", "llama-3.1-8b", "--from", str(DATA / "training_args.json"), "--gpus", "4")
    assert r.code == 2 and "--paged-optimizer" in r.err and r.err.count("\n") == 1


def test_a_files_setting_for_another_framework_is_not_applied_and_said_so(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A TrainingArguments JSON with a DeepSpeed ZeRO-3 config and ``ddp_bucket_cap_mb`` (a DDP setting the Trainer
    does not use under DeepSpeed): the bucket is not applied — the run is estimated, where the library refuses a
    non-default ``bucket_cap_mb`` outside torch DDP — and the ignored list says why."""
    args = json.loads((DATA / "training_args_deepspeed.json").read_text())
    path = tmp_path / "training_args.json"
    path.write_text(json.dumps(args | {"ddp_bucket_cap_mb": 50, "deepspeed": ZERO2.replace("zero2", "zero3")}))
    r = run_cli(capsys, "estimate", "llama-3.1-8b", "--from", str(path), "--gpus", "8", "--json")
    assert r.code == 0, r.err
    out = json.loads(r.out)
    assert out["strategy"]["sharding"] == "zero3"
    ignored = {s["key"]: s["meaning"] for s in out["imported"]["ignored"]}
    assert "torch DDP's option" in ignored["(bucket_cap_mb)"]

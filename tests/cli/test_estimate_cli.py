"""The `trainfit estimate` / `models` / `gpus` contract: JSON keys, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from trainfit.cli.app import app

runner = CliRunner()


def run(*args: str) -> tuple[int, str, str]:
    res = runner.invoke(app, list(args))
    return res.exit_code, res.stdout, res.stderr


def run_main(*args: str) -> subprocess.CompletedProcess[str]:
    """Through the real console entry point (error policy of trainfit.cli.app.main)."""
    return subprocess.run([sys.executable, "-m", "trainfit.cli.app", *args], capture_output=True, text=True)


def test_estimate_json_has_contract_keys() -> None:
    code, out, _ = run(
        "estimate",
        "llama-3.1-8b",
        "--gpu",
        "a100-sxm-80gb",
        "--batch",
        "4",
        "--seq",
        "2048",
        "--precision",
        "amp-bf16",
        "--json",
    )
    assert code == 0
    data = json.loads(out)
    for key in (
        "schema_version",
        "method",
        "params",
        "peak_bytes",
        "phase",
        "components",
        "fits",
        "headroom_bytes",
        "max_micro_batch",
    ):
        assert key in data
    assert data["params"] == 8_030_261_248
    assert data["peak_bytes"] == sum(data["components"].values())
    assert data["fits"] is False  # 16 B/param of AdamW AMP states alone exceed 80 GiB
    assert data["phase"] in ("forward", "backward", "optimizer-step")


def test_estimate_small_model_fits_and_batch_search() -> None:
    code, out, _ = run("estimate", "qwen2.5-0.5b", "--gpu", "h100-sxm-80gb", "--seq", "1024", "--json")
    data = json.loads(out)
    assert code == 0 and data["fits"] is True and data["max_micro_batch"] >= 1
    # The reported max batch fits and the next one does not.
    ok = json.loads(
        run(
            "estimate",
            "qwen2.5-0.5b",
            "--gpu",
            "h100-sxm-80gb",
            "--seq",
            "1024",
            "--json",
            "--batch",
            str(data["max_micro_batch"]),
        )[1]
    )
    over = json.loads(
        run(
            "estimate",
            "qwen2.5-0.5b",
            "--gpu",
            "h100-sxm-80gb",
            "--seq",
            "1024",
            "--json",
            "--batch",
            str(data["max_micro_batch"] + 1),
        )[1]
    )
    assert ok["fits"] and not over["fits"]


def test_rule_of_thumb_json_range() -> None:
    code, out, _ = run(
        "estimate",
        "--params",
        "1.3e9",
        "--hidden-size",
        "2048",
        "--num-layers",
        "24",
        "--batch",
        "4",
        "--seq",
        "1024",
        "--method",
        "rule-of-thumb",
        "--json",
    )
    data = json.loads(out)
    assert code == 0
    assert data["low_bytes"] < data["peak_bytes"] + 1.5e9 < data["high_bytes"]
    assert round((data["peak_bytes"] + 1.5e9) / 1e9) == 20


def test_table_output_mentions_gib_and_peak() -> None:
    code, out, _ = run("estimate", "gpt2", "--batch", "2", "--seq", "512", "--gpu", "rtx-4090")
    assert code == 0
    assert "GiB" in out and "Peak allocated" in out and "rule of thumb" in out


def test_local_config_path(tmp_path: Path) -> None:
    src = Path(__file__).parents[1] / "fixtures" / "configs" / "tiny-phi3.json"
    (tmp_path / "config.json").write_text(src.read_text())
    code, out, _ = run("estimate", str(tmp_path), "--json")
    assert code == 0 and json.loads(out)["model"]["model_type"] == "phi3"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["estimate", "llama-3.1-8bb"], "Did you mean"),
        (["estimate", "gpt2", "--gpu", "a100"], "a100-"),
        (["estimate", "gpt2", "--batch", "0"], "batch"),
        (["estimate", "gpt2", "--seq", "-5"], "seq"),
        (["estimate", "gpt2", "--precision", "fp8"], "precision"),
        (["estimate", "gpt2", "--headroom", "1.5"], "headroom"),
        (["estimate", "--params", "abc", "--hidden-size", "64", "--num-layers", "2"], "--params"),
        (["estimate"], "MODEL"),
        (["estimate", "./nope/config.json"], "no such file"),
        (["estimate", "gpt2", "--torch-version", "latest"], "--torch-version"),
        (["estimate", "gpt2", "--torch-version", "2.4"], "from torch 2.9 on"),
        (["estimate", "gpt2", "--cuda-version", "latest"], "--cuda-version"),
        (["estimate", "gpt2", "--cuda-version", "10.2"], "11.0 to 13.x"),
        (["estimate", "gpt2", "--gpu", "h100-sxm-80gb", "--cuda-version", "11.6"], "needs CUDA 11.8"),
    ],
)
def test_bad_input_is_one_line_exit_2(args: list[str], needle: str) -> None:
    res = run_main(*args)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], res.stderr
    assert res.stdout == ""


def test_missing_key_and_unsupported_arch(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}))
    res = run_main("estimate", str(bad))
    assert res.returncode == 2 and "num_hidden_layers" in res.stderr
    bad.write_text(json.dumps({"model_type": "t5", "d_model": 64}))
    res = run_main("estimate", str(bad))
    assert res.returncode == 2 and "not supported" in res.stderr


def test_warnings_for_long_seq_and_non_native_bf16() -> None:
    res = run_main("estimate", "gpt2", "--seq", "4096", "--gpu", "v100-sxm2-32gb", "--precision", "amp-bf16", "--json")
    assert res.returncode == 0
    assert "max_position_embeddings" in res.stderr and "amp-fp16" in res.stderr
    data = json.loads(res.stdout)
    assert len(data["warnings"]) == 2


def test_hub_id_fails_cleanly_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "trainfit.cli.app", "estimate", "some-org/some-model"],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"},
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "catalog" in res.stderr


def test_models_and_gpus_json() -> None:
    code, out, _ = run("models", "--json")
    assert code == 0 and any(m["id"] == "llama-3.1-8b" for m in json.loads(out)["models"])
    code, out, _ = run("gpus", "--json")
    assert code == 0 and any(g["id"] == "h100-sxm-80gb" for g in json.loads(out)["gpus"])


@pytest.mark.parametrize(
    ("model", "precision", "release", "warned"),
    [
        ("llama-3.2-1b", "fp32", None, True),
        ("llama-3.2-1b", "amp-bf16", None, False),
        ("falcon-7b", "amp-bf16", (5, 24), True),  # FalconAttention called SDPA itself (one k/v head)
        ("falcon-7b", "amp-bf16", (5, 25), False),  # the shared interface repeats k/v: memory-efficient
    ],
)
def test_warns_when_sdpa_falls_back_to_the_math_kernel(
    model: str, precision: str, release: Any, warned: bool, transformers_release: Any
) -> None:
    if release is not None:
        transformers_release(release)
    code, out, _ = run("estimate", model, "--precision", precision, "--json")
    assert code == 0
    warnings = json.loads(out)["warnings"]
    assert any("math kernel" in w for w in warnings) is warned


def test_says_when_model_states_alone_do_not_fit() -> None:
    code, out, _ = run("estimate", "llama-3.1-8b", "--gpu", "a100-sxm-80gb", "--precision", "amp-bf16")
    assert code == 0
    text = " ".join(out.split())
    assert "Not even micro-batch 1 fits." in text and "model states alone" in text
    code, out, _ = run("estimate", "gpt2", "--gpu", "a100-sxm-80gb")
    assert code == 0 and "model states alone" not in " ".join(out.split())


def test_rule_of_thumb_with_a_gpu_that_does_not_fit() -> None:
    code, out, _ = run("estimate", "llama-3.1-70b", "--gpu", "a100-sxm-80gb", "--method", "rule-of-thumb")
    assert code == 0 and "Not even micro-batch 1 fits." in " ".join(out.split())


def test_says_when_only_sharding_would_help() -> None:
    code, out, _ = run(
        "estimate", "llama-3.1-70b", "--gpu", "a100-sxm-80gb", "--precision", "pure-bf16", "--optimizer", "adamw-8bit"
    )
    assert code == 0 and "needs sharding" in " ".join(out.split())


def test_checked_fixes_replace_the_unchecked_example_flags() -> None:
    """The model-states diagnosis names example flags (unchecked) only when no checked fix is printed: with the
    planner's fixes the example goes; with --no-fixes it stays. The JSON suggestion keeps its flags either way."""
    args = ("estimate", "llama-3.1-8b", "--gpu", "a100-sxm-80gb", "--batch", "4", "--precision", "amp-bf16")
    example = "A leaner precision recipe or optimizer can (e.g. --precision pure-bf16, --optimizer adamw-8bit)."
    code, out, _ = run(*args)
    text = " ".join(out.split())
    assert code == 0 and "Checked fixes" in text and "no batch size or checkpointing can help." in text
    assert example not in text and "(e.g." not in text
    code, out, _ = run(*args, "--no-fixes")
    assert code == 0 and example in " ".join(out.split()) and "Checked fixes" not in out
    code, out, _ = run(*args, "--json")
    leaner = [s for s in json.loads(out)["suggestions"] if s["kind"] == "leaner-states"]
    assert code == 0 and leaner and leaner[0]["flags"] == ["--precision pure-bf16", "--optimizer adamw-8bit"]


def test_math_kernel_warning_gives_no_advice_already_taken(transformers_release: Any) -> None:
    transformers_release((5, 24))  # Falcon's own SDPA call, before transformers 5.25
    code, out, _ = run("estimate", "falcon-7b", "--checkpointing", "full", "--json")
    assert code == 0
    (warning,) = [w for w in json.loads(out)["warnings"] if "math kernel" in w]
    assert "without enable_gqa" in warning and "--checkpointing full" not in warning


def test_torch_version_decides_the_workspaces() -> None:
    """torch 2.13 shares the cuBLAS workspace with cuBLASLt and gives Blackwell 32 MiB; 2.11 keeps a separate 1 MiB
    Lt workspace and gave Blackwell 8 MiB + 128 KiB (trainfit.allocator.workspaces). The JSON says which release."""
    from trainfit.allocator.workspaces import training_workspaces

    def workspaces(*extra: str) -> tuple[str, int]:
        code, out, err = run("estimate", "qwen2.5-0.5b", "--gpu", "b200-sxm-180gb", "--json", *extra)
        assert code == 0, err
        data = json.loads(out)
        return data["torch_version"], data["components"]["workspaces"]

    for version in ("2.11", "2.13"):
        expected = sum(w.size_bytes for w in training_workspaces((10, 0), torch_version=(2, int(version[2:]))))
        assert workspaces("--torch-version", version) == (version, expected)
    assert workspaces() == workspaces("--torch-version", "2.13")
    assert workspaces("--torch-version", "2.11")[1] == 2 * (8 * 2**20 + 128 * 1024) + 2**20


def test_cuda_version_decides_the_context_and_is_recorded() -> None:
    """Before CUDA 11.7 every module loads eagerly (trainfit.overhead.EAGER_MODULES_BYTES more); the JSON says
    which release was assumed and the basis why."""
    from trainfit.overhead import EAGER_MODULES_BYTES

    def context(*extra: str) -> tuple[str, int, str]:
        code, out, err = run("estimate", "gpt2", "--gpu", "a100-sxm-80gb", "--json", *extra)
        assert code == 0, err
        data = json.loads(out)
        return data["cuda_version"], data["overhead"]["cuda_context_bytes"], data["overhead"]["basis"]

    default, new, old = context(), context("--cuda-version", "13.0"), context("--cuda-version", "11.6")
    assert default == new and default[0] == "13.0"
    assert old[0] == "11.6" and old[1] - default[1] == EAGER_MODULES_BYTES and "eagerly" in old[2]

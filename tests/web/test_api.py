"""The web API answers with the CLI's JSON for the same inputs, and refuses bad input with the CLI's line.

Every expected value here comes from running the CLI in-process (``trainfit.cli.app.main``) on the same
inputs: no number is written down. Trace jobs are exercised with a stand-in computation (the real trace is
tested under tests/trace); the job plumbing — start, progress, cancel, the result — is what is tested here.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from starlette.testclient import TestClient

from trainfit.arch.catalog import catalog_config
from trainfit.cli.app import main
from trainfit.web import app as web_app
from trainfit.web.app import MAX_BODY_BYTES, create_app
from trainfit.web.jobs import JobCancelled, Jobs, JobState
from trainfit.web.options import MAX_CONFIG_BYTES, estimate_options, infer_options, plan_options


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(create_app())


def cli_json(args: list[str], capsys: pytest.CaptureFixture[str]) -> Any:
    capsys.readouterr()
    main([*args, "--json"])
    return json.loads(capsys.readouterr().out)


def cli_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ")
    return err.removeprefix("error: ")


def to_args(options: dict[str, Any]) -> list[str]:
    """CLI flags for an API request (``{"grad_accum": 2}`` -> ``--grad-accum 2``)."""
    args: list[str] = []
    for key, value in options.items():
        if key == "model":
            args.insert(0, str(value))
        elif value is True:
            args.append("--" + key.replace("_", "-"))
        elif value is False:
            args.append("--no-" + key.replace("_", "-"))
        else:
            args += ["--" + key.replace("_", "-"), str(value)]
    return args


ESTIMATES: list[dict[str, Any]] = [
    {"model": "gpt2"},
    {"model": "llama-3.1-8b", "gpu": "a100-sxm-80gb", "batch": 2, "seq": 2048, "checkpointing": "full"},
    {"model": "qwen2.5-0.5b", "gpu": "t4", "precision": "amp-fp16", "optimizer": "adamw-8bit", "grad_accum": 4},
    {"model": "llama-3.1-8b", "gpu": "rtx-4090", "finetune": "qlora", "lora_rank": 64, "lora_targets": "q_proj,v_proj"},
    {"model": "llama-3.1-70b", "gpu": "h100-sxm-80gb", "gpus": 16, "sharding": "fsdp", "checkpointing": "full"},
    {"model": "llama-3.1-70b", "gpu": "h100-sxm-80gb", "gpus": 16, "tp": 4, "pp": 4, "microbatches": 8},
    {"model": "tinyllama-1.1b", "gpu": "l4", "method": "rule-of-thumb"},
    {"model": "qwen2.5-0.5b", "gpu": "l4", "alloc_conf": "expandable_segments:True", "segments": True},
    {"params": "1.3e9", "hidden_size": 2048, "num_layers": 24, "batch": 4, "seq": 1024},
    # Every option group reaches the Strategy (one builder for the CLI and the page: cli.estimate.strategy_from_flags).
    {"model": "llama-3.2-1b", "gpu": "l4", "loss": "chunked:4", "activation_offload": True, "optimizer": "paged-adamw"},
    {"model": "bert-base-uncased", "head": "seq-cls", "num_labels": 3, "precision": "fp32"},
    {"model": "llama-3.2-1b", "finetune": "freeze", "freeze": "embeddings,layers:0-7", "optimizer_in_backward": True},
    {"model": "qwen2.5-1.5b", "gpu": "t4", "precision": "amp-fp16", "seq": 2048, "batch": 8, "fixes": False},
    # the releases on the GPU machine and the process the run starts in (the CLI's --torch-version ... --after)
    {
        "model": "llama-3.2-1b",
        "gpu": "h100-sxm-80gb",
        "torch_version": "2.11",
        "cuda_version": "12.8",
        "build": "on-device",
        "warm_up": True,
        "after": "qwen2.5-0.5b -b 4",
    },
    # --host-memory-gib: the verdict holds the run's host memory per node to it, the fixes keep within it
    {"model": "llama-3.2-3b", "gpu": "rtx-4090", "seq": 1024, "batch": 8, "host_memory_gib": 100},
    # fixes searched under the releases (CUDA 11.6: the eager-loading context)
    {
        "model": "qwen2.5-1.5b",
        "gpu": "t4",
        "precision": "amp-fp16",
        "batch": 8,
        "torch_version": "2.11",
        "cuda_version": "11.6",
    },
]


@pytest.mark.parametrize("options", ESTIMATES, ids=lambda o: " ".join(to_args(o)))
def test_estimate_equals_the_cli_json(
    client: TestClient, options: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    expected = cli_json(["estimate", *to_args(options)], capsys)
    posted = client.post("/api/estimate", json=options)
    assert posted.status_code == 200, posted.text
    assert posted.json() == expected
    got = client.get("/api/estimate", params={k: str(v) for k, v in options.items()})  # the query-string form
    assert got.json() == expected


INFERS: list[dict[str, Any]] = [
    {"model": "gpt2", "prompt": 512, "new_tokens": 64, "gpu": "t4"},
    {"model": "llama-3.1-8b", "batch": 8, "gpu": "l4", "kv_dtype": "fp8"},
    {"model": "qwen2.5-7b", "gpu": "h100-sxm-80gb", "server": "paged", "gpu_memory_utilization": 0.85},
    {"model": "llama-3.1-70b", "gpus": 4, "tp": 4, "gpu": "h100-sxm-80gb", "dtype": "fp8"},
    {"model": "gpt2", "prompt": 256, "new_tokens": 16, "gpu": "t4", "simulate_allocator": True},
    {"model": "gpt2", "gpu": "t4"},  # the default prompt: what GPT-2's 1024-token context leaves after 256 new
    # the 4-bit base's knobs and left-padded prompts: the API dropped them before 2026-12-05 (its own setup builder)
    {
        "model": "mistral-7b-v0.1",
        "dtype": "nf4",
        "double_quant": False,
        "compute_dtype": "fp16",
        "padded": True,
        "batch": 4,
    },
]


@pytest.mark.parametrize("options", INFERS, ids=lambda o: " ".join(to_args(o)))
def test_infer_equals_the_cli_json(
    client: TestClient, options: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    expected = cli_json(["infer", *to_args(options)], capsys)
    got = client.post("/api/infer", json=options)
    assert got.status_code == 200, got.text
    assert got.json() == expected


# Qwen3 8B on one A100 80GB, one 6144-token sequence: by default one plan fits only with expandable segments
# (tests/planner/test_alloc_plan.py); given the setting, every estimate simulates it.
PLAN_ALLOC = {
    "model": "qwen3-8b",
    "gpu": "a100-sxm-80gb",
    "gpus": 1,
    "seq": 6144,
    "global_batch": 1,
    "top": 3,
    "alloc_conf": "expandable_segments:True",
}


QWEN_4090 = {"model": "qwen2.5-0.5b", "gpu": "rtx-4090", "seq": 1024, "global_batch": 8}


@pytest.mark.parametrize(
    "options",
    [
        {"model": "qwen2.5-0.5b", "gpu": "rtx-4090", "seq": 1024, "global_batch": 8},
        {"model": "mistral-7b-v0.1", "gpu": "rtx-4090", "allow": "lora,qlora", "global_batch": 16, "top": 3},
        PLAN_ALLOC,
        {
            **{"model": "llama-3.2-1b", "gpu": "a100-sxm-80gb", "gpus": 1, "global_batch": 8, "top": 2},
            **{"torch_version": "2.11", "cuda_version": "11.6", "warm_up": True, "after": "qwen2.5-0.5b -b 4"},
        },
        {"model": "llama-3.2-3b", "gpu": "rtx-4090", "gpus": 2, "seq": 1024, "global_batch": 8, "host_memory_gib": 16},
        # the user's run as the baseline: trainfit estimate's run fields (the web estimate form's)
        {**QWEN_4090, "top": 3, "precision": "fp32", "checkpointing": "full", "batch": 2, "attention": "eager"},
        {**QWEN_4090, "top": 3, "finetune": "lora", "lora_rank": 8, "base_dtype": "int8", "double_quant": False},
    ],
    ids=["full", "lora", "alloc-conf", "releases-history", "host-memory", "baseline", "baseline-lora"],
)
def test_plan_equals_the_cli_json(
    client: TestClient, options: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    expected = cli_json(["plan", *to_args(options)], capsys)
    got = client.post("/api/plan", json=options)
    assert got.status_code == 200, got.text
    assert got.json() == expected


PLAN = {"model": "qwen2.5-0.5b", "gpu": "rtx-4090", "seq": 1024, "global_batch": 8}


def test_plan_export_equals_the_files_write_export_writes(client: TestClient, tmp_path: Path) -> None:
    """Each ranked plan's /api/plan/export files are, name for name and byte for byte, what write_export writes
    (``trainfit plan --export DIR`` for the top plan) for that plan."""
    from trainfit.arch import load_model
    from trainfit.export import export_plan, write_export
    from trainfit.planner.api import plan
    from trainfit.report.plan import export_check

    result = plan(load_model("qwen2.5-0.5b"), "rtx-4090", seq=1024, global_batch=8)
    ranked = client.post("/api/plan", json=PLAN).json()["plans"]
    assert len(result.plans) == len(ranked) >= 2
    for rank, p in enumerate(result.plans, 1):
        got = client.post("/api/plan/export", json={**PLAN, "rank": rank})
        assert got.status_code == 200, got.text
        body = got.json()
        assert body["schema_version"] == 1 and body["rank"] == rank
        # with the plan's GPU and headroom: a checkpointing the files cannot say has the files' run estimated
        export = export_plan(
            load_model("qwen2.5-0.5b"), p.strategy, alloc_conf=p.alloc_conf, **export_check(result, "rtx-4090", 0.3)
        )
        written = write_export(export, tmp_path / str(rank))
        assert list(body["files"]) == [path.name for path in written]
        assert body["files"] == {path.name: path.read_text(encoding="utf-8") for path in written}
    top = client.post("/api/plan/export", json=PLAN).json()
    assert top == client.post("/api/plan/export", json={**PLAN, "rank": 1}).json(), "rank defaults to 1"


@pytest.mark.parametrize("options", [PLAN, PLAN_ALLOC], ids=["default", "alloc-conf"])
def test_plan_export_of_the_cli(
    client: TestClient, options: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The top plan's files equal those `trainfit plan --export DIR` writes (with an allocator setting too: launch.sh
    exports it)."""
    out = cli_json(["plan", *to_args(options), "--export", str(tmp_path)], capsys)
    files = client.post("/api/plan/export", json=options).json()["files"]
    assert [Path(p).name for p in out["exported"]] == list(files)
    assert {name: (tmp_path / name).read_text(encoding="utf-8") for name in files} == files
    assert out["plans"][0]["alloc_conf"] == options.get("alloc_conf")


def test_plan_export_carries_the_second_chance_allocator(client: TestClient) -> None:
    """A plan that fits only with expandable segments (default allocator asked for) exports them in launch.sh."""
    body = {**PLAN_ALLOC, "alloc_conf": "backend:native", "top": 5}  # PyTorch's defaults, whatever the server's env
    plans = client.post("/api/plan", json=body).json()["plans"]
    grown = [rank for rank, p in enumerate(plans, 1) if p["alloc_conf"] == "expandable_segments:True"]
    assert grown, [p["changes"] for p in plans]
    for rank in range(1, len(plans) + 1):
        launch = client.post("/api/plan/export", json={**body, "rank": rank}).json()["files"]["launch.sh"]
        assert ("export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in launch) == (rank in grown)


def test_the_pages_baseline_fields_are_the_plans() -> None:
    """The Plans tab sends the form's run as trainfit plan's baseline: the same fields as ``BASELINE_FLAGS``."""
    import re

    from trainfit.cli.plan import BASELINE_FLAGS

    js = (Path(web_app.__file__).parent / "static" / "app.js").read_text(encoding="utf-8")
    found = re.search(r"const BASELINE_FIELDS = \[(.*?)\];", js, re.S)
    assert found is not None
    assert tuple(re.findall(r'"(\w+)"', found.group(1))) == BASELINE_FLAGS
    assert set(BASELINE_FLAGS) <= set(plan_options())


@pytest.mark.parametrize(
    "options",
    [
        {**PLAN, "checkpointing": "sac", "attention": "eager"},
        {**PLAN, "base_dtype": "nf4"},
        {**PLAN, "reshard_after_forward": True},
    ],
    ids=["sac-eager", "base-dtype-full", "fsdp-flag"],
)
def test_plan_baseline_errors_are_the_cli_line(
    client: TestClient, options: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """A baseline the estimate refuses: the CLI's one line (a flag given explicitly, even at its default, is a flag
    given: ``reshard_after_forward`` for a run without FSDP2)."""
    expected = cli_error(["plan", *to_args(options)], capsys)
    got = client.post("/api/plan", json=options)
    assert got.status_code == 400
    assert got.json() == {"error": expected}


@pytest.mark.parametrize(
    "options",
    [{**PLAN, "alloc_conf": "expandable_segments:maybe"}, {**PLAN, "alloc_conf": "max_split_size_mb:-3"}],
    ids=lambda o: o["alloc_conf"],
)
def test_plan_alloc_conf_errors_are_the_cli_line(
    client: TestClient, options: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    expected = cli_error(["plan", *to_args(options)], capsys)
    for path in ("/api/plan", "/api/plan/export"):
        got = client.post(path, json=options)
        assert got.status_code == 400
        assert got.json() == {"error": expected}


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({**PLAN, "rank": 99}, 400, "rank 99 is out of range"),
        ({**PLAN, "rank": 0}, 400, "rank 0 is out of range"),
        ({**PLAN, "rank": "first"}, 400, "rank must be a whole number"),
        ({**PLAN, "rank": True}, 400, "rank must be a whole number"),
        ({"model": "llama-3.1-70b", "gpu": "t4", "gpus": 1, "global_batch": 8}, 400, "nothing fits"),
        ({"model": "qwen2.5-0.5b"}, 400, "--gpu is required"),
        ({**PLAN, "export": "/tmp/x"}, 400, "no such option: --export"),
    ],
    ids=["rank-high", "rank-zero", "rank-text", "rank-bool", "nothing-fits", "no-gpu", "no-export-dir"],
)
def test_plan_export_errors(client: TestClient, body: dict[str, Any], status: int, says: str) -> None:
    got = client.post("/api/plan/export", json=body)
    assert got.status_code == status, got.text
    message = got.json()["error"]
    assert says in message and "\n" not in message


def test_plan_export_is_post_only(client: TestClient) -> None:
    assert client.get("/api/plan/export", params=PLAN).status_code == 405


@pytest.mark.parametrize(
    ("path", "args"),
    [
        ("/api/models", ["models"]),
        ("/api/gpus", ["gpus"]),
        ("/api/formats", ["formats"]),
        ("/api/precision?gpu=v100-sxm2-32gb", ["precision", "--gpu", "v100-sxm2-32gb"]),
        ("/api/precision?gpu=h100-sxm-80gb", ["precision", "--gpu", "h100-sxm-80gb"]),
    ],
)
def test_catalog_endpoints_equal_the_cli_json(
    client: TestClient, path: str, args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert client.get(path).json() == cli_json(args, capsys)


def test_model_search_filters_the_catalog(client: TestClient, capsys: pytest.CaptureFixture[str]) -> None:
    every = cli_json(["models"], capsys)["models"]
    found = client.get("/api/models", params={"q": "LLAMA 8b"}).json()["models"]
    assert found == [m for m in every if "llama" in m["id"] and "8b" in m["id"]]
    assert found, "the search should find the llama 8B models"
    assert client.get("/api/models", params={"q": "no-such-model"}).json()["models"] == []


def test_a_pasted_config_answers_like_the_cli_on_that_file(
    client: TestClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.json"
    text = json.dumps(catalog_config("qwen2.5-0.5b"), indent=1)
    path.write_text(text)
    expected = cli_json(["estimate", str(path), "--gpu", "t4", "--batch", "2"], capsys)
    got = client.post("/api/estimate", json={"config": text, "gpu": "t4", "batch": 2}).json()
    assert got["model"]["source"] == "upload"
    for key in ("name", "source"):  # the file's folder and path: the only difference
        del got["model"][key], expected["model"][key]
    assert got == expected
    inferred = client.post("/api/infer", json={"config": json.loads(text), "prompt": 128}).json()  # a JSON object too
    assert inferred["params"] == expected["params"]
    row = client.post("/api/config", json={"config": text}).json()["model"]
    assert row["params"] == expected["params"]


ESTIMATE_ERRORS: list[dict[str, Any]] = [
    {"model": "gpt2", "gpu": "a100"},
    {"model": "gpt2", "precision": "fp8"},
    {"model": "gpt2", "gpus": 3, "tp": 2},
    {"model": "gpt2", "batch": 0},
    {"model": "gpt2", "headroom": 1.5},
    {"model": "gpt2", "method": "guess"},
    {"model": "llama-3.1-8b", "finetune": "lora", "lora_rank": 0},
    {"model": "gpt2", "params": "1e9"},
    {"params": "1.5", "hidden_size": 64, "num_layers": 2},
    {"model": "gpt2", "gpu": "t4", "host_memory_gib": 0},
    {"model": "gpt2", "host_memory_gib": 64},
    # given for a run it does nothing in, even at its default (the API did not refuse these before 2026-12-05)
    {"model": "gpt2", "lora_rank": 8},
    {"model": "gpt2", "gpus": 2, "sharding": "fsdp", "bucket_cap_mb": 25},
]


@pytest.mark.parametrize("options", ESTIMATE_ERRORS, ids=lambda o: " ".join(to_args(o)))
def test_estimate_errors_are_the_cli_line(
    client: TestClient, options: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    expected = cli_error(["estimate", *to_args(options)], capsys)
    got = client.post("/api/estimate", json=options)
    assert got.status_code == 400
    assert got.json() == {"error": expected}


@pytest.mark.parametrize(
    "options",
    [
        {"model": "gpt2", "gpus": 3, "tp": 2},
        {"model": "gpt2", "prompt": 4096},
        {"model": "gpt2", "dtype": "int3"},
        {"model": "gpt2", "server": "paged"},
    ],
    ids=lambda o: " ".join(to_args(o)),
)
def test_infer_errors_are_the_cli_line(
    client: TestClient, options: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    expected = cli_error(["infer", *to_args(options)], capsys)
    got = client.post("/api/infer", json=options)
    assert got.status_code == 400
    assert got.json() == {"error": expected}


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        ("/api/estimate", {"model": "gpt2", "bach": 2}, 400, "no such option: --bach"),
        ("/api/estimate", {"model": "gpt2", "batch": "two"}, 400, "invalid value for '--batch'"),
        ("/api/estimate", {"model": "gpt2", "batch": True}, 400, "not a valid integer"),
        ("/api/estimate", {"model": "gpt2", "headroom": "lots"}, 400, "invalid value for '--headroom'"),
        ("/api/estimate", {"model": "gpt2", "sequence_parallel": "maybe"}, 400, "not a valid boolean"),
        ("/api/estimate", {"model": "gpt2", "precision": ["fp32"]}, 400, "expected text"),
        ("/api/estimate", {"model": "gpt3"}, 400, "Did you mean: gpt2"),
        ("/api/estimate", {"model": "/etc/passwd"}, 400, "unknown model '/etc/passwd'"),
        ("/api/estimate", {"model": "../README.md"}, 400, "unknown model"),
        ("/api/estimate", {"model": "meta-llama/Llama-3.1-8B"}, 400, "--allow-hub"),
        ("/api/estimate", {}, 400, "give a MODEL"),
        ("/api/infer", {}, 400, "give a model"),
        ("/api/estimate", {"model": "gpt2", "method": "trace"}, 400, "POST /api/jobs"),
        ("/api/infer", {"model": "gpt2", "method": "trace"}, 400, "POST /api/jobs"),
        ("/api/estimate", {"config": '{"model_type": "llama",\n'}, 400, "config.json is not valid JSON (line 2"),
        ("/api/estimate", {"config": "[1, 2]"}, 400, "must hold a JSON object"),
        ("/api/estimate", {"config": '{"model_type": "llama"}'}, 400, "hidden_size"),
        ("/api/estimate", {"config": 42}, 400, "text of a config.json"),
        ("/api/estimate", {"config": "[" * 100_000}, 400, "nests JSON too deeply"),
        ("/api/estimate", {"config": " " * (MAX_CONFIG_BYTES + 1)}, 400, "KiB a config.json may have"),
        ("/api/config", {"config": "{oops"}, 400, "not valid JSON"),
        ("/api/config", {}, 400, "POST a JSON object"),
        ("/api/plan", {"model": "gpt2"}, 400, "--gpu is required"),
        ("/api/plan", {"model": "gpt2", "gpu": "a100-sxm-80gb", "objective": "cheapest-ish"}, 400, "--objective"),
        ("/api/jobs", {"kind": "plan"}, 400, "unknown job kind"),
        ("/api/jobs", {"kind": "estimate", "model": "gpt2", "batch": "x"}, 400, "invalid value for '--batch'"),
    ],
)
def test_refusals_are_one_line(client: TestClient, path: str, body: dict[str, Any], status: int, says: str) -> None:
    got = client.post(path, json=body)
    assert got.status_code == status, got.text
    message = got.json()["error"]
    assert says in message
    assert "\n" not in message and message == " ".join(message.split())


@pytest.mark.parametrize(
    ("path", "status", "says"),
    [
        ("/api/precision", 400, "?gpu="),
        ("/api/precision?gpu=nope", 400, "unknown GPU"),
        ("/api/plan?model=gpt2", 400, "--gpu is required"),
        ("/api/jobs/deadbeef", 404, "no job"),
        ("/api/nothing", 404, "Not Found"),
    ],
)
def test_get_refusals(client: TestClient, path: str, status: int, says: str) -> None:
    got = client.get(path)
    assert got.status_code == status
    assert says.lower() in got.json()["error"].lower()


def test_bodies_are_size_limited(client: TestClient) -> None:
    big = client.post("/api/estimate", content=b"{" + b" " * MAX_BODY_BYTES + b"}")
    assert big.status_code == 413 and "limit" in big.json()["error"]

    def chunks() -> Any:  # no Content-Length: the limit holds while reading
        for _ in range(MAX_BODY_BYTES // 4096 + 2):
            yield b" " * 4096

    streamed = client.post("/api/estimate", content=chunks())
    assert streamed.status_code == 413
    for bad in (b"not json", b"[1, 2]", b"\xff\xfe"):
        got = client.post("/api/estimate", content=bad)
        assert got.status_code == 400 and got.json() == {"error": "request body is not a JSON object"}


def test_hub_ids_need_allow_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    def fake_load(name: str) -> Any:
        asked.append(name)
        from trainfit.errors import UnknownModelError

        raise UnknownModelError(f"no Hub repo '{name}'")

    monkeypatch.setattr("trainfit.web.options.load_model", fake_load)
    hub = TestClient(create_app(allow_hub=True))
    got = hub.post("/api/estimate", json={"model": "org/some-model"})
    assert got.status_code == 400 and got.json()["error"] == "no Hub repo 'org/some-model'"
    assert asked == ["org/some-model"]
    assert hub.post("/api/estimate", json={"model": "/etc/passwd"}).status_code == 400
    assert asked == ["org/some-model"], "a path is never handed to load_model"


def test_the_api_speaks_every_cli_flag() -> None:
    from typer.main import get_command

    from trainfit.cli.app import app

    command = get_command(app)
    for name, options in (("estimate", estimate_options()), ("infer", infer_options()), ("plan", plan_options())):
        sub = command.commands[name]  # type: ignore[attr-defined]
        flags = {opt for p in sub.params for opt in p.opts if opt.startswith("--")}
        assert {o.flag for o in options.values()} <= flags
        # --from: no local files; --export: plan's files come from /api/plan/export
        skipped = {"--json", "--explain", "--modules", "--max-batch", "--help", "--from", "--export"}
        assert flags - {o.flag for o in options.values()} <= skipped


@pytest.mark.parametrize("kind", ["estimate", "plan"])
def test_after_takes_a_list_of_earlier_runs_in_order(
    client: TestClient, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--after`` repeats on the command line; the API takes the runs as a list (a single text is one run)."""
    base = {"model": "llama-3.2-1b", "gpu": "h100-sxm-80gb", "warm_up": True}
    if kind == "plan":
        base |= {"gpus": 1, "global_batch": 8, "top": 1}
    runs = ["qwen2.5-0.5b -b 4 --build on-device", "gpt2 -b 2"]
    expected = cli_json([kind, *to_args(base), "--after", runs[0], "--after", runs[1]], capsys)
    got = client.post(f"/api/{kind}", json={**base, "after": runs})
    assert got.status_code == 200, got.text
    assert got.json() == expected
    assert [a["model"] for a in got.json()["history"]["after"]] == ["qwen2.5-0.5b", "gpt2"]


@pytest.mark.parametrize(
    "options",
    [
        {"torch_version": "2.5"},
        {"cuda_version": "11.6"},
        {"after": "gpt2 --help"},
        {"after": "gpt2 --gpus 2"},
        {"build": "sideways"},
    ],
    ids=lambda o: " ".join(to_args(o)),
)
@pytest.mark.parametrize("kind", ["estimate", "plan"])
def test_release_and_history_errors_are_the_cli_line(
    client: TestClient, kind: str, options: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    body = {"model": "gpt2", "gpu": "h100-sxm-80gb", "global_batch": 8, **options}
    if kind == "estimate":
        body.pop("global_batch")
    expected = cli_error([kind, *to_args(body)], capsys)
    got = client.post(f"/api/{kind}", json=body)
    assert got.status_code == 400 and got.json() == {"error": expected}


def test_a_history_over_many_gpus_is_refused_by_the_plan_api(client: TestClient) -> None:
    got = client.post("/api/plan", json={"model": "gpt2", "gpu": "t4", "gpus": 2, "global_batch": 8, "warm_up": True})
    assert got.status_code == 400 and "modelled for one GPU only" in got.json()["error"]


def test_the_page_and_its_assets_are_served(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200 and "/static/app.js" in page.text and "/static/plotly.min.js" in page.text
    assert "cdn" not in page.text.lower()
    for asset in ("/static/app.js", "/static/style.css"):
        assert client.get(asset).status_code == 200
    js = client.get("/static/plotly.min.js")
    if web_app.plotly_js() is None:
        assert js.status_code == 404
    else:
        assert js.status_code == 200 and len(js.content) > 1_000_000


def test_jobs_report_progress_finish_and_cancel(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    seen: list[dict[str, Any]] = []

    def fake(raw: dict[str, Any], allow_hub: bool, progress: Any = None) -> dict[str, Any]:
        seen.append(raw)
        for i in range(200):
            progress(f"step {i}", i / 200)
            if release.is_set():
                return {"answer": raw["model"]}
            time.sleep(0.01)
        raise AssertionError("never released")

    monkeypatch.setitem(web_app.COMPUTE, "estimate", fake)
    client = TestClient(create_app())

    def wait(job_id: str) -> dict[str, Any]:
        for _ in range(500):
            state: dict[str, Any] = client.get(f"/api/jobs/{job_id}").json()
            if state["state"] != "running":
                return state
            time.sleep(0.01)
        raise AssertionError("job never finished")

    first = client.post("/api/jobs", json={"kind": "estimate", "model": "gpt2"})
    assert first.status_code == 202 and first.json()["state"] == "running"
    job_id = first.json()["id"]
    assert seen[0]["method"] == "trace", "a job runs the trace unless told otherwise"
    busy = client.post("/api/jobs", json={"kind": "estimate", "model": "gpt2"})
    assert busy.status_code == 409 and "already running" in busy.json()["error"]
    time.sleep(0.05)
    assert client.get(f"/api/jobs/{job_id}").json()["message"].startswith("step ")
    cancelled = client.delete(f"/api/jobs/{job_id}")
    assert cancelled.status_code == 200
    assert wait(job_id)["state"] == "cancelled"

    second = client.post("/api/jobs", json={"kind": "estimate", "model": "gpt2"}).json()
    release.set()
    done = wait(second["id"])
    assert done["state"] == "done" and done["result"] == {"answer": "gpt2"} and done["fraction"] == 1.0


def test_a_failing_job_reports_its_one_line() -> None:
    from trainfit.errors import DependencyError

    jobs = Jobs()

    def boom(progress: Any) -> dict[str, Any]:
        progress("importing", 0.0)
        raise DependencyError("--method trace needs torch:\n pip install torch")

    job = jobs.start("estimate", boom)
    for _ in range(200):
        if job.state is not JobState.RUNNING:
            break
        time.sleep(0.01)
    assert job.state is JobState.ERROR and job.error == "--method trace needs torch: pip install torch"

    def cancelled(progress: Any) -> dict[str, Any]:
        raise JobCancelled

    other = jobs.start("infer", cancelled)
    for _ in range(200):
        if other.state is not JobState.RUNNING:
            break
        time.sleep(0.01)
    assert other.state is JobState.CANCELLED


VALUES = st.one_of(
    st.sampled_from(["", " ", "0", "-1", "1.5", "1e400", "nan", "abc", "true", "none", "full", "fp8", "t4", "2"]),
    st.integers(-3, 5000),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=12),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kind=st.sampled_from(["estimate", "infer"]),
    picks=st.dictionaries(st.sampled_from(sorted(set(estimate_options()) | set(infer_options()))), VALUES, max_size=3),
)
def test_any_input_gets_an_answer_or_one_line(client: TestClient, kind: str, picks: dict[str, Any]) -> None:
    """Whatever the values, the API answers 200 or a 4xx with one line: never a 500, never a traceback."""
    body = {"model": "qwen2.5-0.5b", **picks}
    try:
        json.dumps(body, allow_nan=False)
    except ValueError:
        body = {k: (str(v) if isinstance(v, float) else v) for k, v in body.items()}  # JSON has no nan/inf
    got = client.post(f"/api/{kind}", json=body)
    assert got.status_code in (200, 400), got.text
    if got.status_code == 400:
        message = got.json()["error"]
        assert message and message == " ".join(message.split())

"""The planner and the caching allocator's configuration: a candidate that only fits with expandable segments is a
plan that says ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, and each number is the estimate's own, re-run
with the plan's allocator (and, without it, the estimate says it does not fit)."""

from __future__ import annotations

import json
import shlex

import pytest

from trainfit import estimate, get_gpu, load_model
from trainfit.planner.rank import search_plans
from trainfit.planner.speed import step_time

ENV = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


def _search(alloc_conf: str) -> list:  # type: ignore[type-arg]
    # Qwen3 8B, one A100 80GB, one 6144-token sequence per step: pure-bf16 + adamw-8bit + full checkpointing fits only
    # with expandable segments (57.21 GiB by default, 53.71 with them, 56.00 usable; the estimate's suggestion too).
    spec, gpu = load_model("qwen3-8b"), get_gpu("a100-sxm-80gb")
    return list(search_plans(spec, gpu, gpus=1, seq_len=6144, global_batch=1, top=5, alloc_conf=alloc_conf).plans)


def test_a_plan_fits_only_with_expandable_segments_and_says_so() -> None:
    spec, gpu = load_model("qwen3-8b"), get_gpu("a100-sxm-80gb")
    plans = _search("")
    grown = [p for p in plans if ENV in p.changes]
    assert grown, [p.changes for p in plans]
    for p in plans:
        assert (ENV in p.changes) == (p.alloc_conf == "expandable_segments:True")
        kw = {"gpu": gpu, "headroom": 0.3, "search_micro_batch": False, "fixes": False}
        again = estimate(spec, p.strategy, allocator=p.alloc_conf, **kw)  # type: ignore[arg-type]
        assert again.fit is not None and again.fit.fits and again.fit.required_bytes == p.required_bytes
        if p in grown:
            plain = estimate(spec, p.strategy, allocator="", **kw)  # type: ignore[arg-type]
            assert plain.fit is not None and not plain.fit.fits  # the second chance was needed
            # its speed is the strategy's, allocator or not
            assert p.speed == step_time(spec, p.strategy, gpu, network_gbps=50.0)


def test_with_expandable_segments_given_no_plan_asks_for_it() -> None:
    """--alloc-conf expandable_segments:True: every estimate simulates it, so no plan lists it as a change."""
    plans = _search("expandable_segments:True")
    assert plans
    assert all(p.alloc_conf == "expandable_segments:True" and ENV not in p.changes for p in plans)


def test_plan_cli_alloc_conf(capsys: pytest.CaptureFixture[str], tmp_path: object) -> None:
    from tests.cli._cli_helper import run_cli

    args = ("plan", "qwen3-8b", "--gpu", "a100-sxm-80gb", "--gpus", "1", "--seq", "6144", "--global-batch", "1")
    bad = run_cli(capsys, *args, "--alloc-conf", "expandable_segments:maybe")
    assert bad.code == 2 and len(bad.err.strip().splitlines()) == 1 and "Traceback" not in bad.err
    res = run_cli(capsys, *args, "--alloc-conf", "", "--json", "--top", "5")
    assert res.code == 0, res.err
    out = json.loads(res.out)
    assert any(ENV in p["changes"] for p in out["plans"])
    for p in out["plans"]:
        # the explicit key says the same as the changes: the allocator the plan assumes, null for the defaults
        assert p["alloc_conf"] == ("expandable_segments:True" if ENV in p["changes"] else None)
        if ENV in p["changes"]:  # the printed changes, as `trainfit estimate` runs them, fit
            flags = [f for c in p["changes"] if c != ENV for f in shlex.split(c)]
            r = run_cli(capsys, "estimate", "qwen3-8b", "--gpu", "a100-sxm-80gb", "--seq", "6144", *flags,
                        "--alloc-conf", "expandable_segments:True", "--no-fixes", "--json")  # fmt: skip
            assert r.code == 0, r.err
            assert json.loads(r.out)["fits"]


def test_a_many_gpu_plan_gets_the_second_chance() -> None:
    """The second chance covers the many-GPU ranks whose reserve is simulated (MemoryReport.reserve_simulated):
    Llama 3.1 8B on 4 H100s at sequence 8192 has ZeRO-3 plans that miss by the allocator's fragmentation alone."""
    spec, gpu = load_model("llama-3.1-8b"), get_gpu("h100-sxm-80gb")
    plans = search_plans(spec, gpu, gpus=4, seq_len=8192, global_batch=4, top=10, alloc_conf="").plans
    grown = [p for p in plans if ENV in p.changes and p.strategy.is_distributed]
    assert grown, [p.changes for p in plans]
    kw = {"gpu": gpu, "headroom": 0.3, "search_micro_batch": False, "fixes": False}
    for p in grown:
        plain = estimate(spec, p.strategy, allocator="", **kw)  # type: ignore[arg-type]
        again = estimate(spec, p.strategy, allocator="expandable_segments:True", **kw)  # type: ignore[arg-type]
        assert plain.reserve_simulated and again.reserve_simulated
        assert plain.fit is not None and not plain.fit.fits  # the default allocator's reserve is the miss ...
        assert plain.fit.required_bytes - plain.overhead.allocator_reserve_bytes <= plain.fit.usable_bytes
        assert again.fit is not None and again.fit.fits and again.fit.required_bytes == p.required_bytes


def test_a_fixed_fraction_reserve_is_not_simulated() -> None:
    """A many-GPU rank outside rank_simulated (ZeRO-3 with a client optimizer other than AdamW) keeps the fixed reserve
    fraction, which no allocator setting changes: the report says so, and expandable segments change nothing."""
    from trainfit.strategy import Engine, EngineOptions, Parallelism, Strategy

    spec, gpu = load_model("llama-3.1-8b"), get_gpu("h100-sxm-80gb")
    s = Strategy(  # ZeRO-3 with SGD: not simulated
        precision="master-bf16",
        seq_len=4096,
        engine=EngineOptions(engine=Engine.DEEPSPEED),
        parallelism=Parallelism.for_gpus(4),
        sharding="zero3",  # type: ignore[arg-type]
        optimizer="sgd",  # type: ignore[arg-type]
    )
    kw = {"gpu": gpu, "search_micro_batch": False, "fixes": False}
    plain = estimate(spec, s, allocator="", **kw)  # type: ignore[arg-type]
    grown = estimate(spec, s, allocator="expandable_segments:True", **kw)  # type: ignore[arg-type]
    assert not plain.reserve_simulated and not grown.reserve_simulated
    assert plain.overhead.allocator_reserve_bytes == grown.overhead.allocator_reserve_bytes

"""``trainfit plan`` searches FSDP2's ``reshard_after_forward`` both ways: every FSDP2/HSDP candidate has a twin
that keeps its layers unsharded from forward to backward (``--no-reshard-after-forward``), priced by the same speed
and memory models as ``trainfit estimate`` with that flag, and a plan that picks it says so."""

from __future__ import annotations

import dataclasses
import json
import random
import shlex

import pytest

from tests.cli._cli_helper import run_cli
from trainfit import get_gpu, load_model
from trainfit.errors import StrategyError
from trainfit.planner.rank import _distance, describe_changes
from trainfit.planner.space import Candidate, Finetune, candidates
from trainfit.planner.speed import SpeedInputs, step_time_of
from trainfit.strategy import EngineOptions, Parallelism, Precision, Sharding, Strategy

from .test_rank import _search

FSDP = (Sharding.FSDP, Sharding.HSDP)

#: Llama 3.2 3B on 8 L40S (no NVLink: FSDP2's all-gathers cross PCIe and are not hidden behind the short compute
#: of two 1024-token sequences per GPU), global batch 16: the fastest plan gathers each layer once. (Until
#: 2026-12-04 one 2048-token sequence at global batch 8; since the loss and the op-by-op elementwise backward were
#: counted, that micro-step's compute hides the second gather; then 1024-token sequences, until the eager
#: elementwise kernels ran at EAGER_ELEMENTWISE_EFFICIENCY and that compute hid it too; then 8 RTX 4090s at 768
#: tokens, until FSDP2's unhideable first all-gather and last reduce-scatter — 128k × 3072 tied table, root of every
#: micro-step — put Megatron ZeRO-1 plans ahead there, planner.speed.fsdp_edge_seconds.)
PCIE = ("llama-3.2-3b", "l40s", 8, 1024, 16)


def test_every_fsdp_candidate_comes_with_and_without_reshard_after_forward() -> None:
    spec, gpu = load_model("llama-3.1-8b"), get_gpu("h100-sxm-80gb")  # untied: 2-D FSDP2 × TP candidates too
    allow = (Finetune.LORA, Finetune.QLORA)
    space = candidates(spec, gpu, gpus=16, gpus_per_node=8, global_batch=64, allow=allow, fp8=True)
    kept = {c for c in space if not c.reshard_after_forward}
    resharded = {c for c in space if c.reshard_after_forward and c.sharding in FSDP}
    assert kept and all(c.sharding in FSDP for c in kept)
    assert {dataclasses.replace(c, reshard_after_forward=True) for c in kept} == resharded
    # both settings reach the offloaded, HSDP, 2-D, fp8 and adapter candidates
    assert {c.offload for c in kept} == {"none", "optimizer+params"}
    assert {c.sharding for c in kept} == set(FSDP)
    assert any(c.tensor > 1 for c in kept) and any(c.float8.value != "none" for c in kept)
    assert {c.finetune for c in kept} == set(Finetune)
    with pytest.raises(StrategyError, match="FSDP2 setting"):
        Candidate(world=8, sharding=Sharding.DDP, reshard_after_forward=False)


def test_a_kept_candidate_runs_the_strategy_its_speed_inputs_describe() -> None:
    """The candidate's Strategy carries the setting, its speed inputs are ``SpeedInputs.of`` that Strategy (every
    parameter gathered once per micro-step), and it moves less than its resharded twin on the same links."""
    spec, gpu = load_model("llama-3.2-3b"), get_gpu("rtx-4090")
    space = [c for c in candidates(spec, gpu, gpus=16, gpus_per_node=8, global_batch=64) if not c.reshard_after_forward]
    for c in random.Random(4).sample(space, 30):
        twin = dataclasses.replace(c, reshard_after_forward=True)
        kw = {"micro_batch": 1, "grad_accum": 64 // c.data, "seq_len": 1024, "gpus_per_node": 8}
        s = c.strategy(**kw)
        assert s.engine.reshard_after_forward is False and s == dataclasses.replace(
            twin.strategy(**kw), engine=dataclasses.replace(s.engine, reshard_after_forward=False)
        )
        x, x_twin = c.speed_inputs(**kw, spec=spec), twin.speed_inputs(**kw, spec=spec)
        assert x == SpeedInputs.of(s, spec) and x.fsdp_gathered_once == 1.0 and x_twin.fsdp_gathered_once < 1.0
        try:
            t, t_twin = step_time_of(spec, x, gpu), step_time_of(spec, x_twin, gpu)
        except StrategyError:  # no peak for this dtype in the catalog
            continue
        assert t.comm_seconds < t_twin.comm_seconds and t.step_seconds <= t_twin.step_seconds


def test_kept_candidates_memory_is_the_estimate_with_the_flag() -> None:
    """A random sample of the kept candidates: the planner's requirement is ``trainfit estimate`` of the Strategy
    built the way the CLI builds ``--no-reshard-after-forward`` (EngineOptions), not the candidate's own."""
    from trainfit import estimate

    s = _search("qwen2.5-0.5b", "rtx-4090", 32, 2048)
    space = candidates(s.spec, s.gpu, gpus=8, gpus_per_node=8, global_batch=32)
    checked = 0
    for c in random.Random(6).sample([c for c in space if not c.reshard_after_forward], 12):
        twin = s.strategy(dataclasses.replace(c, reshard_after_forward=True), 1)
        flagged = dataclasses.replace(twin, engine=EngineOptions(engine=c.engine, reshard_after_forward=False))
        need = s.need(s.strategy(c, 1))
        try:
            rep = estimate(s.spec, flagged, gpu=s.gpu, headroom=0.3, allocator="")
        except StrategyError:
            assert need is None
            continue
        assert rep.fit is not None and need is not None
        mine, allocator = need
        if allocator != s.allocator:  # the expandable-segments second chance
            rep = estimate(s.spec, flagged, gpu=s.gpu, headroom=0.3, allocator=allocator.to_env())
            assert rep.fit is not None and rep.fit.fits
        assert mine == rep.fit.required_bytes
        checked += 1
    assert checked >= 8


@pytest.mark.parametrize(
    ("slug", "gpu", "gpus", "seq", "gb"),
    [
        ("llama-3.1-8b", "h100-sxm-80gb", 16, 4096, 64),  # HSDP, 2-D FSDP2 × TP, fp8, offload
        ("gpt2", "t4", 4, 512, 16),  # tied, fp16 recipes
        ("mixtral-8x7b-v0.1", "a100-sxm-80gb", 16, 2048, 32),  # MoE
    ],
)
def test_keeping_layers_unsharded_never_lowers_the_lower_bound(
    slug: str, gpu: str, gpus: int, seq: int, gb: int
) -> None:
    """What the search's shortcut relies on (``rank._Search.evaluate``): without reshard_after_forward the closed-form
    lower bound (allocated peak + workspaces + outside the allocator) is never below the resharding twin's, so the
    twin's bound ruling it out rules the kept candidate out — on random FSDP2/HSDP setups, adapters included.
    (Not the requirement: the simulated reserve can be lower without resharding, planner.space's docstring.)"""
    from trainfit.planner.search import lower_bound_bytes

    spec, g = load_model(slug), get_gpu(gpu)
    allow = (Finetune.LORA, Finetune.QLORA)
    space = candidates(spec, g, gpus=gpus, gpus_per_node=8, global_batch=gb, allow=allow, fp8=True)
    checked = more = 0
    for c in random.Random(8).sample([c for c in space if not c.reshard_after_forward], 25):
        for micro in (1, 2):
            kw = {"micro_batch": micro, "grad_accum": gb // (c.data * micro), "seq_len": seq, "gpus_per_node": 8}
            twin = dataclasses.replace(c, reshard_after_forward=True)
            kept_bound = lower_bound_bytes(spec, c.strategy(**kw), g)
            twin_bound = lower_bound_bytes(spec, twin.strategy(**kw), g)
            assert kept_bound >= twin_bound, (c, micro)
            checked += twin_bound > 0  # (0: a setup the estimate refuses)
            more += kept_bound > twin_bound
    assert checked >= 30 and more >= 30


def test_the_bound_tells_the_settings_apart() -> None:
    """The search's speed caches are keyed by what the speed model reads: a kept candidate's bound, computed after its
    twin's in the same search, is its own (better: one all-gather per layer instead of two) and what a fresh
    search gives."""
    slug, gpu, n, seq, gb = PCIE
    s = _search(slug, gpu, gb, seq)
    space = candidates(s.spec, s.gpu, gpus=n, gpus_per_node=8, global_batch=gb)
    kept = next(
        c
        for c in space
        if not c.reshard_after_forward
        and (c.world, c.tensor, c.sharding, c.offload) == (n, 1, Sharding.FSDP, "none")
        and c.precision is Precision.PURE_BF16
    )
    twin = dataclasses.replace(kept, reshard_after_forward=True)
    b_twin, b_kept = s.bound(twin), s.bound(kept)
    assert b_twin is not None and b_kept is not None and b_kept < b_twin
    assert b_kept == _search(slug, gpu, gb, seq).bound(kept)


def test_changes_say_the_setting_only_where_it_differs_and_means_something() -> None:
    par = Parallelism(data=8)
    kept = EngineOptions(reshard_after_forward=False)
    ddp = Strategy(parallelism=par, sharding="ddp")
    fsdp = Strategy(parallelism=par, sharding="fsdp")
    fsdp_kept = dataclasses.replace(fsdp, engine=kept)
    assert "--no-reshard-after-forward" in describe_changes(fsdp_kept, ddp)
    assert not any("reshard" in c for c in describe_changes(fsdp, ddp))
    # a baseline that keeps them (an imported accelerate config): a resharding plan says so
    assert "--reshard-after-forward" in describe_changes(fsdp, fsdp_kept)
    assert not any("reshard" in c for c in describe_changes(fsdp_kept, fsdp_kept))
    # DDP does not read the setting: nothing to say when the plan leaves FSDP2
    assert not any("reshard" in c for c in describe_changes(dataclasses.replace(ddp, engine=kept), fsdp))
    c = Candidate(world=8, sharding=Sharding.FSDP)
    assert _distance(dataclasses.replace(c, reshard_after_forward=False), fsdp) == _distance(c, fsdp) + 1


def test_a_plan_without_reshard_is_the_estimate_of_its_printed_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """The PCIe case: the top plan keeps the layers unsharded; its JSON says so (strategy and changes), the text
    explains it, and ``trainfit estimate`` with the baseline's flags plus the plan's changes gives its requirement
    and step time — and without ``--no-reshard-after-forward`` another requirement, a slower step."""
    slug, gpu, n, seq, gb = PCIE
    common = [slug, "--gpu", gpu, "--seq", str(seq)]
    r = run_cli(capsys, "plan", *common, "--gpus", str(n), "--global-batch", str(gb), "--json")
    assert r.code == 0, r.err
    top = json.loads(r.out)["plans"][0]
    assert top["strategy"]["sharding"] == "fsdp" and top["strategy"]["reshard_after_forward"] is False
    assert "--no-reshard-after-forward" in top["changes"]
    flags = ["--gpus", str(n), "--sharding", "ddp", "--batch", str(gb // n)]  # the baseline: DDP, one micro-step
    for change in top["changes"]:
        flags += shlex.split(change)
    est = json.loads(run_cli(capsys, "estimate", *common, *flags, "--json").out)
    assert est["strategy"]["reshard_after_forward"] is False
    assert est["fits"] and est["required_bytes"] == top["required_bytes"]
    assert est["step_seconds"] == pytest.approx(top["step_seconds"])
    resharded = [f for f in flags if f != "--no-reshard-after-forward"]
    other = json.loads(run_cli(capsys, "estimate", *common, *resharded, "--json").out)
    assert other["required_bytes"] != top["required_bytes"] and other["step_seconds"] > top["step_seconds"]
    text = run_cli(capsys, "plan", *common, "--gpus", str(n), "--global-batch", str(gb), "--top", "1")
    assert "--no-reshard-after-forward" in text.out
    assert "one all-gather per layer and micro-step instead of two" in " ".join(text.out.split())  # wrapped

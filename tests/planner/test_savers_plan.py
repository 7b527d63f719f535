"""The memory savers in `trainfit plan`'s space, one GPU: Liger's fused linear cross-entropy, and torchtune's
chunked loss, activation offloading and optimizer-in-backward, alone and combined — each kept only where the same
plan with fewer of its savers does not fit."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from trainfit import estimate, load_model
from trainfit.hardware import get_gpu
from trainfit.planner.api import plan
from trainfit.planner.rank import search_plans
from trainfit.planner.space import (
    TORCHTUNE_CHECKPOINTING,
    TORCHTUNE_PRECISIONS,
    Finetune,
    candidates,
    saver_candidates,
)
from trainfit.planner.speed import SpeedInputs, step_time_of
from trainfit.strategy import Checkpointing, LossImpl, MemorySavers, Optimizer, Sharding, Strategy


def test_saver_variants_only_where_the_estimate_models_savers() -> None:
    spec, gpu = load_model("llama-3.2-1b"), get_gpu("a100-sxm-80gb")
    space = candidates(spec, gpu, gpus=8, gpus_per_node=8, global_batch=16, allow=(Finetune.LORA,))
    savers = [c for c in space if c.twin() != c]
    assert savers and all(c.world == 1 and c.sharding is Sharding.NONE for c in savers)
    base = [c for c in space if c.world == 1 and c.sharding is Sharding.NONE and c.twin() == c]
    fused = [c for c in savers if c.loss is LossImpl.FUSED_LINEAR]
    assert len(fused) == len(base)  # every one-GPU candidate, adapters included; alone
    assert all(not (c.activation_offload or c.optimizer_in_backward) for c in fused)
    torchtune = [c for c in base if c.finetune is Finetune.FULL and c.precision in TORCHTUNE_PRECISIONS
                 and c.checkpointing in TORCHTUNE_CHECKPOINTING]  # fmt: skip
    assert torchtune
    # torchtune's recipe offloads activations only with activation checkpointing (its __init__ raises otherwise)
    offloadable = [c for c in torchtune if c.checkpointing is Checkpointing.FULL]
    assert offloadable and len(offloadable) < len(torchtune)
    for chunked, offload, in_bwd in itertools.product((False, True), repeat=3):
        if not (chunked or offload or in_bwd):
            continue
        variants = [c for c in savers if (c.loss is LossImpl.CHUNKED, c.activation_offload, c.optimizer_in_backward)
                    == (chunked, offload, in_bwd)]  # fmt: skip
        twins = offloadable if offload else torchtune
        assert sorted(map(repr, (c.twin() for c in variants))) == sorted(map(repr, twins)), (chunked, offload, in_bwd)
    # bounded: one fused variant per base, at most 7 torchtune variants (4 combinations) per torchtune base
    assert len(savers) == len(base) + 3 * len(torchtune) + 4 * len(offloadable)
    assert saver_candidates(savers) == []  # no variant of a variant


def test_fewer_savers_are_the_proper_subsets_twin_first() -> None:
    spec, gpu = load_model("llama-3.2-1b"), get_gpu("a100-sxm-80gb")
    space = candidates(spec, gpu, gpus=1, gpus_per_node=8, global_batch=4)
    (three,) = (c for c in space if c.loss is LossImpl.CHUNKED and c.activation_offload and c.optimizer_in_backward
                and c.optimizer is Optimizer.ADAMW_8BIT)  # fmt: skip
    fewer = three.fewer_savers()
    assert fewer[0] == three.twin() and len(set(fewer)) == 7 and three not in fewer
    on = [(c.loss is LossImpl.CHUNKED, c.activation_offload, c.optimizer_in_backward) for c in fewer]
    assert sorted(on) == sorted(k for k in itertools.product((False, True), repeat=3) if not all(k))
    assert all(f in space for f in fewer)  # each is a candidate of its own
    single = next(c for c in space if c.loss is LossImpl.FUSED_LINEAR)
    assert single.fewer_savers() == (single.twin(),) and single.twin().fewer_savers() == ()


def test_optimizer_in_backward_is_searched_without_accumulation() -> None:
    """torchtune refuses optimizer_in_bwd with gradient accumulation (and so does Strategy): its only micro-batch is
    the whole per-GPU batch."""
    from tests.planner.test_rank import _search

    s = _search("llama-3.2-1b", "a100-sxm-80gb", 16, 1024)
    opt = next(c for c in candidates(s.spec, s.gpu, gpus=1, gpus_per_node=8, global_batch=16)
               if c.optimizer_in_backward)  # fmt: skip
    assert s.micro_options(opt) == [16]
    assert s.strategy(opt, 16).grad_accum == 1


def _check(spec_slug: str, gpu: str, plans: list, retried: bool = True) -> None:  # type: ignore[type-arg]
    """Each saver plan fits by the estimate, and the same plan with any proper subset of its savers (none, or for a
    combination each smaller one) does not, at the same micro-batch (``retried``: nor with expandable segments, the
    planner's second chance)."""
    spec = load_model(spec_slug)
    for p in plans:
        again = estimate(spec, p.strategy, gpu=gpu, search_micro_batch=False, fixes=False, allocator=p.alloc_conf)
        assert again.fit is not None and again.fit.fits and again.fit.required_bytes == p.required_bytes
        sv = p.strategy.savers
        on = {
            "loss": sv.loss,
            "activation_offload": sv.activation_offload,
            "optimizer_in_backward": sv.optimizer_in_backward,
        }
        off = {"loss": LossImpl.STANDARD, "activation_offload": False, "optimizer_in_backward": False}
        active = [k for k in on if on[k] != off[k]]
        assert active
        for keep in itertools.product((False, True), repeat=len(active)):
            if all(keep):
                continue
            fewer = MemorySavers(**{k: on[k] if kept else off[k] for k, kept in zip(active, keep, strict=True)})
            for alloc in {p.alloc_conf, "expandable_segments:True"} if retried else {p.alloc_conf}:
                smaller = estimate(spec, dataclasses.replace(p.strategy, savers=fewer), gpu=gpu,
                                   search_micro_batch=False, fixes=False, allocator=alloc)  # fmt: skip
                assert smaller.fit is not None and not smaller.fit.fits, (p.changes, fewer.names(), alloc)


def test_a_fused_linear_plan_is_there_only_because_its_standard_twin_does_not_fit() -> None:
    """The speed model prices the fused loss like the standard one (the same matmuls), so a plan keeps
    ``--loss fused-linear`` only where the estimate says the same plan with the standard loss does not fit."""
    r = plan(load_model("llama-3.2-1b"), "rtx-4090", gpus=1, seq=4096, global_batch=16, top=5)
    fused = [p for p in r.plans if p.strategy.savers.loss is LossImpl.FUSED_LINEAR]
    assert fused, [p.changes for p in r.plans]
    assert all("--loss fused-linear" in p.changes for p in fused)
    _check("llama-3.2-1b", "rtx-4090", fused)


def test_optimizer_in_backward_gives_way_to_its_twin_with_expandable_segments() -> None:
    """Qwen3 8B on one A100 80GB, one 6144-token sequence: pure-bf16 + 8-bit AdamW + full checkpointing misses
    with the default allocator (57.21 GiB of 56.00 usable), so without the second chance a saver that fits (since
    2026-12-04 Liger's fused loss, before it --optimizer-in-backward, no gradients held, 53.84 GiB) is the plan;
    with expandable segments the twin itself fits (53.71 GiB; the planner's
    second chance), and a saver is kept only where its twin does not fit: the twin with PYTORCH_CUDA_ALLOC_CONF is
    the plan, and no plan steps the optimizer in backward alone. (Savers that even expandable segments cannot spare:
    test_the_savers_planned_are_those_no_fewer_of_which_fit.)"""
    spec, gpu = load_model("qwen3-8b"), get_gpu("a100-sxm-80gb")
    r = search_plans(spec, gpu, gpus=1, seq_len=6144, global_batch=1, top=5, alloc_conf="")
    twin = Strategy(seq_len=6144, precision="pure-bf16", optimizer="adamw-8bit", checkpointing="full")
    saver = dataclasses.replace(twin, savers=MemorySavers(optimizer_in_backward=True))
    kw = {"gpu": gpu, "search_micro_batch": False, "fixes": False}
    plain = estimate(spec, twin, allocator="", **kw)  # type: ignore[arg-type]
    grown = estimate(spec, twin, allocator="expandable_segments:True", **kw)  # type: ignore[arg-type]
    alone = estimate(spec, saver, allocator="", **kw)  # type: ignore[arg-type]
    assert plain.fit is not None and grown.fit is not None and alone.fit is not None
    assert not plain.fit.fits and grown.fit.fits and alone.fit.fits
    assert not any(p.strategy.savers.optimizer_in_backward and len(p.strategy.savers.names()) == 1 for p in r.plans)
    assert any(p.strategy == twin and p.alloc_conf == "expandable_segments:True" for p in r.plans), [
        p.changes for p in r.plans
    ]
    # without the second chance a saver fits in the twin's place with the default allocator: Liger's fused loss
    # (48.88 GiB reserved since the analytic stream replays it; 56.16, the standard loss's logits segments, before,
    # when optimizer-in-backward was that plan), faster than stepping the optimizer in backward
    before = search_plans(spec, gpu, gpus=1, seq_len=6144, global_batch=1, top=5, alloc_conf="", retry_expandable=False)
    fused = dataclasses.replace(twin, savers=MemorySavers(loss=LossImpl.FUSED_LINEAR))
    assert any(p.strategy == fused and not p.alloc_conf for p in before.plans), [p.changes for p in before.plans]


def test_the_savers_planned_are_those_no_fewer_of_which_fit() -> None:
    """Llama 3.1 8B on one H100 NVL 94GB, one 18432-token sequence: Liger's fused linear loss with full checkpointing
    fits with the default allocator and is the fastest plan; every plan's savers are needed (checked saver subset by
    subset). By the estimate 49.80 GiB reserved against the trace's 50.60. Until the analytic stream replayed the
    fused loss (2026-12-04) it took the standard loss's logits segments for it, reserved 66.77 GiB and planned all
    three of torchtune's savers (chunked loss, activation offloading, optimizer in backward) instead; at 20480 to
    26624 tokens the fused loss alone is still the plan."""
    spec = load_model("llama-3.1-8b")
    gpu = get_gpu("h100-nvl-94gb")
    r = search_plans(spec, gpu, gpus=1, seq_len=18432, global_batch=1, top=5, alloc_conf="", retry_expandable=False)
    assert r.plans
    top = r.plans[0]
    assert "--loss fused-linear" in top.changes and top.strategy.savers.names() == ("--loss fused-linear",), top.changes
    assert "--checkpointing full" in top.changes and not top.alloc_conf
    _check("llama-3.1-8b", "h100-nvl-94gb", [p for p in r.plans if p.strategy.savers.names()], False)


def test_activation_offload_costs_the_pcie_traffic_its_passes_do_not_hide() -> None:
    """torchtune's OffloadActivations streams: the saved bytes go down during the forward and come back during the
    backward; what a pass does not hide is added. With a fast PCIe link nothing shows; with a slow one the step
    grows by 2 × transfer − forward − backward per micro-step (closed form from the cited overlap)."""
    spec, gpu = load_model("llama-3.1-8b"), get_gpu("h100-sxm-80gb")
    s = Strategy(precision="pure-bf16", seq_len=2048, micro_batch=2, grad_accum=2,
                 savers=MemorySavers(activation_offload=True))  # fmt: skip
    x = SpeedInputs.of(s, spec)
    twin = dataclasses.replace(x, offload_activation_bytes=0)
    base = step_time_of(spec, twin, gpu)
    compute_micro = base.compute_seconds / 2
    fast = dataclasses.replace(gpu, pcie_gbps=1e6)
    assert step_time_of(spec, x, fast).step_seconds == pytest.approx(step_time_of(spec, twin, fast).step_seconds)
    slow = dataclasses.replace(gpu, pcie_gbps=1.0)
    transfer = x.offload_activation_bytes / 1e9
    assert transfer > compute_micro  # the slow link cannot be hidden in either pass
    added = step_time_of(spec, x, slow).step_seconds - step_time_of(spec, twin, slow).step_seconds
    assert added == pytest.approx(2 * (2 * transfer - compute_micro))
    # the bytes moved: every save is copied to the host once (the stash's too), what the estimate puts there
    rep = estimate(spec, s, gpu=gpu, search_micro_batch=False, fixes=False)
    assert rep.host_peak_bytes == x.offload_activation_bytes > 0


def test_a_saver_plan_is_the_estimate_of_its_printed_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """Llama 3.2 3B on one RTX 4090, sequence 1024, one sequence per step: the top plan steps the optimizer in
    backward; `trainfit estimate` with the plan's flags gives its per-GPU requirement."""
    import json

    from tests.cli._cli_helper import run_cli

    r = search_plans(load_model("llama-3.2-3b"), get_gpu("rtx-4090"), gpus=1, seq_len=1024, global_batch=1, top=1)
    p = r.plans[0]
    assert "--optimizer-in-backward" in p.changes, p.changes
    flags = [f for change in p.changes for f in change.split()]
    flags = [f"--alloc-conf={f.split('=', 1)[1]}" if f.startswith("PYTORCH_CUDA_ALLOC_CONF=") else f for f in flags]
    res = run_cli(capsys, "estimate", "llama-3.2-3b", "--gpu", "rtx-4090", "--seq", "1024", *flags, "--json")
    assert res.code == 0, res.err
    out = json.loads(res.out)
    assert out["required_bytes"] == p.required_bytes and out["fits"]


@pytest.mark.parametrize(
    ("model", "gpu", "seq", "global_batch", "allow", "skips"),
    [
        # benchmarks/plan_speed.py's: fused-loss QLoRA candidates whose standard-loss twins fit (5 estimates fewer)
        ("mistral-7b-v0.1", "rtx-4090", 2048, 64, (Finetune.LORA, Finetune.QLORA), True),
        ("llama-3.2-1b", "rtx-4090", 4096, 16, (), False),  # a fused-loss plan kept: nothing to skip
    ],
)
def test_skipping_a_dominated_saver_candidate_changes_only_the_estimates(
    monkeypatch: pytest.MonkeyPatch,
    model: str,
    gpu: str,
    seq: int,
    global_batch: int,
    allow: tuple[Finetune, ...],
    skips: bool,
) -> None:
    """``_Search.dominated`` skips a saver candidate whose plan the search would drop (a fewer-savers twin known to
    fit at every micro-batch it could take) before its estimates: the same plans, in the same order, as the search
    that estimates it and drops it after — with fewer estimates where any is skipped."""
    from trainfit.planner import rank

    spec, g = load_model(model), get_gpu(gpu)
    kw = {"gpus": 1, "seq_len": seq, "global_batch": global_batch, "allow": allow, "alloc_conf": ""}
    fast = search_plans(spec, g, **kw)  # type: ignore[arg-type]
    monkeypatch.setattr(rank._Search, "dominated", lambda self, c, limit: False)
    slow = search_plans(spec, g, **kw)  # type: ignore[arg-type]
    assert fast.plans and [(p.strategy, p.alloc_conf, p.required_bytes) for p in fast.plans] == [
        (p.strategy, p.alloc_conf, p.required_bytes) for p in slow.plans
    ]
    assert (fast.estimates < slow.estimates) if skips else (fast.estimates == slow.estimates)

"""The exported files cannot say sqrt, selective or per-op SAC checkpointing (the Trainer, accelerate, DeepSpeed and
train_fsdp2.py checkpoint every block): the run they do describe is estimated on the plan's GPU and NOTES.txt (and
``trainfit plan --export``) give its figure — a warning when it does not fit. Issue 14's audit: NOTES.txt claimed
"full ≤ sqrt memory", false for Llama 3.1 8B on an RTX 4090 with ZeRO-3 offload. Every expectation comes from
``estimate``, not from numbers written here."""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from pathlib import Path

import pytest

from tests.cli._cli_helper import run_cli
from trainfit import estimate, get_gpu, load_model
from trainfit.export import export_files, export_plan
from trainfit.planner.api import plan
from trainfit.planner.rank import Plan, PlanResult
from trainfit.report.plan import export_check
from trainfit.strategy import Checkpointing, Engine, EngineOptions, Parallelism, Sharding, Strategy
from trainfit.units import fmt_gib

CASE = {"gpus": 1, "seq": 2048, "global_batch": 8, "top": 1}
ARGS = (
    "plan",
    "llama-3.1-8b",
    "--gpu",
    "rtx-4090",
    "--gpus",
    "1",
    "--seq",
    "2048",
    "--global-batch",
    "8",
    "--top",
    "1",
)


@cache
def _case() -> tuple[PlanResult, Plan, int]:
    """The 4090 plan (sqrt checkpointing under ZeRO-3 offload) and what the estimate says full checkpointing needs."""
    r = plan("llama-3.1-8b", "rtx-4090", **CASE)  # type: ignore[arg-type]
    top = r.plans[0]
    assert top.strategy.checkpointing is Checkpointing.SQRT, top.changes
    full = dataclasses.replace(top.strategy, checkpointing=Checkpointing.FULL)
    rep = estimate("llama-3.1-8b", full, gpu="rtx-4090", search_micro_batch=False, allocator=top.alloc_conf)
    assert rep.fit is not None
    return r, top, rep.fit.required_bytes


def test_the_exported_run_is_estimated_and_its_figure_is_in_notes() -> None:
    r, top, full = _case()
    ex = export_plan(
        load_model("llama-3.1-8b"), top.strategy, alloc_conf=top.alloc_conf, **export_check(r, "rtx-4090", 0.3)
    )
    run = ex.exported_run
    assert run is not None and run.checkpointing is Checkpointing.FULL and run.plan_checkpointing is Checkpointing.SQRT
    assert run.required_bytes == full and run.usable_bytes == top.usable_bytes
    assert run.fits == (full <= top.usable_bytes)
    assert full != top.required_bytes  # the files describe another run than the plan's
    notes = export_files(ex)["NOTES.txt"]
    assert fmt_gib(full) in notes and ("— fits" if run.fits else "DOES NOT FIT") in notes
    assert "at most that of sqrt" not in notes  # the old claim, false here when full needs more than sqrt


def test_an_exported_run_that_does_not_fit_is_said_so() -> None:
    """A headroom whose usable bytes lie between the plan's and the full-checkpointing run's requirement."""
    r, top, full = _case()
    if full <= top.required_bytes:
        pytest.skip("full checkpointing needs no more than sqrt here: no headroom separates them")
    memory = get_gpu("rtx-4090").memory_bytes
    headroom = 1 - (top.required_bytes + full) / 2 / memory
    ex = export_plan(
        load_model("llama-3.1-8b"), top.strategy, alloc_conf=top.alloc_conf, **export_check(r, "rtx-4090", headroom)
    )
    assert ex.exported_run is not None and not ex.exported_run.fits
    assert top.required_bytes <= ex.exported_run.usable_bytes < full
    assert "DOES NOT FIT" in export_files(ex)["NOTES.txt"] and fmt_gib(full) in export_files(ex)["NOTES.txt"]


def test_plan_export_warns_when_the_exported_run_does_not_fit(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    _, top, full = _case()
    if full <= top.required_bytes:
        pytest.skip("full checkpointing needs no more than sqrt here")
    headroom = 1 - (top.required_bytes + full) / 2 / get_gpu("rtx-4090").memory_bytes
    args = (*ARGS, "--headroom", f"{headroom:.6f}", "--export", str(tmp_path))
    out = json.loads(run_cli(capsys, *args, "--json").out)
    assert out["plans"][0]["strategy"]["checkpointing"] == "sqrt"
    assert out["exported_run"]["fits"] is False and out["exported_run"]["required_bytes"] == full
    r = run_cli(capsys, *args)
    assert r.code == 0 and "warning:" in r.err and "DOES NOT FIT" in " ".join(r.err.split())
    assert "DOES NOT FIT" in (tmp_path / "NOTES.txt").read_text()


def test_files_that_say_the_plan_need_no_second_estimate() -> None:
    spec = load_model("llama-3.2-1b")
    kw = {"gpu": "a100-sxm-80gb"}
    for ck in (Checkpointing.NONE, Checkpointing.FULL):
        assert export_plan(spec, Strategy(checkpointing=ck, micro_batch=2), **kw).exported_run is None  # type: ignore[arg-type]
    # without a GPU nothing is estimated, but the note no longer claims full needs less
    sqrt = Strategy(checkpointing=Checkpointing.SQRT, micro_batch=2)
    ex = export_plan(spec, sqrt)
    assert ex.exported_run is None and "with its own memory" in "\n".join(ex.notes)
    assert export_plan(spec, sqrt, **kw).exported_run is not None  # type: ignore[arg-type]
    # Megatron keeps selective recompute (megatron_args.txt): no substitute run
    mega = Strategy(
        checkpointing=Checkpointing.SELECTIVE,
        parallelism=Parallelism.for_gpus(8, tensor=2, sequence_parallel=True),
        sharding=Sharding.ZERO1,
        engine=EngineOptions(engine=Engine.MEGATRON),
        precision="master-bf16",  # type: ignore[arg-type]
    )
    assert export_plan(spec, mega, **kw).exported_run is None  # type: ignore[arg-type]

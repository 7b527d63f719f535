"""Each pipeline stage's in-flight micro-batches are in the output (``RankMemory.pipeline``, JSON ``ranks[].pipeline``,
the per-rank table's "in flight" column, a note), and they follow Megatron's schedules. The expected counts are
derived here from the schedules' structure — the sequence of forwards (F) and backwards (B) one stage runs — and not
from the closed form's formula: 1F1B (megatron/core/pipeline_parallel/schedules.py
``forward_backward_pipelining_without_interleaving``) runs min(pp − s − 1, m) warm-up forwards, then F B pairs for
the rest, then the warm-up's backwards; interleaved (``forward_backward_pipelining_with_interleaving``) runs
(pp − s − 1)·2 + (v − 1)·pp warm-up chunk forwards (all m·v of them when that is as many), then F B pairs; GPipe
(torch ``ScheduleGPipe``) every forward before the first backward. What a stage holds at once is the most forwards
not yet matched by their backward."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from trainfit import Strategy, estimate
from trainfit.report.json import report_json
from trainfit.report.table import render
from trainfit.strategy import Parallelism, PipelineSchedule

from ..cli._cli_helper import run_cli


def _ops(schedule: PipelineSchedule, pp: int, s: int, m: int, v: int) -> list[str]:
    """One stage's forward/backward order (one letter per model-chunk micro-batch) under ``schedule``."""
    total = m * v
    if schedule is PipelineSchedule.GPIPE:
        return ["F"] * m + ["B"] * m
    # interleaved: microbatch_group_size_per_vp_stage = pp
    interleaved = schedule is PipelineSchedule.INTERLEAVED
    warmup = min((pp - s - 1) * 2 + (v - 1) * pp if interleaved else pp - s - 1, total)
    steady = total - warmup
    return ["F"] * warmup + ["F", "B"] * steady + ["B"] * warmup


def _most_alive(ops: list[str]) -> int:
    alive = most = 0
    for op in ops:
        alive += 1 if op == "F" else -1
        most = max(most, alive)
    assert alive == 0
    return most


CASES = [
    # (schedule, pp, microbatches, virtual stages)
    (PipelineSchedule.ONE_F_ONE_B, 4, 16, 1),  # s of p holds p − s
    (PipelineSchedule.ONE_F_ONE_B, 4, 2, 1),  # capped by the micro-batch count: 2, 2, 2, 1
    (PipelineSchedule.ONE_F_ONE_B, 8, 8, 1),
    (PipelineSchedule.INTERLEAVED, 4, 16, 2),
    (PipelineSchedule.INTERLEAVED, 4, 8, 5),
    (PipelineSchedule.INTERLEAVED, 4, 4, 2),  # m = pp: every chunk forward of stage 0 is warm-up
    (PipelineSchedule.GPIPE, 4, 6, 1),
]


def _strategy(schedule: PipelineSchedule, pp: int, m: int, v: int) -> Strategy:
    return Strategy(
        parallelism=Parallelism(
            data=1, tensor=8, pipeline=pp, pipeline_schedule=schedule, virtual_stages=v, microbatches=m
        ),
        micro_batch=1,
        seq_len=4096,
    )


@pytest.mark.parametrize(("schedule", "pp", "m", "v"), CASES, ids=lambda x: getattr(x, "value", str(x)))
def test_each_stage_reports_the_schedules_in_flight_count(schedule: PipelineSchedule, pp: int, m: int, v: int) -> None:
    report = estimate("llama-3.1-70b", _strategy(schedule, pp, m, v))
    assert len(report.ranks) == pp
    for s, r in enumerate(report.ranks):
        f = r.pipeline
        assert f is not None and f.stage == s and f.model_chunks == v
        want = _most_alive(_ops(schedule, pp, s, m, v))
        assert f.in_flight_chunks == want, (s, f.in_flight_chunks, want)
        assert f.in_flight_microbatches == want / v
        if schedule is PipelineSchedule.ONE_F_ONE_B:  # the textbook rule, said once more
            assert f.in_flight_chunks == min(pp - s, m)
    rows = report_json(report)["ranks"]
    assert [row["pipeline"]["in_flight_chunks"] for row in rows] == [
        _most_alive(_ops(schedule, pp, s, m, v)) for s in range(pp)
    ]
    assert all(row["pipeline"]["model_chunks"] == v for row in rows)


def test_text_names_each_stages_in_flight_count() -> None:
    report = estimate("llama-3.1-70b", _strategy(PipelineSchedule.INTERLEAVED, 4, 16, 2))
    console = Console(record=True, width=200)
    render(console, report)
    text = " ".join(console.export_text().split())  # notes wrap
    want = [_most_alive(_ops(PipelineSchedule.INTERLEAVED, 4, s, 16, 2)) for s in range(4)]  # 11, 9, 7, 5
    assert "in flight" in text
    for s, c in enumerate(want):
        assert f"stage {s}: {c} chunks of 2 ({c / 2:g} micro-batches)" in text
        assert f"{c} ch ({c / 2:g} mb)" in text


def test_cli_json_carries_the_in_flight_counts(capsys: pytest.CaptureFixture[str]) -> None:
    line = "llama-3.1-70b --gpus 64 --tp 8 --pp 4 --sequence-parallel --microbatches 16 --json"
    out = json.loads(run_cli(capsys, "estimate", *line.split()).out)
    assert [r["pipeline"] for r in out["ranks"]] == [
        {"stage": s, "in_flight_chunks": 4 - s, "model_chunks": 1, "in_flight_microbatches": 4 - s} for s in range(4)
    ]


def test_no_pipeline_no_in_flight_entry(capsys: pytest.CaptureFixture[str]) -> None:
    out = json.loads(run_cli(capsys, "estimate", "llama-3.1-8b", "--gpus", "8", "--tp", "8", "--json").out)
    assert all("pipeline" not in r for r in out["ranks"])

"""A pure-bf16 top plan under full training carries a note (no fp32 master copy: a risk for long runs such as
pretraining, which the ranking cannot see); LoRA/QLoRA plans and mixed recipes do not. The ranking is unchanged."""

from __future__ import annotations

import dataclasses

from trainfit.planner.api import plan
from trainfit.planner.rank import PURE_BF16_RISK, _pure_bf16_notes
from trainfit.planner.space import Finetune
from trainfit.report.plan import plan_json
from trainfit.strategy import Precision


def test_a_pure_bf16_full_training_top_plan_is_noted_in_text_and_json() -> None:
    r = plan("llama-3.2-1b", "rtx-4090", gpus=1, seq=1024, global_batch=8, top=3)
    assert r.plans[0].strategy.precision is Precision.PURE_BF16 and r.plans[0].candidate.finetune is Finetune.FULL
    [note] = [n for n in r.notes if n.startswith("plan 1 is pure-bf16")]
    assert PURE_BF16_RISK in note and "Zamirai" in note
    assert note in plan_json(r)["notes"]


def test_the_note_names_the_best_listed_plan_with_fp32_weights_and_spares_adapters() -> None:
    r = plan("llama-3.2-1b", "rtx-4090", gpus=1, seq=1024, global_batch=8, top=2)
    top = r.plans[0]
    master = dataclasses.replace(top, strategy=dataclasses.replace(top.strategy, precision=Precision.MASTER_BF16))
    [note] = _pure_bf16_notes([top, master])
    assert "plan 2 updates fp32 weights (master-bf16" in note
    assert "consider --precision master-bf16" in _pure_bf16_notes([top])[0]
    lora = dataclasses.replace(top, candidate=dataclasses.replace(top.candidate, finetune=Finetune.LORA))
    assert _pure_bf16_notes([lora]) == [] and _pure_bf16_notes([master, top]) == [] and _pure_bf16_notes([]) == []

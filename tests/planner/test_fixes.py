"""``trainfit estimate``'s checked fixes (:func:`trainfit.planner.fixes.checked_fixes`) are searched under the
estimate's own torch release, CUDA release and process history — a fix checked against other workspaces, another
context or a fresh process would answer a different question than the estimate that said "does not fit"."""

from __future__ import annotations

from typing import Any

import pytest

from trainfit.arch import load_model
from trainfit.estimate import estimate
from trainfit.history import ProcessHistory
from trainfit.planner import rank
from trainfit.strategy import Precision, Strategy

#: qwen2.5-1.5b, amp-fp16, 8 × 2048 tokens on a T4: does not fit, and the planner has fixes (tests/cli).
SPEC = "qwen2.5-1.5b"
STRATEGY = Strategy(precision=Precision.AMP_FP16, micro_batch=8, seq_len=2048)


@pytest.mark.parametrize(
    ("kwargs", "torch", "cuda", "history"),
    [
        ({}, (2, 13), None, None),
        (
            {"torch_version": "2.11", "cuda_version": "11.6", "history": ProcessHistory(warm_up=True)},
            (2, 11),
            (11, 6),
            ProcessHistory(warm_up=True),
        ),
    ],
    ids=["defaults", "given"],
)
def test_the_fixes_search_gets_the_estimates_releases_and_history(
    monkeypatch: pytest.MonkeyPatch,
    kwargs: dict[str, Any],
    torch: tuple[int, int],
    cuda: tuple[int, int] | None,
    history: ProcessHistory | None,
) -> None:
    asked: list[dict[str, Any]] = []
    search = rank.search_plans

    def spy(*args: Any, **kw: Any) -> rank.PlanResult:
        asked.append(kw)
        return search(*args, **kw)

    monkeypatch.setattr(rank, "search_plans", spy)
    rep = estimate(load_model(SPEC), STRATEGY, gpu="t4", **kwargs)
    assert rep.fit is not None and not rep.fit.fits and rep.fit.fixes_searched
    (kw,) = asked
    assert kw["torch_version"] == torch and kw["cuda_version"] == cuda
    assert kw["history"] == history or (history is None and kw["history"] in (None, ProcessHistory()))
    # with a history, the report says which fixes could be searched (one GPU's plain runs)
    assert any("fixes were searched after the same process history" in n for n in rep.notes) == (history is not None)

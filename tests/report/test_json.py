"""The JSON schema: every phase carries every component; the fit search's cap and absence are explicit."""

from __future__ import annotations

import dataclasses

from trainfit import estimate
from trainfit.report.json import report_json
from trainfit.result import Component


def test_every_phase_carries_every_component() -> None:
    data = report_json(estimate("gpt2", gpu="t4"))
    for phase in data["phases"].values():
        assert set(phase["components"]) == {c.value for c in Component}
        assert phase["total_bytes"] == sum(phase["components"].values())


def test_search_cap_and_unsearched_batch_are_explicit() -> None:
    r = estimate("gpt2", gpu="t4")
    assert r.fit is not None
    capped = dataclasses.replace(r, fit=dataclasses.replace(r.fit, max_micro_batch_capped=True))
    assert report_json(capped)["max_micro_batch_capped"] is True
    unsearched = dataclasses.replace(r, fit=dataclasses.replace(r.fit, max_micro_batch=None))
    assert report_json(unsearched)["max_micro_batch"] is None


def test_every_method_carries_every_component() -> None:
    data = report_json(estimate("gpt2", method="rule-of-thumb"))
    for phase in data["phases"].values():
        assert set(phase["components"]) == {c.value for c in Component}

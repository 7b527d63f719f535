"""The seed article's two worked examples, to its rounding (decimal GB)."""

from __future__ import annotations

from trainfit.analytic import estimate_rule_of_thumb
from trainfit.arch import explicit_model
from trainfit.strategy import Strategy


def test_seven_b_example() -> None:
    # §1.2: 7B, hidden 4096, 32 layers, b=1, s=2048 → 84 GB before activations, 2.7–5.4 GB activations.
    spec = explicit_model(params=7_000_000_000, hidden_size=4096, num_layers=32)
    r = estimate_rule_of_thumb(spec, Strategy(micro_batch=1, seq_len=2048))
    assert round(int(r.extra["states_bytes"]) / 1e9) == 84
    assert round(int(r.extra["activations_low_bytes"]) / 1e9, 1) == 2.7
    assert round(int(r.extra["activations_high_bytes"]) / 1e9, 1) == 5.4
    # "batch 8 → over 20 GB" of activations (§1.2), at the top of the range
    r8 = estimate_rule_of_thumb(spec, Strategy(micro_batch=8, seq_len=2048))
    assert int(r8.extra["activations_high_bytes"]) > 20e9


def test_one_point_three_b_example() -> None:
    # §5.2: 1.3B, hidden 2048, 24 layers, b=4, s=1024: 15.6 + ≈3 + 1.5 ≈ 20 GB.
    spec = explicit_model(params=1_300_000_000, hidden_size=2048, num_layers=24)
    r = estimate_rule_of_thumb(spec, Strategy(micro_batch=4, seq_len=1024))
    terms = {t.name: t.bytes for t in r.terms}
    assert round(terms["weights+grads+optimizer"] / 1e9, 1) == 15.6
    assert round(terms["activations"] / 1e9) == 3
    assert terms["framework overhead"] == 1.5e9
    assert round((r.peak_bytes + r.overhead.total_bytes) / 1e9) == 20
    # "batch 8: activations double to 6 GB, total ≈ 23 GB"
    r8 = estimate_rule_of_thumb(spec, Strategy(micro_batch=8, seq_len=1024))
    assert round(r8.peak.components[next(iter(r8.peak.components))] / 1e9, 1) == 2.6  # weights unchanged
    assert round((r8.peak_bytes + r8.overhead.total_bytes) / 1e9) == 23

"""Analytic vs trace: the closed-form model must land within 5% of the traced peak.

Six architectures (Llama-3, Qwen2.5, Gemma-2, GPT-2, BERT, Mixtral-style MoE) x recipes x checkpointing
none/full x two shapes, on tiny configs. Cells where the analytic model is known to disagree today are
marked ``xfail(strict=False)`` with the component that differs, so the matrix stays visible and a fix
shows up as XPASS; ``python benchmarks/agreement.py`` prints the same comparison at catalog sizes.
"""

from __future__ import annotations

import itertools

import pytest

from trainfit.strategy import Strategy

from .conftest import tiny_spec

pytest.importorskip("torch")
from trainfit.analytic import estimate_analytic
from trainfit.trace import trace_spec
from trainfit.trace.agreement import PEAK_TOLERANCE, compare

FAMILIES = ("llama", "qwen2", "gemma2", "gpt2", "bert", "mixtral")
SHAPES = ((1, 128), (4, 512))


def _known(family: str, precision: str, ckpt: str, shape: tuple[int, int]) -> str | None:
    """Disagreements still open in the analytic model, reported in docs/accuracy.md. xfail(strict=False):
    a fix shows up as XPASS."""
    if family == "gemma2" and (ckpt == "full" or precision in ("master-bf16", "pure-bf16")):
        return "Gemma-2 eager attention, 16-bit score chain or recompute: score-sized transients approximated"
    return None


def _cells(precisions: tuple[str, ...]) -> list[object]:
    out: list[object] = []
    for fam, prec, ck, shape in itertools.product(FAMILIES, precisions, ("none", "full"), SHAPES):
        reason = _known(fam, prec, ck, shape)
        marks = [pytest.mark.xfail(reason=reason, strict=False)] if reason else []
        out.append(pytest.param(fam, prec, ck, shape, marks=marks, id=f"{fam}-{prec}-{ck}-b{shape[0]}s{shape[1]}"))
    return out


def _check(family: str, precision: str, ckpt: str, shape: tuple[int, int]) -> None:
    spec = tiny_spec(family)
    s = Strategy(precision=precision, checkpointing=ckpt, micro_batch=shape[0], seq_len=shape[1])  # type: ignore[arg-type]
    ag = compare(estimate_analytic(spec, s), trace_spec(spec, s))
    detail = "; ".join(
        f"{g.phase.value} {g.rel * 100:+.1f}% ({g.largest_component_gap()})" for g in ag.phases if g.components
    )
    assert abs(ag.peak_rel) <= PEAK_TOLERANCE, f"peak {ag.peak_rel * 100:+.1f}%: {detail}"


@pytest.mark.parametrize(("family", "precision", "ckpt", "shape"), _cells(("amp-bf16",)))
def test_analytic_within_5_percent_of_trace(family: str, precision: str, ckpt: str, shape: tuple[int, int]) -> None:
    _check(family, precision, ckpt, shape)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "precision", "ckpt", "shape"), _cells(("fp32", "master-bf16", "pure-bf16")))
def test_analytic_within_5_percent_of_trace_other_recipes(
    family: str, precision: str, ckpt: str, shape: tuple[int, int]
) -> None:
    _check(family, precision, ckpt, shape)

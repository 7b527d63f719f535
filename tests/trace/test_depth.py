"""Depth extrapolation: runs of repeated units, and extrapolated == full-depth trace on small models."""

from __future__ import annotations

from typing import Any

import pytest

from trainfit.result import Phase
from trainfit.strategy import Checkpointing, Strategy

from .conftest import tiny_spec

hf = pytest.importorskip("trainfit.trace.hf")
from trainfit.trace import trace_spec  # noqa: E402

#: Allowed difference per phase: a few tensors whose size is not linear in depth after 512-byte
#: rounding (the stacked per-parameter norms of grad clipping).
TOL_BYTES = 4096


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        ("aaaaaa", [(0, 1, 6)]),
        ("abababab", [(0, 2, 4)]),
        ("xxxaaaaaa", [(0, 1, 3), (3, 1, 6)]),
        ("abcd", [(0, 1, 1), (1, 1, 1), (2, 1, 1), (3, 1, 1)]),
        ("SSSnnnn", [(0, 1, 3), (3, 1, 4)]),
    ],
)
def test_find_runs(tokens: str, expected: list[tuple[int, int, int]]) -> None:
    assert [(r.start, r.period, r.count) for r in hf.find_runs(list(tokens))] == expected


@pytest.mark.parametrize(
    ("layers", "segments"),
    [(1, [1]), (4, [2, 2]), (5, [2, 2, 1]), (16, [4, 4, 4, 4]), (17, [4, 4, 4, 4, 1]), (126, [11] * 11 + [5])],
)
def test_sqrt_layout_covers_every_layer(layers: int, segments: list[int]) -> None:
    assert hf.sqrt_layout(layers) == segments


@pytest.mark.parametrize(
    ("family", "layers", "kw"),
    [
        ("llama", 8, {}),
        ("llama", 8, {"checkpointing": "full", "precision": "fp32"}),
        ("llama", 17, {"checkpointing": "sqrt"}),  # 4 checkpointed segments of 3, then 5 plain layers
        # 5 segments of 5 (17 above covers a plain tail): the slowest cell of the suite, run with the full matrix
        pytest.param("llama", 25, {"checkpointing": "sqrt", "precision": "fp32"}, marks=pytest.mark.full_matrix),
        ("qwen2", 7, {"precision": "master-bf16", "optimizer": "lion"}),
        ("gemma2", 10, {"attention": "eager"}),  # alternating sliding/global layers: a 2-layer unit
        ("deepseek_v2", 7, {}),  # one dense layer, then MoE layers
        ("gpt2", 6, {"precision": "amp-fp16"}),
        ("bert", 6, {}),
    ],
)
def test_extrapolation_equals_full_depth(family: str, layers: int, kw: dict[str, str]) -> None:
    key = "n_layer" if family == "gpt2" else "num_hidden_layers"
    spec = tiny_spec(family, **{key: layers})
    s = Strategy(micro_batch=2, seq_len=64, **kw)  # type: ignore[arg-type]
    ext = trace_spec(spec, s)
    full = trace_spec(spec, s, extrapolate=False)
    assert ext.extra["extrapolated"] and max(ext.extra["layers_traced"]) < layers
    assert full.extra["layers_traced"] == [layers]
    for pe, pf in zip(ext.phases, full.phases, strict=True):
        assert abs(pe.total_bytes - pf.total_bytes) <= TOL_BYTES, (pe.phase, pe.total_bytes, pf.total_bytes)
        for c, v in pf.components.items():
            assert abs(pe.components[c] - v) <= TOL_BYTES, (pe.phase, c)


def test_a_forward_peak_inside_the_top_layer_is_traced_at_two_and_three_units() -> None:
    """Eager attention's score chain sets the forward peak inside the top layer; over a 16-bit residual the model's
    ``inputs_embeds`` and the layer's ``residual`` are one tensor at one unit and two from two on, so a 1→2 slope
    would carry one t·h too many per layer: the trace runs 2 and 3 units instead and stays exact."""
    spec = tiny_spec("llama", num_hidden_layers=4)
    s = Strategy(precision="pure-bf16", attention="eager", micro_batch=2, seq_len=256)
    ext = trace_spec(spec, s)
    full = trace_spec(spec, s, extrapolate=False)
    assert ext.extra["layers_traced"] == [2, 3]
    for pe, pf in zip(ext.phases, full.phases, strict=True):
        assert abs(pe.total_bytes - pf.total_bytes) <= TOL_BYTES, (pe.phase, pe.total_bytes, pf.total_bytes)


def test_sqrt_checkpointing_keeps_fewer_inputs_than_full() -> None:
    spec = tiny_spec("llama", num_hidden_layers=4)  # sqrt: two checkpointed segments of 2 layers
    peaks = {
        c: trace_spec(spec, Strategy(micro_batch=4, seq_len=256, checkpointing=c), extrapolate=False)
        .phase(Phase.FORWARD)
        .total_bytes
        for c in (Checkpointing.NONE, Checkpointing.FULL, Checkpointing.SQRT)
    }
    # Forward keeps one input per segment: 2 under sqrt, 4 under full, everything without checkpointing.
    assert peaks[Checkpointing.SQRT] < peaks[Checkpointing.FULL] < peaks[Checkpointing.NONE]


@pytest.mark.parametrize(
    ("family", "finetune", "kw"),
    [
        ("falcon", "lora", {"targets": "all-linear", "dropout": 0.05, "base_dtype": "bf16"}),
        ("llama", "lora", {"targets": "all-linear", "dropout": 0.05, "base_dtype": "bf16"}),
        ("llama", "freeze", {"freeze": "embeddings"}),
    ],
)
def test_extrapolation_without_input_gradient_into_the_stack(family: str, finetune: str, kw: dict[str, Any]) -> None:
    """A frozen embedding table and no checkpointing: the lowest layer gets a plain tensor and computes no input
    gradient; at one traced layer it is also the top one, off the line the deeper traces lie on (Falcon-7B LoRA:
    the 1->2 slope 44 MiB/layer high). A small vocabulary and long sequence put the peak inside the stack."""
    pytest.importorskip("peft")
    from trainfit.strategy import finetune_setup

    a, b = finetune_setup(finetune, rank=4, **kw)
    spec = tiny_spec(family, num_hidden_layers=6, vocab_size=32)
    s = Strategy(adapter=a, base_weights=b, micro_batch=1, seq_len=256)
    ext = trace_spec(spec, s)
    full = trace_spec(spec, s, extrapolate=False)
    assert ext.extra["extrapolated"]
    for pe, pf in zip(ext.phases, full.phases, strict=True):
        assert abs(pe.total_bytes - pf.total_bytes) <= TOL_BYTES, (pe.phase, pe.total_bytes, pf.total_bytes)
    assert ext.extra["layers_traced"] == [2, 3]


def test_trainable_embeddings_keep_one_base_unit() -> None:
    """The cheap plan stays where the stack's input requires grad: a trainable table, or checkpointing."""
    from trainfit.trace.depth import plan_depth

    spec = tiny_spec("llama", num_hidden_layers=6)
    for s in (Strategy(micro_batch=1, seq_len=64), Strategy(micro_batch=1, seq_len=64, checkpointing="full")):
        plan = plan_depth(spec, s, extrapolate=True)
        assert plan.base_units == 1 and [len(lay.layers) for _, lay in plan.layouts] == [1, 2]

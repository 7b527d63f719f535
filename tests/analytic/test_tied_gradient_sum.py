"""The rule of ``trainfit.analytic.states.tied_gradient_sum`` against real autograd on CPU tensors.

A bare tied table (an fp32 ``vocab × hidden`` parameter read by ``F.embedding`` and again by ``F.linear``, a few
tokens, so the table's gradients are nearly all of the backward's bytes) is run on real tensors and its backward
counted allocator call by allocator call (``torch.profiler``; tests/analytic/_realcpu.py). In table units:

* the head reads the table itself (fp32, pure-/master-16-bit recipes): the head's gradient (a view), the
  embedding's gradient and their out-of-place sum — 3 tables; an in-place add would be 2;
* behind autocast's bf16 cast (amp recipes): the cast's backward makes a fresh fp32 gradient, added into in place:
  the bf16 head gradient and the fp32 one, then the fp32 one and the embedding's (2), less the bf16 weight copy
  the matmul saved, released in the window — 1.5; out of place it would be 2.5.

``InputBuffer::add`` (torch/csrc/autograd/input_buffer.cpp) only picks a stream by device and calls the same
``accumulate``, so these CPU counts stand for CUDA too (benchmarks/gpu_session.py ``tied`` measures them there).
"""

from __future__ import annotations

from typing import Any

import pytest

from trainfit.analytic.states import tied_gradient_sum
from trainfit.arch.config import spec_from_config
from trainfit.strategy import MemorySavers, Strategy

pytest.importorskip("torch")

import torch
import torch.nn.functional as F

from ._realcpu import peak_in_window

VOCAB, HIDDEN, TOKENS = 2048, 512, 8
TABLE = VOCAB * HIDDEN * 4


def _tables(cast: bool) -> float:
    def body(window: Any) -> None:
        w = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN) * 0.01)
        x = F.embedding(torch.randint(0, VOCAB, (1, TOKENS)), w) * 1.0
        head = F.linear(x.bfloat16(), w.bfloat16()) if cast else F.linear(x, w)
        loss = head.float().logsumexp(-1).sum()
        with window():
            loss.backward()

    return peak_in_window(body) / TABLE


def _spec() -> Any:
    cfg = {
        "model_type": "qwen2", "hidden_size": HIDDEN, "intermediate_size": 1024, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 512,
        "tie_word_embeddings": True,
    }  # fmt: skip
    return spec_from_config(cfg, name="tiny-tied", source="test")


@pytest.mark.parametrize(
    ("precision", "cast"), [("fp32", False), ("pure-bf16", False), ("master-bf16", False), ("amp-bf16", True)]
)
def test_out_of_place_exactly_where_real_autograd_adds_out_of_place(precision: str, cast: bool) -> None:
    tied = tied_gradient_sum(_spec(), Strategy(precision=precision))  # type: ignore[arg-type]
    assert tied is not None
    tables = _tables(cast)
    out_of_place = tied.out_of_place_bytes > 0
    # 3 vs 2 tables without the cast, 2.5 vs 1.5 behind it: the counts sit 0.5 table from the midpoint.
    expected = (3.0 if out_of_place else 2.0) - (0.5 if cast else 0.0)
    assert abs(tables - expected) < 0.05, (precision, tables, out_of_place)
    assert out_of_place == (not cast)
    if out_of_place:
        assert tied.out_of_place_bytes == tied.embedding_grad_bytes


def test_fresh_head_gradients_add_in_place_and_untied_tables_have_no_sum() -> None:
    spec = _spec()
    for loss in ("fused-linear", "chunked"):
        tied = tied_gradient_sum(spec, Strategy(precision="pure-bf16", savers=MemorySavers(loss=loss)))  # type: ignore[arg-type]
        assert tied is not None and tied.out_of_place_bytes == 0, loss
    untied = spec_from_config({**spec.hf_config, "tie_word_embeddings": False}, name="untied", source="test")
    assert tied_gradient_sum(untied, Strategy(precision="pure-bf16")) is None

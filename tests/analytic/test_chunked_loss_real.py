"""The backward of ``trainfit.analytic.savers.chunked_loss_memory`` against real autograd on CPU tensors.

torchtune's chunked cross-entropy on a bare head (a ``vocab × hidden`` weight read by ``F.linear`` once per chunk of
the sequence, each chunk upcast and passed to ``cross_entropy``), its backward counted allocator call by allocator
call (``torch.profiler``; tests/analytic/_realcpu.py). The window opens after the forward, with every chunk's saved
log-softmax output (4·V) alive, so the closed form's moments are compared less those 4·V: inside the first chunk's
log-softmax backward they are all still alive, at the head's first chunk sum they are all gone. Two shapes: a large
table and few tokens (the first sum of the head's chunk gradients is the peak: three tables), many tokens and a small
table (the first chunk's log-softmax backward is).
"""

from __future__ import annotations

from typing import Any

import pytest

from trainfit.analytic.savers import chunked_loss_memory
from trainfit.arch.config import spec_from_config
from trainfit.strategy import MemorySavers, Strategy

pytest.importorskip("torch")

import torch
import torch.nn.functional as F

from ._realcpu import peak_in_window


def _real_backward_peak(vocab: int, hidden: int, tokens: int, chunks: int, dtype: torch.dtype) -> int:
    def body(window: Any) -> None:
        w = torch.nn.Parameter(torch.randn(vocab, hidden, dtype=dtype) * 0.01)
        x = torch.randn(1, tokens, hidden, dtype=dtype, requires_grad=True) * 1.0
        labels = torch.randint(0, vocab, (1, tokens))
        logits = [F.linear(c, w) for c in x.chunk(chunks, dim=1)]  # torchtune: the model returns chunked logits
        total: Any = 0.0
        for lg, lab in zip(logits, labels.chunk(chunks, dim=1), strict=True):  # CEWithChunkedOutputLoss.forward
            total = total + F.cross_entropy(lg.float().flatten(0, 1), lab.flatten(), reduction="sum")
        loss = total / labels.numel()
        del logits
        with window():
            loss.backward()

    return peak_in_window(body, ignore_at_most=64)


@pytest.mark.parametrize(
    ("vocab", "hidden", "tokens", "chunks", "precision"),
    [
        (32768, 64, 16, 8, "pure-bf16"),
        (32768, 64, 16, 8, "fp32"),
        (32768, 64, 32, 4, "pure-bf16"),
        (4096, 16, 1024, 8, "pure-bf16"),
    ],
)
def test_chunked_backward_matches_real_autograd(
    vocab: int, hidden: int, tokens: int, chunks: int, precision: str
) -> None:
    cfg = {
        "model_type": "qwen2", "hidden_size": hidden, "intermediate_size": 4 * hidden, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": vocab, "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    }  # fmt: skip
    spec = spec_from_config(cfg, name="tiny-chunked", source="test")
    s = Strategy(
        precision=precision, micro_batch=1, seq_len=tokens, savers=MemorySavers(loss="chunked", loss_chunks=chunks)
    )  # type: ignore[arg-type]
    closed = chunked_loss_memory(spec, s, keep_logits=False).backward_peak_bytes - 4 * tokens * vocab
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    real = _real_backward_peak(vocab, hidden, tokens, chunks, dtype)
    assert abs(real - closed) <= 16 * 1024, (real, closed)

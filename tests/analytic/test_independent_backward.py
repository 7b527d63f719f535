"""The norm-backward temporaries (``backward_temp_bytes(...).norm_bytes``) against a real CPU backward of the
Hugging Face module, counted allocator event by allocator event (``torch.profiler``), and against the
count by hand from the module's code.

The window is the norm's whole backward, from the incoming gradient (made inside it, as the LM head's
backward makes it) to the input's gradient; tensors the norm saved and releases on the way count
negatively. Only allocations of at least a bf16 t·h tensor are counted: the per-token and per-channel
vectors (the rsqrt's gradient, the weight's and bias's gradients and the CPU kernels' per-thread partial
sums of them, run here on one thread) are left out, as the analytic model leaves them out.

HF ``LlamaRMSNorm`` (input of width r = the residual stream's, 4 or 2 bytes) by hand, in t·h units above
the saved tensors: the incoming gradient r; ``weight * normed``'s backward makes the normed gradient r and
a product r for the weight's gradient (3r), then releases the incoming gradient and the saved normed tensor
(r); the cast back to fp32 (r = 2 only) 4; ``x * rsqrt``'s backward the gradient of x (4) and a product (4)
for the rsqrt's gradient; the mean's backward an expanded gradient (4); ``pow(2)``'s backward
``grad * (2 * x.pow(1))``: three fp32 tensors (12) while the first x gradient (4) waits to be added:
4 + 4 + 12 − r = 20 − r, the peak (16·t·h in fp32, 18·t·h for a bf16 residual).

``LayerNorm`` (GPT-2, BERT): the incoming gradient and the input's gradient, both r: 2r.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from trainfit.analytic.activations import backward_temp_bytes
from trainfit.arch.config import spec_from_config
from trainfit.arch.spec import ModelSpec
from trainfit.strategy import Strategy

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch

from ._realcpu import peak_in_window

SHAPES = [(2, 32, 64), (2, 64, 256)]  # (batch, seq, hidden)
PRECISIONS = [("fp32", "float32", 4), ("pure-bf16", "bfloat16", 2)]


def _spec(model_type: str, hidden: int) -> ModelSpec:
    if model_type == "llama":
        cfg = dict(model_type="llama", hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1)
        cfg |= dict(num_attention_heads=4, num_key_value_heads=4, vocab_size=256)
    else:
        cfg = dict(model_type="gpt2", n_embd=hidden, n_layer=1, n_head=4, vocab_size=256, n_positions=256)
    return spec_from_config(cfg, name=f"tiny-{model_type}", source="test")


def _measured(make_norm: Callable[[], Any], t: int, h: int, dtype: Any) -> int:
    def run(window: Callable[[], Any]) -> None:
        torch.manual_seed(0)
        norm = make_norm().to(dtype)
        x = torch.randn(t, h, dtype=dtype, requires_grad=True)
        head = torch.randn(t, h, dtype=dtype)  # stands in for the LM head: its backward makes the grad
        y = norm(x)
        loss = (y * head).sum()
        del y  # the head's saved input is released by its own backward, before the norm's
        with window():
            loss.backward()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return peak_in_window(run, ignore_at_most=2 * t * h - 1)
    finally:
        torch.set_num_threads(threads)


def _analytic(model_type: str, precision: str, b: int, s: int, h: int) -> int:
    st = Strategy(precision=precision, micro_batch=b, seq_len=s)
    return int(backward_temp_bytes(_spec(model_type, h), st).norm_bytes)


def _rmsnorm(h: int) -> Callable[[], Any]:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return lambda: LlamaRMSNorm(h)


@pytest.mark.parametrize(("precision", "dtype", "r"), PRECISIONS)
@pytest.mark.parametrize(("b", "s", "h"), SHAPES)
def test_rmsnorm_backward_by_hand(precision: str, dtype: str, r: int, b: int, s: int, h: int) -> None:
    t = b * s
    assert _measured(_rmsnorm(h), t, h, getattr(torch, dtype)) == (20 - r) * t * h


@pytest.mark.parametrize(("precision", "dtype", "r"), PRECISIONS)
@pytest.mark.parametrize(("b", "s", "h"), SHAPES)
def test_rmsnorm_backward_never_below_a_real_run(precision: str, dtype: str, r: int, b: int, s: int, h: int) -> None:
    """An estimate may be high, never low: the analytic temporaries cover the real ones."""
    assert _analytic("llama", precision, b, s, h) >= _measured(_rmsnorm(h), b * s, h, getattr(torch, dtype))


@pytest.mark.parametrize(("precision", "dtype", "r"), PRECISIONS)
def test_rmsnorm_backward_matches_a_real_run(precision: str, dtype: str, r: int) -> None:
    b, s, h = SHAPES[0]
    assert _analytic("llama", precision, b, s, h) == _measured(_rmsnorm(h), b * s, h, getattr(torch, dtype))


@pytest.mark.parametrize(("precision", "dtype", "r"), PRECISIONS)
@pytest.mark.parametrize(("b", "s", "h"), SHAPES)
def test_layernorm_backward_matches_a_real_run(precision: str, dtype: str, r: int, b: int, s: int, h: int) -> None:
    t = b * s
    measured = _measured(lambda: torch.nn.LayerNorm(h), t, h, getattr(torch, dtype))
    assert measured == 2 * r * t * h
    assert _analytic("gpt2", precision, b, s, h) == measured

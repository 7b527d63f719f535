"""CUDA kernel emulation: SDPA backend choice and saved tensors, fused dropout's bool mask."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from trainfit.trace import kernels as K  # noqa: E402
from trainfit.trace import tracker as tk  # noqa: E402

bf16 = torch.bfloat16


def _qkv(dtype: torch.dtype, hq: int = 8, hkv: int = 2, d: int = 64, s: int = 256):
    return (
        torch.empty(2, hq, s, d, dtype=dtype, requires_grad=True),
        torch.empty(2, hkv, s, d, dtype=dtype, requires_grad=True),
        torch.empty(2, hkv, s, d, dtype=dtype, requires_grad=True),
    )


def test_backend_choice_follows_sdp_utils() -> None:
    with FakeTensorMode():
        q, k, v = _qkv(bf16)
        assert K.sdpa_backend(q, k, v, None, True) == K.FLASH
        mask = torch.empty(2, 1, 256, 256, dtype=torch.bool)
        assert K.sdpa_backend(q, k, v, mask, False) == K.EFFICIENT  # flash takes no mask
        q32, k32, v32 = _qkv(torch.float32)
        assert K.sdpa_backend(q32, k32, v32, None, True) == K.EFFICIENT  # flash is 16-bit only
        q5, k5, v5 = _qkv(bf16, d=320)
        assert K.sdpa_backend(q5, k5, v5, None, True) == K.EFFICIENT  # flash head dim <= 256


def test_flash_saves_output_and_logsumexp_not_probabilities() -> None:
    tr = tk.Tracker()
    with FakeTensorMode():
        q, k, v = _qkv(bf16)
        with tr, K.CudaKernels() as kern:
            tr.phase = tk.FORWARD
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            tr.forward_end[0] = tr.t
        assert kern.sdpa_calls == {K.FLASH: 1}
        live = sum(r.nbytes for r in tr.live_at(tr.t))
        # out (bf16, like q) + logsumexp fp32 [B, H, L]; no [B, H, L, L] scores
        assert live == q.numel() * 2 + 2 * 8 * 256 * 4
        del out


def test_flash_backward_workspace() -> None:
    tr = tk.Tracker()
    with FakeTensorMode():
        q, k, v = _qkv(bf16)
        with tr, K.CudaKernels():
            tr.mark([q, k, v], tk.WEIGHTS)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            grad_out = torch.empty_like(out)
            start = tr.t
            tr.phase = tk.BACKWARD
            out.backward(grad_out)
        base, pk = tr.peaks([tk.Interval("start", start, start), tk.Interval("bwd", start, tr.t)])
        b, hq, hkv, s, d = 2, 8, 2, 256, 64
        dq = b * hq * s * d * 2
        dk = dv = b * hkv * s * d * 2
        softmax_d = b * hq * 256 * 4  # round128(s) fp32
        dq_accum = b * 256 * hq * 64 * 4  # [b, round128(s), h, round32(d)] fp32
        dk_exp = dv_exp = b * s * hq * d * 2  # GQA: expanded to the query heads, then summed
        assert pk.total_bytes - base.total_bytes == dq + dk + dv + softmax_d + dq_accum + dk_exp + dv_exp
        del out, grad_out


def test_fused_dropout_saves_a_bool_mask() -> None:
    with FakeTensorMode():
        x = torch.empty(64, 64, requires_grad=True)
        with K.CudaKernels():
            y = F.dropout(x, p=0.1, training=True)
        assert y.grad_fn is not None and "NativeDropout" in type(y.grad_fn).__name__
        y0 = F.dropout(x, p=0.0, training=True)
        assert y0 is x or y0.grad_fn is None or "NativeDropout" not in type(y0.grad_fn).__name__

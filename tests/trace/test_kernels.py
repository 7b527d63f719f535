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
        q, k, v = _qkv(bf16)  # 8 query heads, 2 k/v heads
        assert K.sdpa_backend(q, k, v, None, True, enable_gqa=True) == K.FLASH
        qm, km, vm = _qkv(bf16, hkv=8)
        assert K.sdpa_backend(qm, km, vm, None, True) == K.FLASH
        mask = torch.empty(2, 1, 256, 256, dtype=torch.bool)
        assert K.sdpa_backend(qm, km, vm, mask, False) == K.EFFICIENT  # flash takes no mask
        q32, k32, v32 = _qkv(torch.float32, hkv=8)
        assert K.sdpa_backend(q32, k32, v32, None, True) == K.EFFICIENT  # flash is 16-bit only
        q5, k5, v5 = _qkv(bf16, d=320, hkv=8)
        assert K.sdpa_backend(q5, k5, v5, None, True) == K.EFFICIENT  # flash head dim <= 256


def test_fewer_kv_heads_need_enable_gqa_and_flash() -> None:
    """check_batch_size_and_num_heads_dense: flash accepts fewer k/v heads only with enable_gqa; the
    memory-efficient kernel never does (supports_grouped_query_attention=false), so multi-query inputs
    without enable_gqa (HF Falcon) or with a mask take the math kernel."""
    with FakeTensorMode():
        q, k, v = _qkv(bf16, hkv=1)
        assert K.sdpa_backend(q, k, v, None, True) == K.MATH
        mask = torch.empty(2, 1, 256, 256, dtype=torch.bool)
        assert K.sdpa_backend(q, k, v, mask, False) == K.MATH
        assert K.sdpa_backend(q, k, v, mask, False, enable_gqa=True) == K.MATH
        assert K.sdpa_backend(q, k, v, None, True, enable_gqa=True) == K.FLASH


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


def test_fused_dropout_saves_a_bool_mask_made_before_its_output() -> None:
    """CUDA's ``dropout_cuda`` (aten/src/ATen/native/cuda/Dropout.cu) allocates the mask, then the output: the
    H200 snapshot of bert-large shows every attention dropout's 16 MiB mask before its 64 MiB output."""
    with FakeTensorMode():
        x = torch.empty(64, 64, requires_grad=True)
        tr = tk.Tracker()
        with tr, K.CudaKernels():
            y = F.dropout(x, p=0.1, training=True)
        assert [r.nbytes for r in tr.records] == [64 * 64, 64 * 64 * 4]  # the bool mask, then the fp32 output
        assert y.grad_fn is not None
        (mask,) = y.grad_fn.saved_tensors
        assert mask.dtype == torch.bool and mask.shape == x.shape
        (g,) = torch.autograd.grad(y, x, torch.ones_like(y))
        assert g.shape == x.shape and g.dtype == x.dtype
        y0 = F.dropout(x, p=0.0, training=True)
        assert y0 is x or y0.grad_fn is None or "Dropout" not in type(y0.grad_fn).__name__


def _softmax_ops(x: torch.Tensor, call: object) -> list[str]:
    """The ops that allocated while ``call(x)`` ran (its output must be fp32)."""
    tr = tk.Tracker()
    with tr:
        y = call(x)  # type: ignore[operator]
    assert y.dtype == torch.float32
    return [r.op for r in tr.records]


@pytest.mark.parametrize(("dtype", "copies"), [(torch.float16, 0), (bf16, 1)])
def test_softmax_upcast_fuses_only_fp16(dtype: torch.dtype, copies: int) -> None:
    """SoftMax.cpp: ``softmax(x, dtype=float32)`` on CUDA takes ``_softmax(x, half_to_float=True)`` for an
    fp16 input; bf16 is converted to fp32 first (one fp32 copy of the input)."""
    with FakeTensorMode():
        x = torch.empty(4, 8, 128, 128, dtype=dtype, requires_grad=True)
        with K.CudaKernels():
            ops = _softmax_ops(x, lambda t: F.softmax(t, dim=-1, dtype=torch.float32))
    assert ops.count("_to_copy.default") == copies
    assert ops.count("_softmax.default") == 1


def test_autocast_softmax_fuses_fp16() -> None:
    """CUDA autocast's fp32_set_opt_dtype policy gives GPT-2/BERT's plain ``softmax`` an fp32 output; for
    an fp16 input that is the fused kernel too."""
    from trainfit.trace import autocast as ac

    with FakeTensorMode():
        x = torch.empty(4, 8, 128, 128, dtype=torch.float16, requires_grad=True)
        with ac.cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.float16):
            ops = _softmax_ops(x, lambda t: F.softmax(t, dim=-1))
    assert "_to_copy.default" not in ops


def test_softmax_on_real_tensors_is_untouched() -> None:
    x = torch.zeros(2, 3, dtype=torch.float16)
    with K.CudaKernels():
        y = F.softmax(x, dim=-1, dtype=torch.float32)
    assert y.dtype == torch.float32 and torch.allclose(y, torch.full((2, 3), 1 / 3))


def _grouped_saves_and_grads(call: object, a_grad: bool, b_grad: bool) -> tuple[list[tuple[object, ...]], tuple]:
    """Shapes/dtypes a grouped matmul's autograd node packs, and which operands get a gradient."""
    a = torch.randn(32, 16, requires_grad=a_grad)
    b = torch.randn(2, 16, 8, requires_grad=b_grad)
    packed: list[tuple[object, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():  # the real node also saves the int32 ``offs``, which the stand-in takes as given
            packed.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = call(a, b)  # type: ignore[operator]
    out.backward(torch.ones_like(out))
    grads = tuple(None if t.grad is None else (tuple(t.grad.shape), t.grad.dtype) for t in (a, b))
    return sorted(packed, key=str), grads


@pytest.mark.parametrize(("a_grad", "b_grad"), [(True, True), (True, False), (False, True)])
def test_grouped_mm_fallback_saves_what_the_real_node_saves(a_grad: bool, b_grad: bool) -> None:
    """The fp32 stand-in against the real ``GroupedMmBackward0`` (CPU fp32 kernel): frozen experts
    (weight without grad) save no input and get no weight gradient; a frozen input saves no weight."""
    offs = torch.tensor([12, 32], dtype=torch.int32)
    real = _grouped_saves_and_grads(lambda a, b: torch._grouped_mm(a, b, offs=offs), a_grad, b_grad)
    fallback = _grouped_saves_and_grads(K._GroupedMMFallback.apply, a_grad, b_grad)
    assert fallback == real

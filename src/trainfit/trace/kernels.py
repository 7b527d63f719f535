"""CUDA kernels whose memory differs from what their CPU twins would do, emulated for the trace.

Fake tensors carry a CPU device, so PyTorch would pick CPU code paths. Where the CPU path allocates or saves
different tensors than the CUDA path a GPU run takes, a ``TorchFunctionMode`` swaps in an emulation that
allocates exactly what the CUDA kernel allocates (values are irrelevant under fake tensors):

* ``scaled_dot_product_attention``: CUDA picks FlashAttention-2 (fp16/bf16, no mask, head dim ≤ 256, fewer
  k/v heads only with ``enable_gqa``) or the memory-efficient kernel (any float dtype, additive mask, equal
  head counts), else the math fallback — the priority of ``select_sdp_backend`` in
  aten/src/ATen/native/transformers/cuda/sdp_utils.cpp for sm80+ (``check_batch_size_and_num_heads_dense``
  is instantiated with GQA support for flash only). The math kernel runs as aten's own composite. Both fused
  kernels save q, k, v, the output and a float32 logsumexp (flash: [B, H, Lq]; efficient: Lq rounded up to
  32) — not the [B, H, Lq, Lk] probabilities. Flash backward allocates dq/dk/dv plus ``softmax_d`` fp32
  [B, H, round128(Lq)], ``dq_accum`` fp32 [B, round128(Lq), H, round32(d)] and, for GQA, dk/dv expanded to
  the query heads (``mha_bwd`` in aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp). The
  efficient kernel's bool mask is first turned into an additive mask of the query dtype
  (``convert_boolean_attn_mask``) and padded to a multiple of 16 columns (``preprocess_mask``), and it is
  that tensor the kernel saves. cuDNN attention (preferred on sm90 by recent builds) saves the same bytes
  as flash.
* ``dropout``: on CUDA ``aten::dropout`` takes the fused ``native_dropout`` path, which allocates a bool mask
  (1 byte/element), then its output, and saves the mask; the CPU path multiplies by a noise tensor of the
  input dtype and saves that (``is_fused_kernel_acceptable`` in aten/src/ATen/native/Dropout.cpp).
* ``softmax(x, dim, dtype=float32)`` on an fp16 ``x``: CUDA runs the fused ``_softmax(x, dim,
  half_to_float=True)``, while every other device and dtype (bf16 included) first converts ``x`` to fp32 — a
  full-size copy (``softmax`` in aten/src/ATen/native/SoftMax.cpp). :func:`cuda_softmax` emulates the fused
  path; autocast's ``fp32_set_opt_dtype`` policy for ``softmax`` reaches it too.
* ``grouped_mm`` (Hugging Face's MoE experts): the meta kernel accepts only bf16 (it mirrors the sm90 fast
  path); other dtypes take CUDA's loop-of-mm fallback, whose memory is its output plus, for backward, the
  operands ``GroupedMmBackward0`` saves — the weight only if the input needs a gradient, the input only if
  the weight does (frozen experts save no input). We emulate that fallback.

Anything else runs unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from trainfit.cuda_facts import SdpaKernel, sdpa_kernel_for

FLASH, EFFICIENT, MATH = SdpaKernel.FLASH, SdpaKernel.EFFICIENT, SdpaKernel.MATH

_HALF = (torch.float16, torch.bfloat16)
#: The builtin itself: the selective-recompute trace (trace/savers.py) may wrap the module attribute for a run.
SDPA = F.scaled_dot_product_attention


def cuda_softmax(x: Any, dim: Any, dtype: Any) -> torch.Tensor | None:
    """The fused fp16 → fp32 softmax CUDA takes for ``softmax(x, dim, dtype=float32)``, or ``None`` where
    the composite path (convert, then softmax) is what CUDA runs too. Fake tensors only: the CPU kernel
    refuses ``half_to_float``."""
    from torch._subclasses.fake_tensor import is_fake

    if dtype != torch.float32 or not isinstance(x, torch.Tensor) or x.dtype != torch.float16 or dim is None:
        return None
    if not is_fake(x):
        return None
    out: torch.Tensor = torch.ops.aten._softmax(x, dim, True)
    return out


def _round(x: int, m: int) -> int:
    return -(-x // m) * m


def sdpa_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    enable_gqa: bool = False,
    flash: bool = True,
) -> SdpaKernel:
    """The CUDA SDPA backend an sm80+ GPU picks for these inputs (``select_sdp_backend``, default priority
    flash > memory-efficient > math). Both fused kernels need q, k and v with the same batch and head counts
    (``check_batch_size_and_num_heads_dense``); only flash accepts fewer k/v heads, and only with
    ``enable_gqa`` — the memory-efficient kernel is instantiated without GQA support. So multi-query
    attention called without ``enable_gqa`` (HF Falcon) falls back to the math kernel."""
    lq, lk = q.size(-2), k.size(-2)
    hq, hk, hv = q.size(-3), k.size(-3), v.size(-3)
    if q.dtype not in (*_HALF, torch.float32):
        return MATH
    return sdpa_kernel_for(
        half=q.dtype in _HALF,
        masked=attn_mask is not None,
        same_heads=hq == hk == hv,
        gqa_ok=enable_gqa and hk == hv and hq % hk == 0,
        head_dim=q.size(-1),
        v_head_dim=v.size(-1),
        causal_cross=is_causal and lq != lk,
        flash_capable=flash,
    )


#: Set while an emulated fused attention kernel allocates its outputs: a selective-checkpointing policy that
#: saves the outputs of CUDA's ``_scaled_dot_product_flash_attention`` / ``_efficient_attention`` ops saves
#: what the emulation allocates instead (trainfit.trace.savers ``sac_context_fn``).
FUSED_ATTENTION_OUTPUTS = [False]


class _FusedAttention(torch.autograd.Function):
    """Allocates and saves what CUDA's flash / memory-efficient attention allocates and saves."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, backend: str
    ) -> torch.Tensor:
        b, hq, lq, _ = q.shape
        dv = v.size(-1)
        FUSED_ATTENTION_OUTPUTS[0] = True
        try:
            out = q.new_empty((b, lq, hq, dv)).transpose(1, 2)
            lse_len = lq if backend == FLASH else _round(lq, 32)
            lse = q.new_empty((b, hq, lse_len), dtype=torch.float32)
        finally:
            FUSED_ATTENTION_OUTPUTS[0] = False
        ctx.backend = backend
        ctx.save_for_backward(q, k, v, out, lse, bias)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, _out, _lse, _bias = ctx.saved_tensors
        b, hq, lq, d = q.shape
        lk = k.size(-2)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if ctx.backend == FLASH:
            softmax_d = q.new_empty((b, hq, _round(lq, 128)), dtype=torch.float32)
            dq_accum = q.new_empty((b, _round(lq, 128), hq, _round(d, 32)), dtype=torch.float32)
            if k.size(1) != hq:
                dk_exp = q.new_empty((b, lk, hq, d))
                dv_exp = q.new_empty((b, lk, hq, v.size(-1)))
                del dk_exp, dv_exp
            del dq_accum, softmax_d
        else:
            delta = q.new_empty((b, hq, lq), dtype=torch.float32)
            del delta
        return dq, dk, dv, None, None


class _CudaDropout(torch.autograd.Function):
    """``native_dropout`` as CUDA allocates it: the bool mask first, then the output (``dropout_cuda`` in
    aten/src/ATen/native/cuda/Dropout.cu); the meta kernel fake tensors run makes them the other way round, which
    moved a 16 MiB mask and a 64 MiB output of bert-large's attention into each other's blocks (H200 allocator
    snapshot, 2026-12-04). Saves the mask, as ``NativeDropoutBackward0`` does, and backward is
    ``native_dropout_backward``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, p: float) -> torch.Tensor:
        mask = torch.empty_like(x, dtype=torch.bool)
        out = torch.empty_like(x)
        ctx.scale = 1.0 / (1.0 - p)
        ctx.save_for_backward(mask)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (mask,) = ctx.saved_tensors
        return torch.ops.aten.native_dropout_backward(grad, mask, ctx.scale), None


def _efficient_bias(attn_mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``convert_boolean_attn_mask`` then ``preprocess_mask`` (pad the last dim to 16) as on CUDA."""
    mask = attn_mask
    if mask.dtype == torch.bool:
        # torch 2.13 ``convert_boolean_attn_mask_``: at::where(mask, scalar_tensor(0.0), scalar_tensor(-inf)) in
        # q's dtype — two 0-dim scalars and the output, no ``logical_not`` copy of the mask (a dispatch log of
        # the CPU composite shows scalar_tensor, scalar_tensor, where.self; older releases inverted the mask).
        zero, neg_inf = torch.zeros((), dtype=q.dtype), torch.full((), float("-inf"), dtype=q.dtype)
        mask = torch.where(mask, zero, neg_inf)
    elif mask.dtype != q.dtype:
        mask = mask.to(q.dtype)
    lk = k.size(-2)
    if lk % 16:
        mask = F.pad(mask, (0, _round(lk, 16) - lk))[..., :lk]
    return mask.expand(q.size(0), q.size(1), q.size(-2), lk)


def emulated_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    calls: dict[SdpaKernel, int] | None = None,
    flash: bool = True,
) -> torch.Tensor:
    if torch.is_autocast_enabled("cpu"):  # SDPA is on CUDA autocast's lower-precision list
        low = torch.get_autocast_dtype("cpu")
        with torch.autocast("cpu", enabled=False):
            query, key, value = (t.to(low) if t.dtype in (torch.float32, *_HALF) else t for t in (query, key, value))
            if attn_mask is not None and attn_mask.is_floating_point():
                attn_mask = attn_mask.to(low)
    backend = sdpa_backend(query, key, value, attn_mask, is_causal, enable_gqa, flash)
    if calls is not None:
        calls[backend] = calls.get(backend, 0) + 1
    with torch.autocast("cpu", enabled=False):
        if backend == MATH:
            math: Any = torch.ops.aten._scaled_dot_product_attention_math
            out: torch.Tensor = math(
                query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
            )[0]
            return out
        bias = _efficient_bias(attn_mask, query, key) if (backend == EFFICIENT and attn_mask is not None) else None
        apply: Any = _FusedAttention.apply
        fused: torch.Tensor = apply(query, key, value, bias, backend)
        return fused


class _GroupedMMFallback(torch.autograd.Function):
    """Saves and computes what ``GroupedMmBackward0`` does (tools/autograd/derivatives.yaml ``_grouped_mm``:
    ``self: grouped_mm_mat1_backward(grad, mat2, ...)``, ``mat2: grouped_mm_mat2_backward(grad, self, ...)``):
    ``mat2`` is saved only when ``self`` needs a gradient and ``self`` only when ``mat2`` does, and only the
    gradients of operands that require one are made — so frozen experts save no input and get no
    weight-sized gradient. Checked against the real node on meta bf16 tensors in tests/trace/test_kernels.py."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.save_for_backward(b if need_a else None, a if need_b else None)
        ctx.operands = (a.shape, a.dtype, b.shape, b.dtype)
        return a.new_empty((a.size(0), b.size(-1)))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        b, a = ctx.saved_tensors
        a_shape, a_dtype, b_shape, b_dtype = ctx.operands
        grad_a = grad.new_empty(a_shape, dtype=a_dtype) if b is not None else None
        grad_b = grad.new_empty(b_shape, dtype=b_dtype) if a is not None else None
        return grad_a, grad_b


class CudaKernels(TorchFunctionMode):
    """Route the ops above to their CUDA emulation while active."""

    def __init__(self, *, flash: bool = True) -> None:
        super().__init__()
        self.flash = flash  # the GPU offers FlashAttention (compute capability >= 8.0)
        self.sdpa_calls: dict[SdpaKernel, int] = {}
        self._grouped = {f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is SDPA:
            return emulated_sdpa(*args, **kwargs, calls=self.sdpa_calls, flash=self.flash)
        if func is F.softmax:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            dtype = args[3] if len(args) > 3 else kwargs.get("dtype")
            fused = cuda_softmax(args[0], dim, dtype)
            if fused is not None:
                return fused
            return func(*args, **kwargs)
        if func is F.dropout:
            x = args[0]
            p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            training = args[2] if len(args) > 2 else kwargs.get("training", True)
            inplace = args[3] if len(args) > 3 else kwargs.get("inplace", False)
            if training and 0.0 < p < 1.0 and x.numel() > 0 and not inplace:
                from torch._subclasses.fake_tensor import is_fake

                if not (is_fake(x) and x.requires_grad and torch.is_grad_enabled()):  # values matter off fake tensors
                    return torch.ops.aten.native_dropout(x, p, True)[0]
                dropout: Any = _CudaDropout.apply
                out: torch.Tensor = dropout(x, p)
                return out
            return func(*args, **kwargs)
        if func in self._grouped:
            a, b = args[0], args[1]
            if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
                apply: Any = _GroupedMMFallback.apply
                return apply(a, b)
        return func(*args, **kwargs)

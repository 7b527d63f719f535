"""CUDA autocast policy, applied to CPU tensors.

The trace runs on (fake) CPU tensors, but CPU autocast is a different policy from CUDA autocast: under
``torch.autocast("cpu", bfloat16)`` softmax, layer_norm, exp and sum return bf16, while CUDA autocast runs
them in fp32 (and, e.g., layer_norm then saves an fp32 copy of its input for backward). A trace that claims
to predict a GPU run has to apply CUDA's lists. We do it at the same dispatch key autocast uses: for every
op on CUDA's lists we register a Python kernel for the ``AutocastCPU`` key implementing CUDA's policy for
it, and every op only CPU autocast touches gets a pass-through kernel. Dropping the ``torch.library``
object restores PyTorch's own kernels.

The lists and policies below are CUDA's ``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``,
``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE`` and ``AT_FORALL_PROMOTE``
(aten/src/ATen/autocast_mode.h) as registered for the ``Autocast`` (CUDA) key in
aten/src/ATen/autocast_mode.cpp; the user-facing table is PyTorch's "Autocast Op Reference". A test holds
this table to the set of ops that actually carry an ``AutocastCUDA`` kernel in the installed torch.

Casting follows ``at::autocast::cached_cast``: only floating, non-double tensors are cast; lower-precision
casts of fp32 leaf tensors that require grad (the weights) are cached for the autocast region. Ops on both
the CPU and the CUDA lower-precision list keep PyTorch's C++ kernel (same policy, same C++ cache); the few
CUDA-only lower-precision ops (einsum, mv, addmv, ...) use a Python cache cleared with the C++ one.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from trainfit.trace.kernels import cuda_softmax

LOWER, FP32, FP32_SET_OPT_DTYPE, FP32_APPEND_DTYPE, PROMOTE, BANNED, PASSTHROUGH = (
    "lower_precision_fp",
    "fp32",
    "fp32_set_opt_dtype",
    "fp32_append_dtype",
    "promote",
    "banned",
    "passthrough",
)

#: AT_FORALL_LOWER_PRECISION_FP + cudnn_convolution(_transpose) — autocast_mode.h / autocast_mode.cpp.
CUDA_LOWER_PRECISION_FP: tuple[str, ...] = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu",
    "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm",
    "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
    "cudnn_convolution", "cudnn_convolution_transpose",
)  # fmt: skip

#: AT_FORALL_FP32 — autocast_mode.h.
CUDA_FP32: tuple[str, ...] = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
    "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus",
    "layer_norm", "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm",
    "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
    "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
    "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist",
    "cdist", "renorm", "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d",
    "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d",
    "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
    "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)  # fmt: skip

#: AT_FORALL_FP32_SET_OPT_DTYPE — autocast_mode.h (run in fp32 by setting the optional output dtype).
CUDA_FP32_SET_OPT_DTYPE: tuple[str, ...] = (
    "prod", "prod.dim_int", "prod.dim_Dimname", "softmax.int", "softmax.Dimname", "log_softmax.int",
    "log_softmax.Dimname", "cumprod", "cumprod.dimname", "cumsum", "cumsum.dimname",
    "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
    "sum.dim_DimnameList",
)  # fmt: skip

#: AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE — norm overloads without a dtype redispatch to the dtype ones.
CUDA_FP32_APPEND_DTYPE: dict[str, str] = {
    "norm.Scalar": "norm.ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
    "norm.names_ScalarOpt_dim": "norm.names_ScalarOpt_dim_dtype",
}

#: AT_FORALL_PROMOTE — autocast_mode.h (run in the widest floating dtype among the arguments).
CUDA_PROMOTE: tuple[str, ...] = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
    "tensordot", "scatter_add",
)  # fmt: skip

#: ``binary_cross_entropy`` raises under CUDA autocast (autocast_mode.cpp, binary_cross_entropy_banned).
CUDA_BANNED: tuple[str, ...] = ("binary_cross_entropy",)


def cuda_policy_table() -> dict[str, str]:
    """``"op.overload"`` → CUDA autocast policy (overload ``default`` is written without a suffix)."""
    table: dict[str, str] = {}
    for name in CUDA_LOWER_PRECISION_FP:
        table[name] = LOWER
    for name in CUDA_FP32:
        table[name] = FP32
    for name in CUDA_FP32_SET_OPT_DTYPE:
        table[name] = FP32_SET_OPT_DTYPE
    for name in CUDA_FP32_APPEND_DTYPE:
        table[name] = FP32_APPEND_DTYPE
    for name in CUDA_PROMOTE:
        table[name] = PROMOTE
    for name in CUDA_BANNED:
        table[name] = BANNED
    return table


def _overload(qualname: str) -> torch._ops.OpOverload | None:
    name, _, ov = qualname.partition(".")
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return None
    try:
        return getattr(packet, ov or "default")  # type: ignore[no-any-return]
    except AttributeError:
        return None


def registered_ops(dispatch_key: str) -> set[str]:
    """Ops (``"name.overload"``) with a kernel for ``dispatch_key`` in the running torch."""
    out = set()
    for full in torch._C._dispatch_get_all_op_names():
        if full.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(full, dispatch_key):
            out.add(full[len("aten::") :])
    return out


@functools.cache
def _autocast_cpu_ops() -> frozenset[str]:
    """``registered_ops("AutocastCPU")``, read once per process: a read asks the dispatcher about every aten op
    (~50 ms, once per traced layout before). PyTorch's own ``AutocastCPU`` kernels are fixed once torch is loaded;
    the only ones added later are :func:`cuda_autocast_policy`'s, for ops of the CUDA table, and dropped on exit —
    a read taken while a policy is installed differs only by those, which the pass-through set leaves out."""
    return frozenset(registered_ops("AutocastCPU"))


_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _eligible(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in _FLOATS


class _PyCastCache:
    """The Python twin of autocast's weight-cast cache, for the CUDA-only lower-precision ops."""

    def __init__(self) -> None:
        self._cache: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}

    def clear(self) -> None:
        self._cache.clear()

    def cast(self, t: torch.Tensor, to: torch.dtype) -> torch.Tensor:
        lower = torch.get_autocast_dtype("cpu")
        cacheable = (
            to == lower
            and t.dtype == torch.float32
            and t.requires_grad
            and t.is_leaf
            and not t._is_view()
            and torch.is_autocast_cache_enabled()
        )
        if not cacheable:
            return t.to(to)
        hit = self._cache.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        out = t.to(to)
        self._cache[id(t)] = (weakref.ref(t), out)
        return out


def _cast_tree(x: Any, to: torch.dtype, cache: _PyCastCache) -> Any:
    if isinstance(x, torch.Tensor):
        return cache.cast(x, to) if _eligible(x) and x.dtype != to else x
    if isinstance(x, (list, tuple)):
        return type(x)(_cast_tree(v, to, cache) for v in x)
    return x


def _flat_tensors(xs: Any) -> Iterator[torch.Tensor]:
    for x in xs:
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            yield from _flat_tensors(x)


def _make_kernel(
    op: torch._ops.OpOverload, policy: str, cache: _PyCastCache, redispatch: torch._ops.OpOverload | None
) -> Callable[..., Any]:
    schema = op._schema
    arg_names = [a.name for a in schema.arguments]
    dtype_idx = arg_names.index("dtype") if "dtype" in arg_names else -1
    dtype_kwonly = dtype_idx >= 0 and schema.arguments[dtype_idx].kwarg_only
    no_autocast = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    composite = torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")  # type: ignore[no-untyped-call]
    is_softmax = schema.name == "aten::softmax"

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if policy == PASSTHROUGH and composite:
            # CUDA has no autocast kernel here: the op falls through and decomposes, and its parts meet
            # autocast again (cross_entropy_loss -> log_softmax in fp32 + nll_loss).
            return op.decompose(*args, **kwargs)
        with torch._C._ExcludeDispatchKeyGuard(no_autocast):
            if policy == PASSTHROUGH:
                return op(*args, **kwargs)
            if policy == BANNED:
                raise RuntimeError(
                    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast "
                    "(CUDA autocast raises here); use binary_cross_entropy_with_logits"
                )
            if policy == LOWER:
                to = torch.get_autocast_dtype("cpu")
                return op(*_cast_tree(list(args), to, cache), **_cast_tree_kw(kwargs, to, cache))
            if policy == FP32:
                return op(*_cast_tree(list(args), torch.float32, cache), **_cast_tree_kw(kwargs, torch.float32, cache))
            if policy == FP32_SET_OPT_DTYPE:
                first = args[0] if args else None
                if not _eligible(first):
                    return op(*args, **kwargs)
                given = args[dtype_idx] if len(args) > dtype_idx else kwargs.get("dtype")
                if is_softmax and given in (None, torch.float32):
                    fused = cuda_softmax(first, args[1] if len(args) > 1 else kwargs.get("dim"), torch.float32)
                    if fused is not None:
                        return fused
                if given is None:
                    if dtype_kwonly or len(args) <= dtype_idx:
                        kwargs = {**kwargs, "dtype": torch.float32}
                    else:
                        args = (*args[:dtype_idx], torch.float32, *args[dtype_idx + 1 :])
                return op(*args, **kwargs)
            if policy == FP32_APPEND_DTYPE:
                assert redispatch is not None
                first = args[0]
                out_type = torch.float32 if _eligible(first) else first.dtype
                full = list(args)
                for a in schema.arguments[len(full) :]:
                    full.append(kwargs.get(a.name, a.default_value if a.has_default_value() else None))
                return redispatch(*full, dtype=out_type)
            # PROMOTE
            lower = torch.get_autocast_dtype("cpu")
            to = lower
            for t in _flat_tensors(list(args) + list(kwargs.values())):
                if _eligible(t) and t.dtype != torch.float64 and (to == torch.float32 or t.dtype == torch.float32):
                    to = torch.float32
            return op(*_cast_tree(list(args), to, cache), **_cast_tree_kw(kwargs, to, cache))

    return kernel


def _cast_tree_kw(kwargs: dict[str, Any], to: torch.dtype, cache: _PyCastCache) -> dict[str, Any]:
    return {k: _cast_tree(v, to, cache) for k, v in kwargs.items()}


@contextlib.contextmanager
def cuda_autocast_policy() -> Iterator[dict[str, str]]:
    """Within this context, CPU autocast follows CUDA's op lists and policies. Yields what was installed."""
    cpu_ops = _autocast_cpu_ops()
    cpu_lower = {
        "conv1d", "conv1d.padding", "conv2d", "conv2d.padding", "conv3d", "conv3d.padding", "bmm", "mm",
        "linalg_vecdot", "baddbmm", "addmm", "addbmm", "linear", "_convolution.deprecated", "matmul",
        "conv_tbc", "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "prelu",
        "scaled_dot_product_attention",
    }  # fmt: skip  # AutocastCPU lower_precision_fp kernels shared with CUDA (autocast_mode.cpp)
    table = cuda_policy_table()
    cache = _PyCastCache()
    library: Any = torch.library.Library
    lib = library("aten", "IMPL")
    installed: dict[str, str] = {}

    def install(qualname: str, policy: str) -> None:
        op = _overload(qualname)
        if op is None:
            return
        redispatch = _overload(CUDA_FP32_APPEND_DTYPE[qualname]) if policy == FP32_APPEND_DTYPE else None
        lib.impl(qualname, _make_kernel(op, policy, cache, redispatch), "AutocastCPU")
        installed[qualname] = policy

    orig_clear = torch.clear_autocast_cache

    def clear_both() -> None:
        cache.clear()
        orig_clear()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        for qualname, policy in table.items():
            if policy == LOWER and qualname in cpu_lower:
                continue  # PyTorch's C++ AutocastCPU kernel already implements this policy
            install(qualname, policy)
        for qualname in sorted(cpu_ops - set(table)):
            install(qualname, PASSTHROUGH)
    torch.clear_autocast_cache = clear_both
    try:
        yield installed
    finally:
        torch.clear_autocast_cache = orig_clear
        cache.clear()
        lib._destroy()

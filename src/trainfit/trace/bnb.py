"""bitsandbytes layers on fake tensors, shared by the training trace (QLoRA / LLM.int8 bases, trace/peft.py) and
the ``generate`` trace (``--dtype int8|nf4|fp4``, trace/generate.py).

Construction: every module transformers' ``replace_with_bnb_linear`` (transformers/integrations/bitsandbytes.py)
converts becomes a meta ``bnb.nn.Linear4bit`` / ``bnb.nn.Linear8bitLt`` — exactly ``nn.Linear`` (a subclass such
as Falcon's ``FalconLinear`` stays float) and GPT-2's ``Conv1D``, whose (in, out) weight its quantize op transposes
to (out, in) — but the output head (``modules_to_not_convert``, checked against transformers' own function in
tests/trace/test_peft.py); once the model's parameters are fake tensors, each 4-bit weight is quantised
*on a fake tensor* with ``bitsandbytes.functional.quantize_4bit`` (DESIGN §4.4) and kept as a plain frozen
parameter carrying its ``quant_state``, whose tensors (absmax, nested absmax, codes, offset) are registered as
buffers so they count as weights; double quantisation builds ``name2qmap["dynamic"]`` lazily with a
data-dependent ``tolist``, so it is built outside fake mode and handed in as a fake tensor. Each LLM.int8
weight becomes what ``Int8Params._quantize`` leaves: the int8 ``CB`` (N × K) with fp32 row scales ``SCB``.
A 4-bit layer's bias is made the compute dtype up front: ``Linear4bit.forward`` recasts it so on its first call
(``bias.data = bias.data.to(x.dtype)``), and it should count as a weight, not as a forward's copy.

Forward kernels (:class:`CudaBnbKernels`, used by the ``generate`` trace). Under fake tensors bitsandbytes'
custom ops run their ``register_fake`` kernels, which allocate only the output; a GPU runs the CUDA kernels of
``bitsandbytes/backends/cuda/ops.py`` (bitsandbytes 0.50), whose memory differs. A dispatch mode swaps in an
emulation that allocates what the CUDA kernel allocates:

* ``gemm_4bit`` (``matmul_4bit`` without grad, every ``Linear4bit`` in inference): bitsandbytes 0.50.2 picks the
  fused kernel — the output only — or ``_dequant_linear_fallback``: with double quantisation the uint8 absmax is
  dequantised to fp32 and the offset added (two fp32 tensors, one per 64-weight block), the whole weight is
  dequantised to the activation dtype (N × K), then ``F.linear``. Which one is
  :func:`trainfit.cuda_facts.bnb_gemm_4bit_fused`, the same function the closed forms ask: fused up to 4 rows
  (tokens × batch) on every CUDA GPU, never above 1536 rows or for a K that is not a multiple of the block,
  and between them as ``_gemm_4bit_use_custom_cuda``'s per-architecture table decides for the GPU given
  (:class:`CudaBnbKernels`' ``compute_capability`` / ``sm_count``, the setup's ``--gpu``); without one, the
  4-row floor (fp32: 7).
* LLM.int8 (``MatMul8bitLt`` in eval mode, transformers' ``llm_int8_threshold=6.0``): the input is cast to
  fp16 (a copy unless it is fp16), ``int8_vectorwise_quant`` allocates the row scales (fp32, one per row) and
  the int8 rows, then for the outlier test ``A.abs()`` (fp16) and its ``>= threshold`` bool mask; the outlier
  columns are data (fake tensors answer "none", and real activations have a handful: a T × n fp16 ``subA``,
  Dettmers et al. 2022 §3, left out). ``int8_mixed_scaled_mm`` → ``int8_scaled_mm``: the int32 product
  (cuBLASLt ``cigemmlt_32``), its fp16 dequantisation (``int8_mm_dequant`` writes fp16 only) while the int32
  lives, then the cast to the activation dtype while the fp16 lives.

Anything else runs unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainfit.cuda_facts import BNB_4BIT_BLOCK, bnb_gemm_4bit_fused
from trainfit.errors import DependencyError

#: Name prefix of the quantisation state's tensors, registered on each bitsandbytes layer as non-persistent buffers so
#: that the tracker and ``.to`` see them (the real layer holds them as attributes of its ``QuantState``).
QUANT_BUFFER_PREFIX = "_trainfit_quant_"


def require_bnb() -> Any:
    try:
        return importlib.import_module("bitsandbytes")
    except ImportError:
        raise DependencyError(
            "--method trace with bitsandbytes weights needs bitsandbytes: pip install 'trainfit[finetune]'"
        ) from None


def _conv1d() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # a model without transformers has no Conv1D
        return None
    return Conv1D


def converted_linear(module: torch.nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of a module transformers' ``replace_with_bnb_linear``
    (transformers/integrations/bitsandbytes.py) turns into a bitsandbytes layer, else ``None``: exactly
    ``nn.Linear`` (``type(module) is nn.Linear``: a subclass such as Falcon's ``FalconLinear`` stays float) or
    GPT-2's ``Conv1D``, whose weight is stored (in, out): its ``Bnb4bitQuantize``/``Bnb8bitQuantize`` transpose
    the checkpoint's weight, so the bitsandbytes layer holds it (out, in) like any linear."""
    conv1d = _conv1d()
    if conv1d is not None and isinstance(module, conv1d):
        weight: Any = module.weight
        n_in, n_out = weight.shape
        return int(n_in), int(n_out)
    if type(module) is torch.nn.Linear:
        return module.in_features, module.out_features
    return None


def _replace_linears(model: torch.nn.Module, make: Any) -> None:
    m: Any = model
    head = m.get_output_embeddings() if hasattr(m, "get_output_embeddings") else None
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            shape = converted_linear(child)
            if shape is None or child is head:
                continue
            bias: Any = child.bias
            q = make(*shape, bias is not None)
            if bias is not None:
                # The checkpoint's bias loads in the model's dtype; a fresh bitsandbytes layer makes it in the
                # default dtype, and its forward would cast it on the first call (``bias.data = ...``).
                q.bias = torch.nn.Parameter(q.bias.to(bias.dtype), requires_grad=bias.requires_grad)
            setattr(parent, name, q)


def to_linear4bit(model: torch.nn.Module, *, quant_type: str, double_quant: bool, compute: torch.dtype) -> None:
    """Replace every ``nn.Linear`` and GPT-2 ``Conv1D`` but the output head (:func:`converted_linear`) with a
    meta ``bnb.nn.Linear4bit`` (transformers' ``replace_with_bnb_linear``; the head is in
    ``modules_to_not_convert``); ``compute``: ``bnb_4bit_compute_dtype``."""
    bnb = require_bnb()
    _replace_linears(
        model,
        lambda n_in, n_out, bias: bnb.nn.Linear4bit(
            n_in,
            n_out,
            bias=bias,
            compute_dtype=compute,
            compress_statistics=double_quant,
            quant_type=quant_type,
            device="meta",
        ),
    )
    m: Any = model
    m.is_loaded_in_4bit = True  # what PEFT and prepare_model_for_kbit_training look for


def to_linear8bit(model: torch.nn.Module, *, threshold: float = 0.0) -> None:
    """Replace every ``nn.Linear`` but the output head with a meta ``bnb.nn.Linear8bitLt`` as transformers'
    ``replace_with_bnb_linear`` does for ``load_in_8bit`` (``has_fp16_weights=False``: int8 weights that take
    no gradient). Training uses outlier threshold 0, not transformers' ``llm_int8_threshold=6.0``: the outlier
    columns are data-dependent (a dynamic shape fake tensors cannot give); they add a T × n_outliers fp16
    ``subA`` per linear, a few columns (Dettmers et al. 2022 §3). The ``generate`` trace keeps 6.0 and runs
    the outlier test under :class:`CudaBnbKernels`."""
    bnb = require_bnb()
    _replace_linears(
        model,
        lambda n_in, n_out, bias: bnb.nn.Linear8bitLt(
            n_in,
            n_out,
            bias=bias,
            has_fp16_weights=False,
            threshold=threshold,
            device="meta",
        ),
    )
    m: Any = model
    m.is_loaded_in_8bit = True  # what PEFT (dispatch_bnb_8bit) looks for


@contextlib.contextmanager
def cuda_int8_matmul() -> Iterator[None]:
    """Run ``bnb.matmul`` as on a CUDA device: in training on a CPU tensor bitsandbytes takes
    ``MatMul8bitFp`` (dequantise, then a float matmul; bitsandbytes/autograd/_functions.py ``matmul``), on
    CUDA ``MatMul8bitLt``, whose memory the trace must show. The per-call warning about the fp16 cast of a
    non-fp16 input is silenced."""
    bnb = require_bnb()
    fns: Any = importlib.import_module("bitsandbytes.autograd._functions")
    saved = bnb.matmul
    log = logging.getLogger("bitsandbytes.autograd._functions")
    level = log.level

    def matmul(A: Any, B: Any, out: Any = None, state: Any = None, threshold: float = 0.0, bias: Any = None) -> Any:
        state = state or fns.MatmulLtState()
        if threshold > 0.0:
            state.threshold = threshold
        return fns.MatMul8bitLt.apply(A, B, out, bias, state)

    bnb.matmul = matmul
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        bnb.matmul = saved
        log.setLevel(level)


@contextlib.contextmanager
def four_bit_weights(
    model: torch.nn.Module, mode: Any, *, quant_type: str, double_quant: bool, compute: torch.dtype
) -> Iterator[None]:
    """Quantise every ``Linear4bit`` weight of the materialised ``model`` on fake tensors of ``mode`` (a
    ``FakeTensorMode``, or ``None`` for real tensors), for the duration of the run."""
    bnb = require_bnb()
    bf: Any = importlib.import_module("bitsandbytes.functional")

    saved = bf.name2qmap.get("dynamic")
    real_map = bf.create_dynamic_map()
    bf.name2qmap["dynamic"] = mode.from_tensor(real_map) if mode is not None else real_map
    try:
        with mode if mode is not None else contextlib.nullcontext():
            for mod in model.modules():
                if not isinstance(mod, bnb.nn.Linear4bit):
                    continue
                out_f, in_f = mod.out_features, mod.in_features
                w = torch.zeros(out_f, in_f, dtype=compute)
                packed, qs = bf.quantize_4bit(
                    w,
                    blocksize=BNB_4BIT_BLOCK,
                    quant_type=quant_type,
                    compress_statistics=double_quant,
                    quant_storage=torch.uint8,
                )
                weight = torch.nn.Parameter(packed, requires_grad=False)
                weight.quant_state = qs  # type: ignore[attr-defined]
                mod.weight = weight
                mod.quant_state = qs
                # A CPU with AVX512-BF16 would repack the weight for its own kernel at the first eval forward.
                mod.support_avx512bf16_for_cpu = False
                parts = [qs.absmax, qs.code]
                if qs.nested:
                    parts += [qs.offset, qs.state2.absmax, qs.state2.code]
                for k, t in enumerate(parts):
                    mod.register_buffer(f"{QUANT_BUFFER_PREFIX}{k}", t, persistent=False)
                if mod.bias is not None and mod.bias.dtype != compute:
                    # ``Linear4bit.forward`` casts its input to ``compute_dtype`` and then, on the first call,
                    # the bias to it for good (``bias.data = bias.data.to(x.dtype)``): after one step the bias
                    # of a 4-bit layer is a compute-dtype parameter, whatever prepare_model_for_kbit_training
                    # made it. Done here so that it counts as a weight, not as a copy made in the forward.
                    mod.bias.data = mod.bias.data.to(compute)
                # This frame lives through the run: keep no reference to the last weight, which a framework
                # that replaces the parameters (FSDP2's shards) would otherwise leave alive.
                del w, packed, weight
        yield
    finally:
        if saved is None:
            bf.name2qmap.pop("dynamic", None)
        else:
            bf.name2qmap["dynamic"] = saved


@contextlib.contextmanager
def int8_weights(model: torch.nn.Module, mode: Any) -> Iterator[None]:
    """Give every ``Linear8bitLt`` of the materialised ``model`` what ``Int8Params._quantize`` leaves on the
    device (bitsandbytes/nn/modules.py): the int8 weight ``CB`` (N × K) as the parameter's data, with
    ``CB`` and the fp32 row scales ``SCB`` (N) attached; the first forward moves them to the module's
    ``MatmulLtState`` (``init_8bit_state``). ``SCB`` is registered as a buffer so it counts as weights:
    N·K + 4·N bytes per linear (DESIGN §4.4)."""
    bnb = require_bnb()
    with mode if mode is not None else contextlib.nullcontext():
        for mod in model.modules():
            if not isinstance(mod, bnb.nn.Linear8bitLt):
                continue
            dev = mod.weight.device  # the run's device (--method measure runs these on a real GPU)
            cb = torch.zeros(mod.out_features, mod.in_features, dtype=torch.int8, device=dev)
            scb = torch.ones(mod.out_features, dtype=torch.float32, device=dev)
            weight = torch.nn.Parameter(cb, requires_grad=False)
            weight.CB = cb  # type: ignore[attr-defined]
            weight.SCB = scb  # type: ignore[attr-defined]
            mod.weight = weight
            mod.register_buffer(f"{QUANT_BUFFER_PREFIX}0", scb, persistent=False)
    yield


#: ``bitsandbytes::int8_vectorwise_dequant``'s one kernel (bitsandbytes/_ops.py, registered for "default": CUDA
#: has none of its own): ``A * stats.view(-1, 1) * 7.874015718698502e-3`` — 1/127.
_INT8_DEQUANT_SCALE = 7.874015718698502e-3


def dequantize_weight(module: torch.nn.Module) -> torch.Tensor | None:
    """The float weight PEFT's ``dequantize_module_weight`` (peft/utils/integrations.py, via
    ``dequantize_bnb_weight``) makes of a bitsandbytes layer built here, allocating what it allocates on a GPU; its
    own test (``Params4bit``/``Int8Params`` by class name) does not see this module's plain parameters. ``None``:
    not a layer of this module's making.

    * 4-bit: ``bnb.functional.dequantize_4bit(weight, quant_state)`` — with double quantisation the fp32 absmax
      blocks (dequantised, plus the offset) and the N × K weight in ``quant_state.dtype`` (the dtype the weight
      was quantised from; here the compute dtype, :func:`four_bit_weights`).
    * LLM.int8: ``int8_vectorwise_dequant(CB, SCB)``, whose kernel computes ``CB * SCB[:, None]`` (fp32, N × K)
      and then scales it by 1/127 into a second fp32 N × K: two alive at once. ``SCB`` is the layer's
      ``state.SCB`` once its first forward moved it there (``Linear8bitLt.init_8bit_state``), as PEFT reads it.
    * On the meta model (``get_peft_model``: DoRA's ``update_layer`` takes the norm of the dequantised weight to
      initialise the magnitude): an N × K meta tensor."""
    bnb = require_bnb()
    if not isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)):
        return None
    weight: Any = module.weight
    if weight.device.type == "meta":
        dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
        return torch.empty(module.out_features, module.in_features, device="meta", dtype=dtype)
    qs = getattr(weight, "quant_state", None)
    if qs is not None:
        bf: Any = importlib.import_module("bitsandbytes.functional")
        out: torch.Tensor = bf.dequantize_4bit(weight.data, qs)
        return out
    state: Any = getattr(module, "state", None)
    scb = state.SCB if state is not None and state.SCB is not None else getattr(weight, "SCB", None)
    if scb is None:
        return None
    dequantised: torch.Tensor = weight.data * scb.view(-1, 1) * _INT8_DEQUANT_SCALE
    return dequantised


# -- the CUDA kernels' memory ----------------------------------------------------------------------------


_COMPUTE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _gemm_4bit(
    A: torch.Tensor,
    B: torch.Tensor,
    shapeB: Any,
    absmax: torch.Tensor,
    blocksize: int,
    quant_type: str,
    bias: torch.Tensor | None = None,
    absmax_8bit: torch.Tensor | None = None,
    absmax_code: torch.Tensor | None = None,
    absmax_offset: torch.Tensor | None = None,
    *,
    compute_capability: str | None = None,
    sm_count: int | None = None,
) -> torch.Tensor:
    """``bitsandbytes::gemm_4bit`` on CUDA (backends/cuda/ops.py, the registered kernel): the fused kernel's
    output, or ``_dequant_linear_fallback``, as :func:`trainfit.cuda_facts.bnb_gemm_4bit_fused` decides."""
    k = A.shape[-1]
    rows = A.numel() // k
    n = int(shapeB[0])
    compute = _COMPUTE_NAMES.get(A.dtype, "bf16")
    if bnb_gemm_4bit_fused(
        rows, n, k, compute=compute, blocksize=blocksize, compute_capability=compute_capability, sm_count=sm_count
    ):
        return A.new_empty((*A.shape[:-1], n))
    absmax_dq = absmax_q = None
    if absmax_8bit is not None:
        absmax_dq = torch.empty_like(absmax_8bit, dtype=torch.float32)
        absmax_q = absmax_dq + (absmax_offset if absmax_offset is not None else 0.0)
    b_dq = A.new_empty((n, int(shapeB[1])))
    out = torch.nn.functional.linear(A, b_dq, bias)
    del b_dq, absmax_dq, absmax_q
    return out


def _int8_vectorwise_quant(A: torch.Tensor, threshold: float = 0.0) -> tuple[torch.Tensor, ...]:
    rows = A.numel() // A.shape[-1]
    row_stats = A.new_empty((rows,), dtype=torch.float32)
    out_row = A.new_empty(A.shape, dtype=torch.int8)
    if threshold <= 0.0:
        return out_row, row_stats, None  # type: ignore[return-value]
    outliers = A.abs() >= threshold
    any_outlier = outliers.any()  # the kernel's data-dependent branch; fake data has none
    cols = A.new_empty((0,), dtype=torch.int64)
    del outliers, any_outlier
    return out_row, row_stats, cols


def _int8_scaled_mm(
    A: torch.Tensor,
    B: torch.Tensor,
    row_stats: torch.Tensor,
    col_stats: torch.Tensor,
    bias: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    out_i32 = A.new_empty((*A.shape[:-1], B.shape[0]), dtype=torch.int32)
    out = torch.empty_like(out_i32, dtype=torch.float16)
    del out_i32
    if bias is not None and bias.dtype != torch.float16:
        out.add_(bias)
    return out.to(dtype or torch.float16)


def _int8_mixed_scaled_mm(
    A: torch.Tensor,
    CA: torch.Tensor,
    CB: torch.Tensor,
    SCA: torch.Tensor,
    SCB: torch.Tensor,
    outlier_cols: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    sub_a = A.new_empty((0,))  # no outlier columns (see the module docstring)
    return _int8_scaled_mm(CA, CB, SCA, SCB, bias=bias, dtype=A.dtype), sub_a


class CudaBnbKernels(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Route bitsandbytes' custom ops to the CUDA kernels' memory (see the module docstring)."""

    def __init__(self, *, compute_capability: str | None = None, sm_count: int | None = None) -> None:
        """``compute_capability`` / ``sm_count``: the GPU whose 4-bit kernel choice to follow (None: the
        choice every CUDA GPU makes)."""
        super().__init__()  # type: ignore[no-untyped-call]
        require_bnb()  # defines the ops
        ops: Any = torch.ops.bitsandbytes
        gemm = functools.partial(_gemm_4bit, compute_capability=compute_capability, sm_count=sm_count)
        try:
            self.table: dict[Any, Callable[..., Any]] = {
                ops.gemm_4bit.default: gemm,
                ops.int8_vectorwise_quant.default: _int8_vectorwise_quant,
                ops.int8_mixed_scaled_mm.default: _int8_mixed_scaled_mm,
                ops.int8_scaled_mm.default: _int8_scaled_mm,
            }
        except AttributeError:
            raise DependencyError(
                "--method trace emulates the CUDA kernels of bitsandbytes 0.50 or newer: pip install -U bitsandbytes"
            ) from None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        fn = self.table.get(func)
        if fn is not None:
            return fn(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


__all__ = [
    "CudaBnbKernels",
    "cuda_int8_matmul",
    "dequantize_weight",
    "four_bit_weights",
    "int8_weights",
    "require_bnb",
    "to_linear4bit",
    "to_linear8bit",
]

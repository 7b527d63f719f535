"""Fine-grained fp8 weights (``--dtype fp8``) in the ``generate`` trace: transformers' own ``FP8Linear`` layers
on fake tensors, with a stand-in for the fp8 matmul kernel that allocates what the kernel allocates.

Construction: transformers' ``replace_with_fp8_linear`` (integrations/finegrained_fp8.py) with a
``FineGrainedFP8Config(weight_block_size=[128, 128])`` — DeepSeek-V3's format — and the quantizer's skip list
(``get_keys_to_not_convert``: the output head), run on the meta model: every other ``nn.Linear`` becomes an
``FP8Linear`` holding a float8_e4m3fn weight and an fp32 ``weight_scale_inv`` per 128 × 128 block; a bias
takes the model's dtype, as a checkpoint loads it. Fused MoE experts become ``FP8Experts`` (fp8 ``[E, out, in]``
weights and fp32 ``[E, ⌈out/128⌉, ⌈in/128⌉]`` scales) run by ``fp8_grouped_mm_experts_forward``.

Kernel: ``FP8Linear.forward`` → ``fp8_linear`` → DeepGEMM (``deepgemm_fp8_fp4_linear``, sm90+, when loadable)
or the hub's Triton ``finegrained-fp8`` kernel (``finegrained_fp8_linear`` → ``matmul_2d`` →
``w8a8_block_dynamic_fp8_matmul``). Neither loads on fake tensors. Both quantise the activations in one pass
before the matmul — Triton ``fp8_act_quant_block_dynamic(A.view(M, K), block_k)``, DeepGEMM
``per_token_cast_to_fp8`` — to an fp8 copy of the input (M × K) and fp32 scales per 1 × 128 group
(M × ⌈K/128⌉), then write the output (M × N in the input dtype); the quantised input and its scales are the
wrapper's locals and die when it returns. :func:`fp8_matmul_kernels` swaps ``finegrained_fp8_linear`` for a
stand-in that allocates exactly those three tensors (and adds the bias in place, as transformers does), and
answers "no" to ``is_deepgemm_loadable``.

Experts: ``fp8_grouped_mm_experts_forward`` sorts the routed rows by expert and calls ``fp8_grouped_matmul`` →
the hub kernel's ``w8a8_block_fp8_matmul_grouped`` for gate_up and down. That kernel fuses the activation
quantisation into its matmul loop (per-row scales computed per K tile; no fp8 copy of the input) and allocates
only its output ``C = A.new_empty(S, N)`` and a per-expert tile schedule (``tiles_per_expert``, ``tile_offsets``:
E entries each). :func:`_grouped_stand_in` allocates the same; the rest of the experts' forward — gather,
``histc``, routing weights cast to the output dtype, the inverse permutation — is transformers' own code on
fake tensors.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch

#: DeepSeek-V3's ``weight_block_size`` edge (also the activation group size).
FP8_BLOCK = 128


def to_fp8_layers(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """On the meta ``model``: transformers' ``replace_with_fp8_linear`` as its fine-grained fp8 quantizer runs it
    (``FineGrainedFP8HfQuantizer._process_model_before_weight_loading``)."""
    import transformers
    from transformers.quantizers.base import get_keys_to_not_convert

    f8: Any = importlib.import_module("transformers.integrations.finegrained_fp8")
    config = transformers.FineGrainedFP8Config(weight_block_size=(FP8_BLOCK, FP8_BLOCK))
    f8.replace_with_fp8_linear(model, modules_to_not_convert=get_keys_to_not_convert(model), quantization_config=config)
    for mod in model.modules():
        if isinstance(mod, f8.FP8Linear) and mod.bias is not None:
            mod.bias = torch.nn.Parameter(mod.bias.to(dtype), requires_grad=False)


def update_tp_plan(model: torch.nn.Module) -> None:
    """What the fine-grained fp8 quantizer does to the model's tensor-parallel plan before it is distributed
    (``HfQuantizer.preprocess_model`` → ``FineGrainedFP8HfQuantizer.update_parallel_plan``, transformers 5.24):
    each parameter-level rule gains its ``weight_scale_inv`` twin with the same style (the fused experts'
    ``gate_up_proj``/``down_proj`` rules), per-tensor (0-dim) scales become ``replicate``. Module-level rules
    (``q_proj: colwise``) need nothing: ``_expand_parallel_plan`` gives every parameter of the module — the
    fp8 weight and its block scales — the module's style, so ``ColwiseParallel.shard_param`` splits the
    ``[⌈out/128⌉, ⌈in/128⌉]`` scales on dim 0 and ``RowwiseParallel`` on dim −1, as it splits the weight."""
    import transformers

    quantizers: Any = importlib.import_module("transformers.quantizers.quantizer_finegrained_fp8")
    config = transformers.FineGrainedFP8Config(weight_block_size=(FP8_BLOCK, FP8_BLOCK))
    plan: Any = getattr(model, "tp_plan", None)
    if plan:
        quantizers.FineGrainedFP8HfQuantizer(config).update_parallel_plan(model, plan)


def _matmul_stand_in(
    input: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_size: Any = None,
    bias: torch.Tensor | None = None,
    activation_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """What ``finegrained_fp8_linear`` allocates (see the module docstring): the fp8 input and its per-group
    scales beside the output."""
    k = input.shape[-1]
    rows = input.numel() // k
    group = int(block_size[1]) if block_size is not None else k
    a_q = input.new_empty((rows, k), dtype=torch.float8_e4m3fn)
    a_s = input.new_empty((rows, -(-k // group)), dtype=torch.float32)
    out = input.new_empty((*input.shape[:-1], weight.shape[0]))
    del a_q, a_s
    if bias is not None:
        out.add_(bias)
    return out


def _grouped_stand_in(
    input: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    offsets: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    block_size: Any = None,
) -> torch.Tensor:
    """What ``fp8_grouped_matmul`` allocates (see the module docstring): the ``[S, N]`` output in the input's
    dtype, and the kernel's per-expert tile schedule (``tiles_per_expert`` in ``tokens_per_expert``'s dtype,
    ``tile_offsets`` int32) — the activation quantisation is fused into the matmul loop, no fp8 copy."""
    tiles = torch.empty_like(tokens_per_expert)
    tile_offsets = torch.empty(tokens_per_expert.shape, dtype=torch.int32)
    out = input.new_empty((input.shape[0], weight.shape[1]))
    del tiles, tile_offsets
    return out


@contextlib.contextmanager
def fp8_matmul_kernels() -> Iterator[None]:
    """Route transformers' fp8 linears to :func:`_matmul_stand_in` and its fp8 experts' grouped matmul to
    :func:`_grouped_stand_in` while active."""
    f8: Any = importlib.import_module("transformers.integrations.finegrained_fp8")
    saved = f8.finegrained_fp8_linear, f8.is_deepgemm_loadable, f8.fp8_grouped_matmul
    f8.finegrained_fp8_linear = _matmul_stand_in
    f8.is_deepgemm_loadable = lambda: False
    f8.fp8_grouped_matmul = _grouped_stand_in
    try:
        yield
    finally:
        f8.finegrained_fp8_linear, f8.is_deepgemm_loadable, f8.fp8_grouped_matmul = saved


__all__ = ["FP8_BLOCK", "fp8_matmul_kernels", "to_fp8_layers", "update_tp_plan"]

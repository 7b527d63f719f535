"""``--fp8 tensorwise`` in the trace: the real torchao ``Float8Linear`` on fake CPU tensors.

torchao's ``convert_to_float8_training`` swaps the layer stack's ``nn.Linear`` modules whose weight dims are both
multiples of 16 (torchtitan's ``module_filter_fn``, torchtitan/components/quantization/utils.py; the LM head stays
bf16 as torchtitan's ``filter_fqns`` leaves ``output``), with torchao's default ``Float8LinearConfig()`` (dynamic
tensorwise scaling). The swap happens on the meta model, before its parameters become fake tensors.
``torch._scaled_mm`` has a CPU kernel and a fake (meta) implementation in torch 2.13, so the module's own
forward and backward (``matmul_with_hp_or_float8_args``) run unchanged, casts included.

One emulation: ``Float8Linear.forward`` casts its input to the autocast dtype only when
``torch.is_autocast_enabled()`` — CUDA's autocast. The trace runs CPU autocast under CUDA's policy
(:mod:`trainfit.trace.autocast`), where that call says False; a forward pre-hook makes the same
``input.to(autocast_dtype)`` cast when CPU autocast is on, as a CUDA run would.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from trainfit.errors import DependencyError
from trainfit.strategy import Float8, Strategy

_HINT = "--fp8 with --method trace needs torchao: pip install --no-deps torchao  (or: pip install 'trainfit[fp8]')"
DIM_MULTIPLE = 16  # torchtitan module_filter_fn: both weight dims divisible by 16


def require_torchao() -> ModuleType:
    try:
        import torchao.float8 as fp8
    except ImportError:
        raise DependencyError(_HINT) from None
    module: ModuleType = fp8
    return module


def _cuda_autocast_input(_mod: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """``Float8Linear.forward``'s ``input.to(torch.get_autocast_gpu_dtype())``, for CPU autocast."""
    if torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled():
        x = args[0]
        return (x.to(torch.get_autocast_dtype("cpu")), *args[1:])
    return None


def apply_float8(model: torch.nn.Module, stack_path: str, strategy: Strategy) -> int:
    """Swap the stack's eligible linears for ``Float8Linear`` (in place, on meta); returns how many."""
    if strategy.float8 is Float8.NONE:
        return 0
    fp8 = require_torchao()
    from torchao.float8.float8_linear import Float8Linear

    def keep(mod: torch.nn.Module, _fqn: str) -> bool:
        if not isinstance(mod, torch.nn.Linear):
            return False
        n, k = mod.weight.shape
        return n % DIM_MULTIPLE == 0 and k % DIM_MULTIPLE == 0

    stack = model.get_submodule(stack_path)
    fp8.convert_to_float8_training(stack, config=fp8.Float8LinearConfig(), module_filter_fn=keep)
    swapped = [m for m in stack.modules() if isinstance(m, Float8Linear)]
    for m in swapped:
        m.register_forward_pre_hook(_cuda_autocast_input)
    return len(swapped)

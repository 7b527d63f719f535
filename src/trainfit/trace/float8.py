"""``--fp8 tensorwise`` in the trace: the real torchao ``Float8Linear`` on fake CPU tensors.

torchao's ``convert_to_float8_training`` swaps the layer stack's ``nn.Linear`` modules whose weight dims are both
multiples of 16 (torchtitan's ``module_filter_fn``, torchtitan/components/quantization/utils.py; the LM head stays
bf16 as torchtitan's ``filter_fqns`` leaves ``output``), with torchao's default ``Float8LinearConfig()`` (dynamic
tensorwise scaling). The swap happens on the meta model, before its parameters become fake tensors.
``torch._scaled_mm`` has a CPU kernel and a fake (meta) implementation in torch 2.13, so the module's own
forward and backward (``matmul_with_hp_or_float8_args``) run unchanged, casts included.

The tracker (a ``TorchDispatchMode``) sees an op on a ``Float8TrainingTensor`` — ``aten.mm`` — and its output,
but not the ops its ``__torch_dispatch__`` runs while handling it: a mode is off the stack while its own handler
runs. Those include ``float8_ops.preprocess_addmm``'s layout copies (``w8.t()`` for grad_input; ``go8.t()`` and
``x8`` for grad_weight) and ``torch._scaled_mm``. :func:`inner_ops_tracked` puts the tracker back on the stack
inside that handler, so the copies are counted as a CUDA run allocates them.

One emulation: ``Float8Linear.forward`` casts its input to the autocast dtype only when
``torch.is_autocast_enabled()`` — CUDA's autocast. The trace runs CPU autocast under CUDA's policy
(:mod:`trainfit.trace.autocast`), where that call says False; a forward pre-hook makes the same
``input.to(autocast_dtype)`` cast when CPU autocast is on, as a CUDA run would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


@contextlib.contextmanager
def inner_ops_tracked(box: Sequence[Any], strategy: Strategy) -> Iterator[None]:
    """While active, ``Float8TrainingTensor.__torch_dispatch__`` runs under ``box[0]`` (the run's tracker, once the
    runner has made it) again, so the allocations inside torchao's handlers are recorded (module docstring)."""
    if strategy.float8 is Float8.NONE:
        yield
        return
    require_torchao()
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    original = Float8TrainingTensor.__dict__["__torch_dispatch__"]

    def dispatch(cls: type, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        mode = box[0] if box else None
        scope = mode if isinstance(mode, TorchDispatchMode) else contextlib.nullcontext()
        with scope:
            return original.__func__(cls, func, types, args, kwargs)

    Float8TrainingTensor.__torch_dispatch__ = classmethod(dispatch)
    try:
        yield
    finally:
        Float8TrainingTensor.__torch_dispatch__ = original

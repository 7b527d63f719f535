"""Import guards: the trace engine needs torch (and transformers for Hugging Face models).

Both are optional dependencies of trainfit, so a missing one is a user-facing ``DependencyError`` with the
install command, never an ``ImportError`` traceback.

torchao (the ``fp8`` extra) is imported by transformers' quantizer registry whenever it is installed, and its
import logs warnings that are not the user's business on a CPU build (its CUDA extensions fail to load; torch
deprecates its enum registrations). :func:`require_torch` imports it first with those two loggers silenced,
so a trace prints only trainfit's output. bitsandbytes is imported first too, without the Hugging Face kernel hub
(:func:`import_bitsandbytes_offline`): its import would otherwise fetch a CPU kernel over the network.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from types import ModuleType

from trainfit.errors import DependencyError

_TORCH_HINT = (
    "--method trace needs PyTorch (CPU build is enough): pip install torch "
    "--index-url https://download.pytorch.org/whl/cpu  (or: pip install 'trainfit[torch]')"
)
_HF_HINT = "--method trace on a Hugging Face config needs transformers: pip install 'trainfit[hf]'"


#: The loggers torchao's import writes to: its own (``torchao/__init__.py``: "Failed to load ...so") and
#: torch's pytree registry (``torch/utils/_pytree.py``: enum ``register_constant`` deprecation).
_NOISY_AT_TORCHAO_IMPORT = ("torchao", "torch.utils._pytree")
#: What gets imported: the package, its float8 training (``--fp8``), and what transformers' torchao quantizer
#: imports (``transformers/quantizers/quantizer_torchao.py``); each registers enums with the pytree.
_TORCHAO_MODULES = ("torchao", "torchao.float8", "torchao.prototype.safetensors.safetensors_support")


def import_torchao_quietly() -> None:
    """Import torchao (when installed) with its import-time warnings silenced (module docstring)."""
    if "torchao" in sys.modules or importlib.util.find_spec("torchao") is None:
        return
    loggers = [logging.getLogger(name) for name in _NOISY_AT_TORCHAO_IMPORT]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        for module in _TORCHAO_MODULES:
            importlib.import_module(module)
    except Exception:  # a broken optional install must not break the trace; transformers copes without it
        pass
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def import_bitsandbytes_offline() -> None:
    """Import bitsandbytes (when installed) without fetching a kernel from the Hugging Face Hub. On a CPU with
    AVX512-BF16 its CPU backend asks the kernel hub for a 4-bit GEMM at import (bitsandbytes 0.50
    ``backends/cpu/ops.py``: ``kernels.get_kernel("kernels-community/quantization-bitsandbytes")``): a network
    request and a download that trainfit must not make outside the ``--hf`` config path, and, refused, a warning
    on the user's terminal. The trace runs bitsandbytes' layers on fake tensors and needs no CPU kernel, so the
    import runs with ``kernels.get_kernel`` refusing (bitsandbytes falls back, as it does without ``kernels``) and
    bitsandbytes' loggers silenced; both are restored after. PEFT and transformers import bitsandbytes when it is
    installed, so every trace imports it here first."""
    if "bitsandbytes" in sys.modules or importlib.util.find_spec("bitsandbytes") is None:
        return
    try:
        import kernels
    except Exception:  # not installed (or broken): bitsandbytes cannot ask the hub either
        kernels = None
    saved = getattr(kernels, "get_kernel", None)

    def refuse(*_a: object, **_k: object) -> ModuleType:
        raise RuntimeError("trainfit imports bitsandbytes without Hub kernels")

    logger = logging.getLogger("bitsandbytes")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    if saved is not None:
        kernels.get_kernel = refuse
    try:
        importlib.import_module("bitsandbytes")
    except Exception:  # a broken optional install must not break the trace (QLoRA then says what is missing)
        pass
    finally:
        if saved is not None:
            kernels.get_kernel = saved
        logger.setLevel(level)


def require_torch() -> ModuleType:
    try:
        import torch
    except ImportError:
        raise DependencyError(_TORCH_HINT) from None
    import_bitsandbytes_offline()  # first: anything imported after it (torchao, transformers, PEFT) finds it loaded
    import_torchao_quietly()
    return torch


def require_transformers() -> ModuleType:
    require_torch()
    try:
        import transformers
    except ImportError:
        raise DependencyError(_HF_HINT) from None
    return transformers

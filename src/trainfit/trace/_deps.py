"""Import guards: the trace engine needs torch (and transformers for Hugging Face models).

Both are optional dependencies of trainfit, so a missing one is a user-facing ``DependencyError`` with the
install command, never an ``ImportError`` traceback.
"""

from __future__ import annotations

from types import ModuleType

from trainfit.errors import DependencyError

_TORCH_HINT = (
    "--method trace needs PyTorch (CPU build is enough): pip install torch "
    "--index-url https://download.pytorch.org/whl/cpu  (or: pip install 'trainfit[torch]')"
)
_HF_HINT = "--method trace on a Hugging Face config needs transformers: pip install 'trainfit[hf]'"


def require_torch() -> ModuleType:
    try:
        import torch
    except ImportError:
        raise DependencyError(_TORCH_HINT) from None
    return torch


def require_transformers() -> ModuleType:
    require_torch()
    try:
        import transformers
    except ImportError:
        raise DependencyError(_HF_HINT) from None
    return transformers

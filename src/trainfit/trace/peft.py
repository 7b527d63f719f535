"""Real PEFT adapters in the trace: the reduced model of each depth is wrapped on the meta device, then its
parameters become fake tensors like any other model's (DESIGN §4.4: ``get_peft_model`` cannot wrap fake
parameters, because ``Module.to`` swaps tensors; building and wrapping on meta and swapping in fresh fake
tensors afterwards works).

What PEFT does that matters for memory, and is therefore done by PEFT itself here rather than imitated:

* ``get_peft_model(model, LoraConfig(...), autocast_adapter_dtype=...)`` (peft/mapping_func.py) freezes
  every base parameter and injects ``lora.Linear`` layers (peft/tuners/lora/layer.py ``LoraLayer.update_layer``)
  for ``target_modules`` (``"all-linear"``: ``_maybe_include_all_linear_layers`` in peft/tuners/tuners_utils.py,
  every linear but the output layer). ``autocast_adapter_dtype=True`` keeps the adapters in fp32 on a 16-bit
  base; with ``False`` they take the base layer's dtype (``_move_adapter_to_device_of_base_layer``), and a
  third dtype is set by casting the adapter tensors.
* ``PeftModel.__init__`` calls ``_prepare_model_for_gradient_checkpointing`` (peft/peft_model.py), which for a
  non-quantised model calls ``enable_input_require_grads``: the embeddings' output requires grad, so every
  layer's hidden states do (and every layer saves the same tensors).

The forward runs the original transformers module, which PEFT modified in place (``peft_model.base_model.model``),
so the stack path, the head and the checkpointing hooks of :mod:`trainfit.trace.hf` apply unchanged.
Quantised (bitsandbytes) bases are not traced yet: :func:`trainfit.analytic.adapters.check_finetune_model`
refuses them for this method.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from trainfit.errors import DependencyError, StrategyError
from trainfit.strategy import ALL_LINEAR, AdapterKind, Quantization, Strategy
from trainfit.strategy.dtypes import DType

_TORCH_DTYPES = {DType.FP32: torch.float32, DType.BF16: torch.bfloat16, DType.FP16: torch.float16}


def require_peft() -> Any:
    try:
        import peft
    except ImportError:
        raise DependencyError("--method trace with adapters needs peft: pip install 'trainfit[finetune]'") from None
    return peft


def apply_finetuning(model: torch.nn.Module, strategy: Strategy) -> torch.nn.Module:
    """Wrap ``model`` (on the meta device) as ``strategy`` fine-tunes it; returns the transformers module with
    the adapters injected (``model`` itself when nothing changes)."""
    adapter, base = strategy.adapter, strategy.base_weights
    if base.frozen:
        raise StrategyError("--method trace does not model --freeze yet; use --method analytic")
    if base.quantization is not Quantization.NONE:
        raise StrategyError("--method trace does not run bitsandbytes layers yet; use --method analytic")
    if base.dtype is not None:
        model.to(_TORCH_DTYPES[base.dtype])  # meta tensors: a dtype change, nothing allocated
    if adapter is None:
        return model
    peft = require_peft()
    targets: str | list[str] = ALL_LINEAR if adapter.targets == (ALL_LINEAR,) else list(adapter.targets)
    config = peft.LoraConfig(
        r=adapter.rank,
        lora_alpha=adapter.alpha,
        lora_dropout=adapter.dropout,
        target_modules=targets,
        bias="none",
        use_dora=adapter.kind is AdapterKind.DORA,
        task_type="CAUSAL_LM",
    )
    wanted = _TORCH_DTYPES[adapter.dtype]
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 deprecates is_gradient_checkpointing
        wrapped = peft.get_peft_model(model, config, autocast_adapter_dtype=wanted == torch.float32)
    inner: torch.nn.Module = wrapped.base_model.model
    for name, p in inner.named_parameters():
        if "lora_" in name and p.dtype != wanted:
            p.data = p.data.to(wanted)  # meta: a dtype change (PEFT leaves meta adapters in fp32)
    return inner

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
* On transformers 5 MoE models (Mixtral, and every model transformers maps to the Qwen2-MoE conversion: Qwen3-MoE,
  DeepSeek-V2/V3) PEFT rewrites the config first (peft/utils/transformers_weight_conversion.py
  ``_convert_peft_config_moe``): the experts are 3-D parameters, so ``all-linear`` (or a v4 expert name) becomes
  ``target_parameters`` on ``gate_up_proj``/``down_proj`` (``ParamWrapper``) plus LoRA on the router ``gate``;
  the names ``gate_proj``/``up_proj``/``down_proj`` go to the experts, so DeepSeek's dense MLPs and shared experts
  get no adapter. The trace runs what PEFT builds; the analytic method covers the Mixtral, Qwen3-MoE and DeepSeek
  layouts (and Qwen2-MoE, which PEFT leaves unconverted).
* ``PeftModel.__init__`` calls ``_prepare_model_for_gradient_checkpointing`` (peft/peft_model.py), which for a
  non-quantised model calls ``enable_input_require_grads``: the embeddings' output requires grad, so every
  layer's hidden states do (and every layer saves the same tensors).

The forward runs the original transformers module, which PEFT modified in place (``peft_model.base_model.model``),
so the stack path, the head and the checkpointing hooks of :mod:`trainfit.trace.hf` apply unchanged.

A 4-bit base (QLoRA) is built as transformers' bitsandbytes integration builds it: every ``nn.Linear`` (and
GPT-2 ``Conv1D``) of the layer stack becomes a ``bnb.nn.Linear4bit`` (the output head is left alone,
``modules_to_not_convert``), then
``prepare_model_for_kbit_training`` (peft/utils/other.py) casts every other parameter to fp32, then PEFT wraps
the 4-bit layers (``peft/tuners/lora/bnb.py`` ``Linear4bit``). The bitsandbytes construction lives in
:mod:`trainfit.trace.bnb` (shared with the ``generate`` trace). After the fake parameters are in place, each
4-bit weight is quantised *on a fake tensor* with ``bitsandbytes.functional.quantize_4bit`` (DESIGN §4.4) and
kept as a plain frozen parameter carrying its ``quant_state``; the state's tensors (absmax, nested absmax,
codes, offset) are registered as buffers so they count as weights. Double quantisation builds
``name2qmap["dynamic"]`` lazily with a data-dependent ``tolist``: it is built outside fake mode and handed in
as a fake tensor for the run.

An LLM.int8 base (``--base-dtype int8``) is built the same way with ``bnb.nn.Linear8bitLt``
(``has_fp16_weights=False``, outlier threshold 0: the outlier columns are a data-dependent shape); each weight
becomes the int8 ``CB`` (N × K) with its fp32 row scales ``SCB`` (a buffer), what ``Int8Params._quantize``
leaves. In training on a CPU tensor bitsandbytes routes ``bnb.matmul`` to ``MatMul8bitFp``; the run patches it
to ``MatMul8bitLt``, the CUDA path, whose memory differs: it keeps its input on ``ctx`` (outside
``save_for_backward``, so checkpointing cannot drop it) and its backward dequantises the weight in the
input's dtype.

``--freeze`` (:func:`freeze_patterns`) turns ``requires_grad`` off on the full-depth meta model before the
reduced models are cut from it (trace/depth.py ``plan_depth``), so layer ranges keep their indices and
frozen and trainable layers form separate runs of the depth extrapolation.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from trainfit.errors import DependencyError
from trainfit.strategy import ALL_LINEAR, AdapterKind, Quantization, Strategy
from trainfit.strategy.dtypes import DType
from trainfit.trace import bnb

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
    # ``--freeze`` patterns are applied to the full-depth meta model (:func:`freeze_patterns`, called by
    # trace/depth.py ``plan_depth``): layer ranges need the full model's layer indices.
    quantised = base.quantization is not Quantization.NONE
    int8 = base.quantization is Quantization.INT8
    if int8:
        _to_linear8bit(model)
    elif quantised:
        _to_linear4bit(model, strategy)
    if base.dtype is not None:
        model.to(_TORCH_DTYPES[base.dtype])  # meta tensors: a dtype change, nothing allocated
    if adapter is None:
        return model
    peft = require_peft()
    if base.kbit_prepared:
        # What QLoRA recipes call (``--finetune qlora``): fp32 for everything not 4-bit; checkpointing is the
        # strategy's business (transformers' gradient_checkpointing_enable, installed by trace.hf, enables input
        # grads itself). ``--finetune lora`` on a quantised base is a user who loaded the base in 4 or 8 bits and
        # called ``get_peft_model`` directly: the base keeps its 16-bit non-quantised tensors (as the analytic).
        peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    targets: str | list[str] = ALL_LINEAR if adapter.targets == (ALL_LINEAR,) else list(adapter.targets)
    config = peft.LoraConfig(
        r=adapter.rank,
        lora_alpha=adapter.alpha,
        lora_dropout=adapter.dropout,
        target_modules=targets,
        bias="none",
        use_dora=adapter.kind is AdapterKind.DORA,
        # PEFT's CAUSAL_LM wrapper needs ``prepare_inputs_for_generation``; an encoder (BERT's masked LM) has
        # none and takes the plain ``PeftModel`` (no task type), as PEFT's own encoder examples do.
        task_type="CAUSAL_LM" if hasattr(model, "prepare_inputs_for_generation") else None,
    )
    wanted = _TORCH_DTYPES[adapter.dtype]
    with torch.device("meta"), warnings.catch_warnings(), dora_dequantize(strategy):
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 deprecates is_gradient_checkpointing
        wrapped = peft.get_peft_model(model, config, autocast_adapter_dtype=wanted == torch.float32)
    inner: torch.nn.Module = wrapped.base_model.model
    for name, p in inner.named_parameters():
        if "lora_" in name and p.dtype != wanted:
            p.data = p.data.to(wanted)  # meta: a dtype change (PEFT leaves meta adapters in fp32)
    return inner


def _to_linear4bit(model: torch.nn.Module, strategy: Strategy) -> None:
    """``Linear4bit`` layers for a QLoRA base (trace/bnb.py ``to_linear4bit``)."""
    bnb.to_linear4bit(
        model,
        quant_type=strategy.base_weights.quantization.value,
        double_quant=strategy.base_weights.double_quant,
        compute=_TORCH_DTYPES[DType(strategy.recipe.compute_dtype)],
    )


def _to_linear8bit(model: torch.nn.Module) -> None:
    """``Linear8bitLt`` layers for an LLM.int8 base, outlier threshold 0 (trace/bnb.py ``to_linear8bit``)."""
    bnb.to_linear8bit(model)


@contextlib.contextmanager
def quantised_weights(model: torch.nn.Module, mode: Any, strategy: Strategy) -> Iterator[None]:
    """Quantise every ``Linear4bit`` weight of the materialised ``model`` on fake tensors of ``mode`` (a
    ``FakeTensorMode``, or ``None`` for real tensors), for the duration of the run (trace/bnb.py)."""
    q = strategy.base_weights.quantization
    if q is Quantization.INT8:
        with bnb.int8_weights(model, mode), bnb.cuda_int8_matmul(), dora_dequantize(strategy), cuda_autocast_query():
            yield
        return
    if q not in (Quantization.NF4, Quantization.FP4):
        yield
        return
    compute = _TORCH_DTYPES[DType(strategy.recipe.compute_dtype)]
    with (
        bnb.four_bit_weights(
            model, mode, quant_type=q.value, double_quant=strategy.base_weights.double_quant, compute=compute
        ),
        dora_dequantize(strategy),
        cuda_autocast_query(),
    ):
        yield


@contextlib.contextmanager
def cuda_autocast_query() -> Iterator[None]:
    """PEFT's LoRA layers over a bitsandbytes base (peft/tuners/lora/bnb.py ``Linear4bit.forward`` and
    ``Linear8bitLt.forward``) ask ``torch.is_autocast_enabled()`` — without a device: CUDA's autocast — whether to
    cast x to the adapter's dtype and the adapter's output back to the base output's (``requires_conversion``). The
    trace runs CPU autocast under CUDA's policy (trace/autocast.py), where that call says False, so every adapted
    layer made a cast copy of its LoRA output that a CUDA run under autocast does not (a 64 MiB fp32 copy per MLP
    projection of llama-3.2-1b at 2048 tokens). For the run, the no-device form reports CPU autocast's state, as
    on a GPU it reports CUDA's."""
    original = torch.is_autocast_enabled

    def is_autocast_enabled(device_type: str | None = None) -> bool:
        return bool(original("cpu" if device_type is None else device_type))

    torch.is_autocast_enabled = is_autocast_enabled
    try:
        yield
    finally:
        torch.is_autocast_enabled = original


@contextlib.contextmanager
def dora_dequantize(strategy: Strategy) -> Iterator[None]:
    """DoRA over a bitsandbytes base: PEFT's ``DoraLinearLayer`` (peft/tuners/lora/dora.py) takes the base weight
    from ``dequantize_module_weight`` — in ``update_layer`` (the magnitude's initial norm, on the meta model) and
    in every ``forward`` (the weight norm, and with dropout the second base linear). That function recognises
    bitsandbytes weights by their class (``Params4bit``, ``Int8Params``); the trace keeps plain parameters
    (trace/bnb.py), so the name dora.py imported is pointed, for the run, at :func:`trainfit.trace.bnb.
    dequantize_weight`, which dequantises them as bitsandbytes does on a GPU. Nothing changes otherwise."""
    adapter = strategy.adapter
    if (
        adapter is None
        or adapter.kind is not AdapterKind.DORA
        or strategy.base_weights.quantization is Quantization.NONE
    ):
        yield
        return
    dora: Any = require_peft().tuners.lora.dora
    original = dora.dequantize_module_weight

    def dequantize_module_weight(module: torch.nn.Module) -> Any:
        out = bnb.dequantize_weight(module)
        return original(module) if out is None else out

    dora.dequantize_module_weight = dequantize_module_weight
    try:
        yield
    finally:
        dora.dequantize_module_weight = original


#: HF module names that differ from the inventory's (the analytic side's ``_HF_ALIASES``, both ways).
_FREEZE_ALIASES = {"out_proj": "o_proj", "o_proj": "out_proj"}


def freeze_patterns(model: torch.nn.Module, stack_path: str, patterns: tuple[str, ...]) -> int:
    """``--freeze`` on the full-depth (meta) ``model``: ``requires_grad_(False)`` on every parameter a pattern
    names, as a training script does before building its optimizer (the trace's optimizer gets only the
    parameters that still require grad). Returns how many parameter tensors were frozen.

    * ``embeddings``: every ``nn.Embedding`` outside the layer stack (token, position and token-type tables;
      a tied head shares the token table, so it freezes with it);
    * ``lm_head``: the output embeddings (``get_output_embeddings``) when untied; a tied head has no tensor
      of its own (``named_parameters`` lists it once, as the token table), as the analytic inventory;
    * ``norm``: every parameter of a module whose class is a norm (``*Norm``, ``LayerNorm``);
    * ``layers:A-B``: every parameter of stack layers A..B (full-depth indices);
    * a module name (``q_proj``, ``out_proj``/``o_proj``): that module's parameters wherever it occurs.
    """
    from trainfit.strategy.adapters import layer_range

    m: Any = model
    head = m.get_output_embeddings() if hasattr(m, "get_output_embeddings") else None
    embed = m.get_input_embeddings() if hasattr(m, "get_input_embeddings") else None
    tied = head is not None and embed is not None and head.weight is embed.weight
    prefix = stack_path + "."
    frozen: set[int] = set()
    for mod_name, mod in model.named_modules():
        own = [p for p in mod.parameters(recurse=False)]
        if not own:
            continue
        in_stack = mod_name.startswith(prefix)
        short = mod_name.rpartition(".")[2]
        for pat in patterns:
            rng = layer_range(pat)
            hit = False
            if rng is not None:
                if in_stack:
                    idx = mod_name[len(prefix) :].partition(".")[0]
                    hit = idx.isdigit() and int(idx) in rng
            elif pat == "embeddings":
                hit = isinstance(mod, torch.nn.Embedding) and not in_stack and mod is not head
            elif pat == "lm_head":
                hit = mod is head and not tied
            elif pat == "norm":
                cls = type(mod).__name__
                hit = cls.endswith("Norm") or "LayerNorm" in cls or "RMSNorm" in cls
            else:
                hit = short in (pat, _FREEZE_ALIASES.get(pat, pat))
            if hit:
                for p in own:
                    if id(p) not in frozen:
                        frozen.add(id(p))
                        p.requires_grad_(False)
                break
    return len(frozen)

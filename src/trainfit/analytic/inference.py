"""Inference memory in closed form: weights, KV cache, the prefill and decode peaks, and what fits.

An inference request has two phases (:class:`~trainfit.result.InferencePhase`). **Prefill** runs the whole
prompt (``b·s`` tokens) through the model once and writes every layer's keys and values into the cache;
**decode** then runs one token per sequence per step against the cache. Nothing is saved for backward, so
the activation terms are *transients*: what one layer holds while it runs, on top of what is resident
(weights, the cache so far, a few per-forward tensors such as the embeddings and RoPE tables).

What Hugging Face ``generate`` keeps (transformers 5, ``generation/utils.py`` ``_sample``, checked on fake
tensors by :mod:`trainfit.trace.generate`):

* the forward gets ``logits_to_keep=1``: the head multiplies only the last position, ``b·vocab`` logits,
  and ``generate`` copies them to fp32 (``outputs.logits[:, -1, :].to(copy=True, dtype=torch.float32)``);
  the previous step's fp32 copy is alive through the next step's forward, and so is the rest of what
  ``_sample`` makes between passes — ``argmax``'s tokens, the ``input_ids`` and ``position_ids`` re-made one
  token longer by ``cat`` (an unpadded batch's all-ones ``attention_mask`` is dropped before the first pass),
  ``unfinished_sequences`` and ``prepare_inputs_for_generation``'s clones of the last id and position
  (:func:`_step_bytes`; the trace counts all of it as logits, being made after the last layer) — while
  ``generate``'s own frame keeps the request's prompt-sized ids, mask and ``position_ids`` for the whole call
  (:func:`_request_bytes`);
* a left-padded batch (``padded``, ``--padded``) keeps its 2-D mask (not all ones, so not dropped), ``cat``-grown
  one token per pass (:func:`_padding_mask_2d`), and makes the model build a bool ``[b, 1, q, kv]`` mask per
  pass (``sdpa_mask`` cannot skip it, :func:`_padding_mask_4d`): SDPA then runs the masked kernel in every
  pass, prefill with k/v repeated per query head, decode with ``pack_gqa``'s view (nothing repeated);
* ``DynamicCache`` (``cache_utils.DynamicLayer.update``) grows each layer by ``torch.cat``: during a decode
  step the new ``[b, kv_heads, T, head_dim]`` K and V exist beside the old ones until the assignment drops
  them, so the worst moment holds the cache at full length plus one layer's previous K/V;
* ``DynamicSlidingWindowLayer`` keeps a *view* of the last ``window − 1`` tokens of the ``cat`` result: after
  prefill the storage is the whole prompt, after the first decode step ``window`` tokens;
* ``StaticCache`` (``StaticLayer``) allocates ``[b, kv_heads, prompt + new_tokens, head_dim]`` once and
  writes with ``index_copy_``: no copies; its sliding layers (``StaticSlidingWindowLayer``) hold
  ``min(window, prompt + new)`` tokens and ``roll`` once full, a transient copy of one layer;
* MLA (DeepSeek-V2/V3, ``DeepseekV3Attention.forward``) caches the compressed latent — ``kv_lora_rank``
  (normed ``kv_nope``) and ``qk_rope_head_dim`` (``k_rot``), one "head" each — and ``expand_kv``
  decompresses the whole cache of the running layer every step: ``kv_b_proj`` output
  ``b·T·heads·(nope + v)`` plus a new key tensor ``b·heads·T·(nope + rope)``. The cached latent is what
  vLLM's MLA caches too (``kv_lora_rank + qk_rope_head_dim`` per token, one entry, vllm
  ``v1/attention/backends/mla/common.py``); vLLM does not decompress the cache at decode (it absorbs
  ``kv_b_proj`` into the query and output projections), so the ``expand_kv`` transient is Hugging Face's.

``--kv-dtype fp8`` in ``generate`` is transformers' ``QuantizedCache(backend="fp8")`` (``Fp8QuantizedLayer``,
:func:`hf_fp8`): float8_e4m3fn storage and a 0-dim fp32 scale per tensor (per-tensor scaling, as vLLM's
``kv_cache_dtype="fp8"`` — docs.vllm.ai "Quantized KV Cache"). It is not fused: prefill quantises each
layer's K/V through two fp32 copies (``(t.float() / scale).to(fp8)``) and hands attention the unquantised
inputs; each decode step ``cat``s the quantised token on, keeps the old fp8 K/V (``update``'s locals) and
dequantises the whole layer (``q.float() * scale``: two fp32 copies, then the compute-dtype copy attention
reads). Those transients are moments here (:func:`fp8_quantise_moments`, :func:`fp8_dequantise_bytes`) and
the attention moment carries the compute-dtype K/V. A paged server (vLLM) writes fp8 in its cache kernel
(``reshape_and_cache_flash``; MLA ``concat_and_cache_mla``) and dequantises inside attention: storage only,
no copies; so is a static cache, which has no transformers fp8 variant (a warning says so).

KV cache = 2 · layers · kv_heads · head_dim · tokens · batch · bytes (Pope et al. 2022, "Efficiently Scaling
Transformer Inference", §2; vLLM ``get_kv_cache_spec``), each tensor rounded to the allocator's 512 bytes.

Paged servers (``--cache paged``, vLLM's PagedAttention: Kwon et al. 2023) hold the cache in blocks of
``block_size`` tokens per layer; a sequence of ``T`` tokens takes ``⌈T / block_size⌉`` blocks. With
``--server paged`` the capacity is what vLLM reports at start-up (``vllm/v1/worker/gpu_worker.py``
``determine_available_memory``, ``vllm/v1/core/kv_cache_utils.py`` ``get_num_blocks``):

    kv_budget = total_gpu_memory · gpu_memory_utilization − (weights + peak activation of the profile run
                + non-torch memory)
    blocks = kv_budget // (block_size · bytes per token of all layers)

where the profile run is a forward pass over ``max_num_batched_tokens`` tokens (8192 by default in V1's
chunked prefill) with dummy inputs. We take the profile peak from our own prefill formula over those
tokens as one batch, and ``non-torch`` from our CUDA-context constant; vLLM measures both.

Tensor parallelism (Megatron-style, ``--tp``) splits every layer's linears and the vocab-parallel embedding
and head ``tp`` ways; norms are replicated. K/V heads are split when there are at least ``tp`` of them and
replicated otherwise (vLLM ``get_num_kv_heads``: ``max(1, total_num_kv_heads // tp_size)``); the MLA
latent is replicated on every rank. Quantised weights under tensor parallelism: fine-grained fp8 is what
transformers runs (``FP8Linear`` is marked ``_hf_quantized_needs_local_tp``; its block scales are sharded with
the weight, on the same dim, :func:`fp8_scale_count`; checked by the trace to the byte). bitsandbytes is not:
transformers loses its quantisation state under a TP plan, and vLLM — the one engine that shards it — runs only
nf4 it quantises itself at load, so ``--dtype nf4 --tp`` describes vLLM's weights (:func:`vllm_bnb`,
:func:`engine_notes`) and int8/fp4 with ``--tp`` are refused.

Weights (one implementation of each format, :mod:`trainfit.cuda_facts` for bitsandbytes): fp32/bf16/fp16
store every tensor in that format. ``int8``/``nf4``/``fp4`` (bitsandbytes, via transformers'
``BitsAndBytesConfig``) quantise every ``nn.Linear`` but the output head (``get_keys_to_not_convert``; so
also OPT-350m's ``project_in``/``project_out``) and keep the embeddings, the LM head, norms and the fused MoE
expert tensors (not ``nn.Linear``) in bf16, the usual ``dtype=torch.bfloat16`` of the load. ``fp8`` is the
fine-grained e4m3 format DeepSeek-V3 ships (``quantization_config.weight_block_size`` [128, 128]; transformers
``FP8Linear``: fp8 weight plus an fp32 ``weight_scale_inv`` per 128 × 128 block) on the same linears, and on
the fused experts too (``FP8Experts``, per expert and block). bitsandbytes' matmul transients are moments per
linear (:func:`linear_transient_bytes`), and so are fp8's (the activation's fp8 copy and per-group scales);
the fused fp8 experts' grouped kernel (``w8a8_block_fp8_matmul_grouped``) quantises inside its matmul loop and
adds nothing beside its output, and ``fp8_grouped_mm_experts_forward`` keeps the routed product in the compute
dtype (checked by the trace: DeepSeek-V3 and Mixtral in fp8 within 0.01%).

Reserved memory: :func:`generate_events` writes the same quantities as the ``generate`` call's ordered
allocations and frees (weights, the cache's growth by ``cat``, one block per moment), and
:func:`simulate_generate` replays them through the caching-allocator simulation (:mod:`trainfit.allocator`);
:mod:`trainfit.infer` takes the reserve from it. The capacity search applies that reserve as a fraction of
each probe's peak (``capacity(reserve=)``).

The article's rule of thumb for serving — weights × 1.2 — is reported beside our answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction

from trainfit.allocator import AllocatorConfig, AllocatorResult, Event, Op, simulate
from trainfit.analytic.activations import PYTHON_GELUS
from trainfit.arch.params import FUSED_EXPERTS_NOT_BNB, count_params, fused_expert_params, inventory
from trainfit.arch.spec import MlpKind, ModelKind, ModelSpec, NormKind
from trainfit.cuda_facts import (
    BNB_4BIT_BLOCK,
    SdpaKernel,
    allocator_bytes,
    bnb_gemm_4bit_fused,
    has_flash_attention,
    quantized_weight_tensors,
    sdpa_kernel_for,
)
from trainfit.errors import StrategyError
from trainfit.hardware.gpus import GPUSpec
from trainfit.overhead import outside_allocator, overhead_for
from trainfit.result import Component, InferencePhase, PhaseBreakdown, Term
from trainfit.strategy import Attention
from trainfit.strategy.inference import (
    DEFAULT_BLOCK_SIZE,
    CacheKind,
    InferenceSetup,
    KVFormat,
    WeightFormat,
)
from trainfit.units import fmt_gib

#: vLLM's default ``--gpu-memory-utilization``.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
#: Tokens of vLLM V1's profile run: ``max_num_batched_tokens`` with chunked prefill (``SchedulerConfig``).
VLLM_PROFILE_TOKENS = 8192
#: The article's serving rule of thumb: weights × 1.2.
RULE_OF_THUMB_FACTOR = 1.2
#: Block edge of fine-grained FP8 weights (DeepSeek-V3 ``weight_block_size``).
FP8_BLOCK = 128
#: Model types whose MoE router weight transformers keeps in fp32 whatever the load dtype.
_FP32_ROUTERS = frozenset({"deepseek_v2", "deepseek_v3"})
#: ``nn.Linear`` layers outside the layer stack that quantisation converts (everything but the output head,
#: transformers' ``get_keys_to_not_convert``): OPT-350m's ``project_in``/``project_out`` (word_embed_proj_dim).
_OUTER_LINEARS = frozenset({"project_in.weight", "project_out.weight"})
#: Tensors every tensor-parallel rank holds whole beyond the norms and the router: a row-parallel linear's bias
#: (added once after the all-reduce: transformers ``RowwiseParallel.shard_param`` ``Replicate()`` for ``bias``;
#: Megatron/vLLM ``RowParallelLinear``), and Qwen2-MoE's one-output shared-expert gate (no plan rule; vLLM
#: keeps it a plain ``nn.Linear``).
_REPLICATED_UNDER_TP = frozenset(
    {
        "attn.o_proj.bias",
        "mlp.down_proj.bias",
        "mlp.fc2.bias",
        "mlp.shared_experts.down_proj.bias",
        "mlp.shared_expert_gate.weight",
    }
)
#: Largest batch the capacity search tries.
MAX_SEARCH = 1 << 20
#: Fraction of GPU memory a ``generate`` fit leaves free by default.
DEFAULT_INFER_HEADROOM = 0.10


def validate(spec: ModelSpec, setup: InferenceSetup, gpu: GPUSpec | None = None) -> tuple[str, ...]:
    """Refuse what no run could do: a context beyond the model's, a sliding cache without a window, an
    encoder, a format the GPU cannot run. Returns warnings: a model whose every layer slides (Mistral v0.1)
    runs past ``max_position_embeddings`` with a bounded cache, so there the context is a warning."""
    warnings: list[str] = []
    if spec.kind is not ModelKind.CAUSAL_LM:
        raise StrategyError(f"{spec.name} is not a causal language model; trainfit infer models generation")
    ctx = spec.max_position_embeddings
    if ctx is not None and setup.context > ctx:
        why = (
            f"prompt {setup.prompt} + new tokens {setup.new_tokens} = {setup.context} exceeds {spec.name}'s "
            f"context of {ctx} tokens"
        )
        if not (spec.sliding_window and spec.sliding_layers == spec.num_layers):
            raise StrategyError(why)
        warnings.append(f"{why}; every layer attends within {spec.sliding_window} tokens, so it runs, untrained")
    if setup.cache is CacheKind.SLIDING and not (spec.sliding_window and spec.sliding_layers):
        raise StrategyError(f"{spec.name} has no sliding-window layers; use --cache dynamic or static")
    if spec.params_override is not None:
        raise StrategyError("trainfit infer needs a model's shapes, not --params")
    if gpu is not None:
        cc = gpu.compute_capability
        if setup.dtype is WeightFormat.FP8 and not gpu.fp8:
            raise StrategyError(
                f"{gpu.id} (compute capability {cc}) has no fp8 matmuls (needs 8.9 or newer); "
                "use --dtype bf16 (or int8)"
            )
        if setup.kv_format is KVFormat.FP8 and not gpu.fp8:
            # An fp8 cache is storage: the casts run in software below sm89 (vLLM's cache kernels "use bit
            # operations on pre-Hopper", tested on A100: vllm-project/vllm#2279; torch's float8 casts are plain
            # CUDA kernels), so the bytes are the same; only the speed differs.
            warnings.append(
                f"{gpu.id} (compute capability {cc}) has no native fp8: the fp8 cache's casts run in software "
                "(same bytes, slower)"
            )
        if setup.dtype.compute is KVFormat.BF16 and not gpu.bf16:
            warnings.append(
                f"{gpu.id} (compute capability {cc}) has no native bf16: emulated and slow; try --dtype fp16"
            )
    if setup.kv_format is KVFormat.FP8 and setup.cache is CacheKind.STATIC:
        warnings.append(
            "transformers has no static fp8 cache (QuantizedCache is dynamic): estimated as fp8 storage that "
            "attention reads in place, as a fused fp8 kernel does (no dequantised copy)"
        )
    elif hf_fp8(setup) and spec.sliding_layers and spec.sliding_window:
        warnings.append(
            f"transformers' fp8 cache (QuantizedCache) refuses {spec.name}'s sliding-window layers: "
            "estimated as if each layer kept its window in fp8"
        )
    if setup.tp > 1 and spec.num_heads % setup.tp:
        raise StrategyError(f"--tp {setup.tp} must divide the {spec.num_heads} attention heads of {spec.name}")
    kv = spec.num_kv_heads
    if setup.tp > 1 and kv % setup.tp and setup.tp % kv:
        # vLLM's rule (``get_num_kv_heads``): split the k/v heads evenly, or replicate each over tp / kv ranks.
        raise StrategyError(
            f"--tp {setup.tp} neither divides nor is a multiple of {spec.name}'s {kv} k/v heads; "
            "choose a tensor-parallel degree that splits them evenly"
        )
    if setup.tp > 1 and setup.dtype.bnb and setup.dtype is not WeightFormat.NF4:
        raise StrategyError(
            f"--dtype {setup.dtype.value} with --tp {setup.tp}: no engine trainfit models runs it - transformers' "
            "tensor parallelism drops bitsandbytes' quantisation state (the first forward fails) and vLLM shards "
            "only nf4 it quantises at load (it refuses pre-quantised bitsandbytes checkpoints with tensor "
            "parallelism); use --dtype nf4, fp8 or --tp 1"
        )
    if vllm_bnb(setup) and setup.compute_dtype not in (None, setup.dtype.compute):
        raise StrategyError(
            f"--compute-dtype {setup.four_bit_compute.value} with --tp: nf4 under tensor parallelism is vLLM's, "
            "which computes in the model's dtype; drop --compute-dtype"
        )
    widths = {spec.intermediate_size} | ({spec.moe.expert_intermediate_size} if spec.moe is not None else set())
    if setup.tp > 1 and any(w % setup.tp for w in widths if w):
        raise StrategyError(f"--tp {setup.tp} must divide {spec.name}'s MLP width ({', '.join(map(str, widths))})")
    return tuple(warnings)


# -- weights ------------------------------------------------------------------------------------------


def weight_bytes(spec: ModelSpec, setup: InferenceSetup) -> int:
    """Bytes of every parameter tensor on one GPU, each piece rounded to 512 bytes, plus RoPE buffers."""
    return sum(weight_allocations(spec, setup))


def vllm_bnb(setup: InferenceSetup) -> bool:
    """nf4 weights under tensor parallelism: only vLLM runs them (transformers' tensor parallelism turns each
    ``Params4bit`` into a plain ``DTensor`` and loses its ``quant_state``: ``core_model_loading.py``
    ``set_param_for_module`` → ``_dtensor_from_local_like``; the first forward fails — checked with
    ``DistributedConfig(tp_size=2)`` under ``torchrun``). vLLM quantises a 16-bit checkpoint at load, each
    rank its own shard (``model_loader/bitsandbytes_loader.py`` ``_unquantized_generator``: rows for
    column-parallel and fused q/k/v, gate/up, columns for row-parallel, ``quantize_4bit(compress_statistics=
    True, quant_type="nf4")``), then dequantises the nested absmax back to fp32 (``_dequantize_dq``): at rest
    every linear — fused MoE experts included — keeps its packed nf4 weight, an fp32 absmax per 64 values and
    the 16-entry code, whatever ``--double-quant`` says."""
    return setup.tp > 1 and setup.dtype is WeightFormat.NF4


def engine_notes(spec: ModelSpec, setup: InferenceSetup) -> tuple[str, ...]:
    """What the report says when the closed forms describe an engine other than Hugging Face ``generate``:
    nf4 under tensor parallelism is vLLM's (:func:`vllm_bnb`)."""
    if not vllm_bnb(setup):
        return ()
    experts = " (MoE experts too, each forward dequantising the layer's local experts)" if spec.moe else ""
    return (
        f"--dtype nf4 with --tp {setup.tp}: the weights are vLLM's - each rank quantises its shard of a 16-bit "
        f"checkpoint at load{experts}, nf4 with an fp32 absmax per 64 values (--double-quant has no effect); "
        "transformers cannot run bitsandbytes under tensor parallelism. The activations, cache and bitsandbytes "
        "transients are Hugging Face generate's closed forms with vLLM's head split, not vLLM's own runtime "
        "(--server paged sizes its cache pool)",
    )


def bnb_expert_warnings(spec: ModelSpec, setup: InferenceSetup) -> tuple[str, ...]:
    """What a bitsandbytes format (int8, nf4, fp4) leaves in bf16 on an MoE model under Hugging Face ``generate``:
    transformers 5 stores the experts as 3-D ``nn.Parameter`` tensors (``MixtralExperts.gate_up_proj`` /
    ``down_proj``, modeling_mixtral.py), and ``replace_with_bnb_linear`` converts ``nn.Linear`` modules only, so
    ``--dtype nf4`` on Mixtral quantises its attention and little else. vLLM quantises them
    (:func:`vllm_bnb`). Said because the weights then look like a 16-bit model's."""
    if spec.moe is None or not setup.dtype.bnb or vllm_bnb(setup):
        return ()
    experts = fused_expert_params(spec)
    if not experts:
        return ()
    share = experts / count_params(spec)
    return (
        f"--dtype {setup.dtype.value}: bitsandbytes leaves {spec.name}'s fused MoE experts in bf16 "
        f"({fmt_gib(2 * experts // setup.tp)}, {share:.0%} of the parameters): {FUSED_EXPERTS_NOT_BNB}; vLLM "
        "quantises them (--dtype nf4 with --tp > 1)",
    )


def _double_quant(setup: InferenceSetup) -> bool:
    """Whether the 4-bit absmax stays double-quantised at rest (not under vLLM: :func:`vllm_bnb`)."""
    return setup.double_quant and not vllm_bnb(setup)


def weight_allocations(spec: ModelSpec, setup: InferenceSetup) -> list[int]:
    """Every weight allocation on one GPU in load order (each piece of a quantised tensor apart), rounded to
    512 bytes: :func:`weight_bytes` is their sum; the allocator event stream replays them one by one."""
    inv = inventory(spec)
    layer_ids = {id(t) for g in inv.layers for t in g.tensors}
    tp = setup.tp
    keep_bits = setup.dtype.bits if setup.dtype in (WeightFormat.FP32, WeightFormat.BF16, WeightFormat.FP16) else 16
    out: list[int] = []
    fused_gate_up = spec.model_type == "phi3"
    for t, count in inv.all_tensors():
        in_layer = id(t) in layer_ids
        is_norm = len(t.shape) == 1 and ("norm" in t.name)
        # transformers 5 MoE routers are plain Parameters in a TopKRouter module (not nn.Linear: never
        # quantised); DeepSeek-V2/V3 create theirs in fp32 (``DeepseekV3TopkRouter``). Tensor parallelism
        # replicates them: no rule in transformers' ``base_model_tp_plan`` names the router (the generate
        # trace), and vLLM builds it as a ``ReplicatedLinear`` (vllm/model_executor/models/mixtral.py,
        # qwen3_moe.py, deepseek_v2.py).
        router = t.name == "mlp.router.weight"
        split = 1 if is_norm or router or t.name in _REPLICATED_UNDER_TP else tp
        numel = -(-t.numel // split)
        rows = -(-t.shape[0] // split)
        linear = (in_layer or t.name in _OUTER_LINEARS) and t.matmul and len(t.shape) == 2 and not router
        if fused_gate_up and t.name == "mlp.up_proj.weight":
            continue  # Phi-3's gate and up are one ``gate_up_proj`` tensor (counted with gate_proj)
        if fused_gate_up and t.name == "mlp.gate_proj.weight":
            numel, rows = 2 * numel, 2 * rows
        if router and spec.model_type in _FP32_ROUTERS:
            pieces = [allocator_bytes(numel * 4)]
        elif linear and setup.dtype.bnb:
            q = quantized_weight_tensors(numel, rows, setup.dtype.value, double_quant=_double_quant(setup))
            pieces = [allocator_bytes(n) for n in q]
        elif linear and setup.dtype is WeightFormat.FP8:
            n_out = t.shape[0] * (2 if fused_gate_up and t.name == "mlp.gate_proj.weight" else 1)
            pieces = [allocator_bytes(numel), allocator_bytes(4 * fp8_scale_count(t.name, (n_out, t.shape[1]), split))]
        elif setup.dtype is WeightFormat.FP8 and in_layer and t.name.startswith("mlp.experts.") and len(t.shape) == 3:
            pieces = [allocator_bytes(numel), allocator_bytes(4 * fp8_scale_count(t.name, t.shape, split))]
        elif vllm_bnb(setup) and in_layer and t.name.startswith("mlp.experts.") and len(t.shape) == 3:
            # vLLM's ``BitsAndBytesMoEMethod``: each expert's gate, up and down quantised per rank, fused into
            # ``w13_weight``/``w2_weight`` with their absmax concatenated (``_fuse_moe_quant_states``).
            pieces = [allocator_bytes(n) for n in quantized_weight_tensors(numel, rows, "nf4", double_quant=False)]
        else:
            pieces = [allocator_bytes(numel * keep_bits // 8)]
        out += pieces * count
    if spec.rotary_dim:
        out += [allocator_bytes(4 * (spec.rotary_dim // 2))] * 2  # inv_freq and original_inv_freq, fp32
    if spec.embedding_scale:  # Gemma's scaled embedding: a 0-dim ``embed_scale`` buffer
        out.append(allocator_bytes(2))
    if spec.moe is not None and spec.model_type == "deepseek_v3":  # fp32 e_score_correction_bias buffer
        out += [allocator_bytes(4 * spec.moe.num_experts)] * spec.num_moe_layers
    return out


#: Linear weights a tensor-parallel rank splits on their input dimension (row-parallel: transformers
#: ``RowwiseParallel`` ``Shard(-1)``, Megatron/vLLM ``RowParallelLinear``); every other split linear is
#: column-parallel (``ColwiseParallel`` ``Shard(0)``), the fused experts' ``gate_up_proj`` packed-column-parallel.
_ROW_PARALLEL = frozenset(
    {"attn.o_proj.weight", "mlp.down_proj.weight", "mlp.fc2.weight", "mlp.shared_experts.down_proj.weight"}
)


def _chunk0(n: int, k: int) -> int:
    """Rank 0's share of ``n`` rows split ``k`` ways: ``torch.chunk``'s ⌈n/k⌉ (DTensor ``Shard``,
    ``Shard.local_shard_size_and_offset``)."""
    return min(n, -(-n // k))


def _strided_chunk0(n: int, k: int, split_factor: int = 2) -> int:
    """Rank 0's share of ``n`` rows under ``_StridedShard(split_factor=2)`` (transformers' ``packed_colwise``
    for a fused gate/up): ``torch.chunk`` into ``split_factor`` pieces, each chunked ``k`` ways, rank 0 taking
    its chunk of every piece (torch ``_StridedShard._split_tensor``)."""
    c = -(-n // split_factor)
    pieces = [c] * (n // c) + ([n % c] if n % c else [])
    return sum(_chunk0(p, k) for p in pieces)


def fp8_scale_count(name: str, shape: tuple[int, ...], tp: int) -> int:
    """fp32 ``weight_scale_inv`` entries one rank holds for a fine-grained fp8 weight of global ``shape``
    (``[out, in]``, or fused experts' ``[E, out, in]``): one per 128 × 128 block — ``FP8Linear`` allocates
    ``[⌈out/128⌉, ⌈in/128⌉]``, ``FP8Experts`` ``[E, ⌈out/128⌉, ⌈in/128⌉]`` with gate_up's output dim at least 2
    (``_alloc_expert_proj(min_sf_out=2)``), transformers 5.24 integrations/finegrained_fp8.py. Under tensor
    parallelism the block grid is sharded with the weight, on the same dim and by the same style (the plan's
    module rule covers both parameters: ``_expand_parallel_plan``; the fused experts' parameter rules gain
    ``*_scale_inv`` twins: ``FineGrainedFP8HfQuantizer.update_parallel_plan``): a column-parallel linear
    keeps ⌈⌈out/128⌉/tp⌉ block rows, a row-parallel one ⌈⌈in/128⌉/tp⌉ block columns, the packed gate/up
    rank 0's strided share of the block rows (checked against the trace's DTensor local shards)."""
    e, n_out, n_in = (1, *shape) if len(shape) == 2 else shape
    sf_out = max(-(-n_out // FP8_BLOCK), 2 if name.endswith("experts.gate_up_proj") else 1)
    sf_in = -(-n_in // FP8_BLOCK)
    if tp > 1:
        if name.endswith("experts.gate_up_proj"):
            sf_out = _strided_chunk0(sf_out, tp)
        elif name in _ROW_PARALLEL or name.endswith("experts.down_proj"):
            sf_in = _chunk0(sf_in, tp)
        else:
            sf_out = _chunk0(sf_out, tp)
    return e * sf_out * sf_in


# -- the cache ----------------------------------------------------------------------------------------


def kv_heads_per_gpu(spec: ModelSpec, tp: int) -> int:
    """K/V heads on one rank: split when there are at least ``tp``, else one replicated head."""
    return max(1, spec.num_kv_heads // tp)


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerKinds:
    """How many layers hold a full cache and how many a sliding window of ``window`` tokens."""

    full: int
    sliding: int
    window: int | None


def layer_kinds(spec: ModelSpec, setup: InferenceSetup) -> LayerKinds:
    w = spec.sliding_window if spec.sliding_layers else None
    if setup.cache is CacheKind.PAGED or w is None:
        return LayerKinds(full=spec.num_layers, sliding=0, window=None)
    return LayerKinds(full=spec.num_layers - spec.sliding_layers, sliding=spec.sliding_layers, window=w)


def hf_fp8(setup: InferenceSetup) -> bool:
    """An fp8 cache in Hugging Face ``generate``: transformers' ``QuantizedCache(backend="fp8")``, whose
    ``Fp8QuantizedLayer`` stores float8_e4m3fn K/V with a per-tensor fp32 scale and hands attention a
    dequantised copy (see :func:`fp8_moments`). Static caches have no fp8 variant in transformers; there,
    as in a paged server, fp8 is storage only (vLLM's kernels dequantise inside attention)."""
    return setup.kv_format is KVFormat.FP8 and setup.cache in (CacheKind.DYNAMIC, CacheKind.SLIDING)


def kv_layer_tensors(
    spec: ModelSpec, setup: InferenceSetup, tokens: int, *, bits: int | None = None, scales: bool = True
) -> tuple[int, int]:
    """Bytes of one layer's two cache tensors (K and V; MLA: the latent ``kv_nope`` and ``k_rot``) for
    ``tokens`` tokens of every sequence in the batch, each rounded to the allocator's 512 bytes; ``bits``:
    in that width instead of the cache's (a dequantised copy). A Hugging Face fp8 cache (:func:`hf_fp8`)
    adds each tensor's 0-dim fp32 scale (``Fp8QuantizedLayer._quantize``) unless ``scales`` is false."""
    if tokens <= 0:
        return 0, 0
    b = setup.batch
    if bits is None:
        bits = setup.kv_format.bits
        if scales and hf_fp8(setup):
            k, v = kv_layer_tensors(spec, setup, tokens, bits=bits)
            return k + allocator_bytes(4), v + allocator_bytes(4)
    if spec.mla is not None:
        m = spec.mla
        return (
            allocator_bytes(b * tokens * m.kv_lora_rank * bits // 8),
            allocator_bytes(b * tokens * m.qk_rope_head_dim * bits // 8),
        )
    one = allocator_bytes(b * kv_heads_per_gpu(spec, setup.tp) * tokens * spec.head_dim * bits // 8)
    return one, one


def kv_layer_bytes(spec: ModelSpec, setup: InferenceSetup, tokens: int) -> int:
    """One layer's K and V for ``tokens`` tokens: 2 · batch · kv_heads · head_dim · tokens · bytes."""
    return sum(kv_layer_tensors(spec, setup, tokens))


def kv_bytes_per_token(spec: ModelSpec, setup: InferenceSetup) -> int:
    """Cache bytes one token of one sequence takes over all layers (unrounded): the paged-block unit."""
    bits = setup.kv_format.bits
    if spec.mla is not None:
        per_layer = (spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim) * bits
    else:
        per_layer = 2 * kv_heads_per_gpu(spec, setup.tp) * spec.head_dim * bits
    return spec.num_layers * per_layer // 8


def _stored_tokens(setup: InferenceSetup, window: int | None, step: int) -> int:
    """Tokens one layer's cache storage holds after forward pass ``step`` (0 = prefill)."""
    s, n = setup.prompt, setup.new_tokens
    if setup.cache is CacheKind.STATIC:
        return s + n if window is None else min(window, s + n)
    if setup.cache is CacheKind.PAGED:
        bs = setup.block_size
        return -(-(s + step) // bs) * bs
    if window is None or step == 0:
        return s + step
    return min(s + step, window)


def kv_cache_bytes(spec: ModelSpec, setup: InferenceSetup, step: int | None = None) -> int:
    """The cache after pass ``step`` (default: the last pass, ``new_tokens − 1``: the cache at full length)."""
    k = layer_kinds(spec, setup)
    st = setup.new_tokens - 1 if step is None else step
    full = k.full * kv_layer_bytes(spec, setup, _stored_tokens(setup, None, st))
    slid = k.sliding * kv_layer_bytes(spec, setup, _stored_tokens(setup, k.window, st)) if k.sliding else 0
    return full + slid


def _decode_kv_moment(spec: ModelSpec, setup: InferenceSetup, step: int) -> int:
    """Worst cache bytes inside decode pass ``step``. ``torch.cat`` (dynamic caches) holds the running
    layer's old and new K/V together: with every other layer already updated (the last layer running) or
    none yet (the first), whichever is larger — the first only wins when a sliding layer shrinks from the
    prompt to its window. A static sliding layer that is full ``roll``s into a new tensor (one layer's copy);
    a static full layer writes in place."""
    k = layer_kinds(spec, setup)
    groups: list[tuple[int, int, int, int, int, bool]] = []  # count, old, new, old K, new K, cat
    for count, win in ((k.full, None), (k.sliding, k.window)):
        if not count:
            continue
        old_t = kv_layer_tensors(spec, setup, _stored_tokens(setup, win, step - 1))
        new_t = kv_layer_tensors(spec, setup, _stored_tokens(setup, win, step))
        cat = setup.cache in (CacheKind.DYNAMIC, CacheKind.SLIDING)
        roll = setup.cache is CacheKind.STATIC and win is not None and setup.prompt + step - 1 >= win
        copy_new = max(new_t) if roll else 0
        # DynamicLayer assigns each cat at once (one tensor in flight); DynamicSlidingWindowLayer cats K and
        # V before assigning either (both in flight).
        both = win is not None
        in_old = sum(old_t) if both else max(old_t)
        in_new = sum(new_t) if both else max(new_t)
        groups.append((count, sum(old_t), sum(new_t), in_old, in_new if cat else copy_new, cat))
    all_old = sum(g[0] * g[1] for g in groups)
    all_new = sum(g[0] * g[2] for g in groups)
    best = all_new
    for _, _, _, old_k, new_k, cat in groups:
        best = max(best, all_new + old_k, all_old + new_k) if cat else max(best, all_new + new_k)
    return best


# -- activations ----------------------------------------------------------------------------------------


def _kernel(spec: ModelSpec, setup: InferenceSetup, *, masked: bool, flash: bool) -> SdpaKernel:
    d = spec.mla.qk_head_dim if spec.mla else spec.head_dim
    dv = spec.mla.v_head_dim if spec.mla else spec.head_dim
    gqa = spec.num_kv_heads != spec.num_heads and spec.mla is None
    return sdpa_kernel_for(
        half=setup.compute_bits == 16,
        masked=masked,
        same_heads=not gqa or masked,
        gqa_ok=spec.sdpa_gqa and not masked,
        head_dim=d,
        v_head_dim=dv,
        flash_capable=flash,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Moment:
    """A candidate worst moment inside the running layer: its activation bytes (weights and cache apart)."""

    name: str
    activations_bytes: int


def _resident_inputs(spec: ModelSpec, setup: InferenceSetup, q: int, total: int) -> int:
    """Tensors alive through a pass's layers beside them, in the compute dtype or int64: the request's
    (:func:`_request_bytes`), in prefill ``prepare_inputs_for_generation``'s contiguous clone of the prompt ids
    and ``_sample``'s ``unfinished_sequences`` (``torch.ones(b)``), then per pass the embeddings' output
    (kept by the model's ``forward``) and RoPE's cos/sin. No 2D attention mask: an unpadded batch's is all
    ones, and transformers 5.24 ``generate`` drops it before the first pass (``attention_mask = None``); a
    padded batch's is counted with ``_sample``'s bookkeeping (:func:`_padding_mask_2d`) and its 4-D masks apart.
    What a decode pass also holds, made by ``_sample`` after the previous pass's layers, is :func:`_step_bytes`
    (the trace counts it with the logits)."""
    b, a = setup.batch, setup.compute_bits // 8
    h = spec.hidden_size
    first = allocator_bytes(8 * b * q) + allocator_bytes(8 * b) if q == total else 0
    emb = allocator_bytes(b * q * h * a) * (2 if spec.learned_positions else 1)  # + learned position rows
    rope = 0
    if spec.rotary_dim:
        rd = spec.mla.qk_rope_head_dim if spec.mla else spec.rotary_dim  # partial RoPE: Phi, NeoX
        rope = 2 * allocator_bytes(b * q * rd * a)
    # OPT (modeling_opt.OPTDecoder.forward) makes an fp32 ``torch.ones(b, past + q)`` for its positions when
    # generate has dropped the all-ones mask, held through the pass.
    opt = allocator_bytes(4 * b * total) if spec.model_type == "opt" else 0
    return _request_bytes(setup) + first + emb + rope + opt


def _request_bytes(setup: InferenceSetup) -> int:
    """The request's own tensors, alive for the whole ``generate`` call (transformers 5.24
    ``generation/utils.py``): the caller's ``input_ids`` and ``attention_mask`` (``b·s`` int64 each; ``generate``'s
    frame keeps them while ``_sample`` re-makes its own, one token longer, every step), the ``position_ids``
    ``_prepare_position_ids_for_generation`` makes from the mask before the first pass (``cumsum − 1``,
    ``masked_fill``; ``generate``'s ``model_kwargs`` keeps the prompt-sized one) and the pad token as a 0-dim
    tensor (``_prepare_special_tokens``)."""
    return 3 * allocator_bytes(8 * setup.batch * setup.prompt) + allocator_bytes(8)


def _step_masks(spec: ModelSpec, setup: InferenceSetup) -> int:
    """A static cache's decode mask: ``prepare_inputs_for_generation`` builds ``create_masks_for_generate``'s
    ``[b, 1, 1, kv]`` bool mask per layer kind for a compileable cache (``StaticCache``) every step, even with
    the 2D mask dropped; a dynamic cache's forward gets none."""
    if setup.cache is not CacheKind.STATIC:
        return 0
    kinds = layer_kinds(spec, setup)
    total = setup.context
    out = allocator_bytes(setup.batch * total) if kinds.full else 0
    if kinds.sliding and kinds.window is not None:
        out += allocator_bytes(setup.batch * min(kinds.window, total))
    return out


def _step_bytes(spec: ModelSpec, setup: InferenceSetup, tokens: int) -> int:
    """What a decode pass holds of ``_sample``'s bookkeeping (transformers 5.24 ``GenerationMixin._sample``),
    all made after the previous pass's layers: the fp32 copy of the last logits
    (``outputs.logits[:, -1].to(copy=True, dtype=torch.float32)``; with no logits processor
    ``next_token_scores`` is the same tensor), ``argmax``'s ``next_tokens``, the ``input_ids`` ``cat`` and
    ``_update_model_kwargs_for_generation``'s ``position_ids`` ``cat`` (``tokens`` long, int64 each; no
    ``attention_mask`` ``cat``: ``generate`` dropped the all-ones mask, :func:`_resident_inputs`),
    ``unfinished_sequences & ~stopping_criteria(...)`` (int64, ``b``) and
    ``prepare_inputs_for_generation``'s contiguous clones of the last token's id and position (``b`` int64
    each); a static cache's mask beside them (:func:`_step_masks`)."""
    b = setup.batch
    return (
        _fp32_logits(spec, setup)
        + 2 * allocator_bytes(8 * b * tokens)
        + 4 * allocator_bytes(8 * b)
        + _step_masks(spec, setup)
        + _padding_mask_2d(setup, tokens)
    )


def _padding_mask_2d(setup: InferenceSetup, tokens: int) -> int:
    """A left-padded batch's 2-D mask as ``generate`` keeps it: not all ones, so not dropped; after every pass
    ``_update_model_kwargs_for_generation`` makes it one token longer (``torch.cat`` with ``new_ones``, int64
    ``b·tokens``), right after the ``position_ids`` ``cat`` (transformers 5.24 ``generation/utils.py``)."""
    return allocator_bytes(8 * setup.batch * tokens) if setup.padded else 0


def _padding_mask_4d(spec: ModelSpec, setup: InferenceSetup, q: int, kv: int) -> int:
    """The mask a left-padded batch makes the model build per pass under SDPA: ``sdpa_mask`` cannot skip it
    (``_ignore_causal_mask_sdpa``: the padding mask is not all true), so ``and_masks(causal, padding)`` is
    materialised as a bool ``[b, 1, q, kv]`` per mask kind (transformers 5.24 ``masking_utils``), held through
    the pass, and attention takes the masked kernel (memory-efficient; k/v repeated per query head in prefill,
    ``pack_gqa`` in decode). Eager builds its additive mask with or without padding (counted apart)."""
    if not setup.padded or setup.attention is not Attention.SDPA:
        return 0
    return spec.attention_masks * allocator_bytes(setup.batch * q * kv)  # one per mask kind (Qwen2-MoE: two)


def _after_step_bytes(spec: ModelSpec, setup: InferenceSetup, tokens: int) -> int:
    """``_sample`` after decode pass that leaves ``tokens`` in ``input_ids`` (transformers 5.24): the head's
    logits (``outputs`` is deleted only at the end of the loop body) and, when the fp32 copy is made, the
    previous step's copy, the new ``position_ids`` (one token longer; the old one is freed as it is replaced),
    a static cache's step mask (``model_inputs`` still holds it), ``input_ids``, ``next_tokens``,
    ``unfinished_sequences`` and the clones; or, after the old copy is freed, ``argmax`` and the longer
    ``input_ids`` beside the old, or the stopping criteria's three ``b``-sized bools
    (``StoppingCriteriaList.__call__``: ``torch.full``, the criterion's ``is_done``, their ``|``) with the old
    ``input_ids`` gone — whichever is largest."""
    b = setup.batch
    lg32, longer, cur = (
        _fp32_logits(spec, setup),
        allocator_bytes(8 * b * (tokens + 1)),
        allocator_bytes(8 * b * tokens),
    )
    copy = _logits_bytes(spec, setup) + 2 * lg32 + longer + _step_masks(spec, setup) + cur + 4 * allocator_bytes(8 * b)
    # Padded: the mask's ``cat`` runs before the fp32 copy, old and new mask beside the ``new_ones`` column.
    mask_cat = _padding_mask_2d(setup, tokens) + allocator_bytes(8 * b) - lg32 if setup.padded else 0
    copy += _padding_mask_2d(setup, tokens + 1)
    return copy + max(0, longer - lg32, longer - cur + 3 * allocator_bytes(b) - lg32, mask_cat)


def _prefill_after_bytes(spec: ModelSpec, setup: InferenceSetup) -> int:
    """``_sample`` after the prefill's layers (transformers 5.24): the head's ``b·vocab`` logits, their fp32 copy,
    the ``position_ids`` and ``input_ids`` ``cat``s (``prompt + 1`` long; the prompt-sized
    ones stay in ``generate``'s frame), ``next_tokens`` and the stopping criteria's three ``b``-sized bools."""
    b = setup.batch
    longer = allocator_bytes(8 * b * (setup.prompt + 1))
    return (
        _logits_bytes(spec, setup)
        + _fp32_logits(spec, setup)
        + 2 * longer
        + allocator_bytes(8 * b)
        + 3 * allocator_bytes(b)
        + _padding_mask_2d(setup, setup.prompt + 1)
    )


def _layer_moments(
    spec: ModelSpec, setup: InferenceSetup, q: int, kv_len: int, *, masked: bool, flash: bool
) -> list[Moment]:
    """Transient bytes inside the running layer for ``q`` new tokens attending to ``kv_len`` keys, beside
    the layer's input (the previous layer's output). Three moments (transformers' Llama-style layer):

    * ``cache write``: the normed input, q and k after RoPE and v, while the cache takes its ``cat`` copy
      (the caller adds the copy in flight, :func:`_decode_kv_moment`);
    * ``attention``: by kernel. Flash / memory-efficient: the normed input, q, the output and its fp32
      logsumexp (b·heads·q) — k/v repeated per query head when a mask is passed (``repeat_kv``). Math
      (``_scaled_dot_product_attention_math``: GQA or fp32 without a mask): k and v repeated, k scaled by
      √scale (three b·heads·T·head_dim copies), the b·heads·q·T scores twice (``bmm`` and the causal-bias
      add) and the [q, T] bias. Eager (``eager_attention_forward``): k/v repeated, the scores plus mask, the
      fp32 copy ``softmax(dtype=float32)`` makes of bf16 scores (fp16 uses CUDA's fused half-to-float
      softmax, :mod:`trainfit.trace.kernels`), and the fp32 probabilities;
    * ``mlp``: the layer input, the residual sum and the normed MLP input (3 hidden-size tensors), plus gated
      act(gate), up and their product (3 × b·q·intermediate) or dense fc1 output and activation (2 ×).
    """
    b, a = setup.batch, setup.compute_bits // 8
    h = spec.hidden_size
    t = b * q
    tp = setup.tp
    nh = spec.num_heads // tp
    kvh = kv_heads_per_gpu(spec, tp)
    hd = spec.head_dim
    x = allocator_bytes(t * h * a)  # a hidden-size tensor
    out: list[Moment] = []
    if spec.moe is not None:
        # transformers 5 ``grouped_mm_experts_forward`` (integrations/moe.py) over routed = t·top_k rows: the
        # gathered inputs beside gate_up's output, act(gate) and the product; or, at its end, the down
        # projection's output, its product with the routing weights (fp32 unless the model casts them,
        # Qwen-MoE) and that product permuted back. Shared experts: a gated MLP over the t tokens.
        moe = spec.moe
        inter = moe.expert_intermediate_size // tp
        routed = t * moe.experts_per_token
        wb = a if moe.weights_in_compute_dtype else 4
        # Router bookkeeping alive through the experts: logits [t, E] (fp32 for DeepSeek's fp32 router), the
        # top-k weights, and int64 top-k indices, sorted ids, permutation and its inverse.
        rb = 4 if spec.model_type in _FP32_ROUTERS else a
        router = allocator_bytes(t * moe.num_experts * rb) + 4 * allocator_bytes(routed * 8)
        router += 2 * allocator_bytes(routed * wb)
        x_sel = allocator_bytes(routed * h * a) + router
        gate_up = allocator_bytes(routed * 2 * inter * a) + 2 * allocator_bytes(routed * inter * a)
        # fp8 experts (``fp8_grouped_mm_experts_forward``, finegrained_fp8.py) cast the routing weights to the
        # output's dtype first (``sample_weights_g.to(proj_out.dtype)``): the product stays in the compute dtype.
        wp = a if setup.dtype is WeightFormat.FP8 else max(a, wb)
        tail = allocator_bytes(routed * h * a) + 2 * allocator_bytes(routed * h * wp)
        shared_i = moe.num_shared_experts * moe.shared_expert_intermediate_size // tp
        shared = 3 * allocator_bytes(t * shared_i * a) if shared_i else 0
        if shared_i and moe.shared_expert_gate:
            # Qwen2-MoE runs the shared expert first and holds its output through the routed experts.
            mlp = max(x_sel + max(gate_up, tail) + x, shared)
        elif shared_i:
            # DeepSeek runs the routed experts first and holds their output through the shared experts.
            mlp = max(x_sel + max(gate_up, tail), shared + x)
        else:
            mlp = x_sel + max(gate_up, tail)
        if vllm_bnb(setup):
            # vLLM's nf4 experts (``BitsAndBytesMoEMethod._apply_4bit_dequnt``) dequantise every local expert's
            # w13 and w2 to the compute dtype on each forward before ``fused_experts`` runs.
            e = moe.num_experts
            mlp += allocator_bytes(e * 2 * inter * h * a) + allocator_bytes(e * h * inter * a)
    else:
        inter = spec.intermediate_size // tp
        # HF's Python GeLUs (gelu_new: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))) hold fc1's output and
        # three intermediates at once; a fused activation holds its output beside fc1's.
        # Phi-3 fuses gate and up (``gate_up_proj``): its 2·i output lives beside act(gate) and the product.
        n = (
            (4 if spec.model_type == "phi3" else 3)
            if spec.mlp is MlpKind.GATED
            else 4
            if spec.activation in PYTHON_GELUS
            else 2
        )
        mlp = n * allocator_bytes(t * inter * a)
    # GPT2Block keeps ``attn_output`` referenced until it returns: a fourth hidden-size tensor; OPT's decoder
    # layer reassigns ``hidden_states`` to fc1's output, dropping the normed input: two.
    hidden = {"gpt2": 4, "opt": 2}.get(spec.model_type, 3)
    # Eager attention returns its probabilities, which the decoder layer keeps referenced (``hidden_states, _ =
    # self.self_attn(...)``) until it returns: through o_proj and the whole MLP.
    probs = allocator_bytes(b * nh * q * kv_len * a) if setup.attention is Attention.EAGER else 0
    out.append(Moment(name="mlp", activations_bytes=hidden * x + mlp + probs))
    if spec.norm is NormKind.RMSNORM and a != 4:
        # The post-attention RMSNorm upcasts its input (the residual sum) to fp32 and multiplies by the rsqrt
        # of its fp32 mean of squares (LlamaRMSNorm.forward; Gemma's ``_norm(x.float())`` the same): two
        # t·h fp32 tensors and two t-sized fp32 ones beside the layer input and the residual sum. The norm is
        # replicated under tensor parallelism while the MLP is split, so from ``intermediate / tp < hidden``
        # on (Qwen2.5-72B at --tp 4) this, not the MLP, is the layer's prefill peak (the generate trace).
        norm = 2 * allocator_bytes(t * h * 4) + 2 * allocator_bytes(t * 4)
        out.append(Moment(name="norm", activations_bytes=(hidden - 1) * x + norm + probs))
    if spec.mla is not None:
        m = spec.mla
        qd = nh * m.qk_head_dim
        expand = allocator_bytes(b * kv_len * nh * (m.qk_nope_head_dim + m.v_head_dim) * a) + allocator_bytes(
            b * nh * kv_len * m.qk_head_dim * a
        )
        attn = 2 * x + allocator_bytes(t * qd * a) * 2 + expand + allocator_bytes(t * nh * m.v_head_dim * a)
        out.append(Moment(name="attention", activations_bytes=attn))
        out.append(Moment(name="cache write", activations_bytes=2 * x + 2 * allocator_bytes(t * qd * a)))
        out += _quantised_linear_moments(
            spec, setup, t, hidden * x + probs, eager_probs=probs, mla_rows=b * kv_len, mla_attention=attn
        )
        return _with_dequantised(spec, setup, kv_len, out)
    qb = allocator_bytes(t * nh * hd * a)
    kb = allocator_bytes(t * kvh * hd * a)
    out.append(Moment(name="cache write", activations_bytes=2 * x + qb + 2 * kb))
    out += _quantised_linear_moments(spec, setup, t, hidden * x + probs, eager_probs=probs)
    rep = allocator_bytes(b * nh * kv_len * hd * a)
    gqa = kvh != nh
    scores = b * nh * q * kv_len
    if setup.attention is Attention.EAGER:
        upcast = allocator_bytes(scores * 4) if setup.dtype.compute is KVFormat.BF16 and spec.softmax_upcast else 0
        probs = allocator_bytes(scores * 4) if spec.softmax_upcast else allocator_bytes(scores * a)
        # ``softmax(..., dtype=torch.float32).to(query.dtype)``: the cast back is made beside the fp32
        # probabilities and the scores (one expression); bf16's upcast copy, freed inside softmax, is larger.
        cast = allocator_bytes(scores * a) if spec.softmax_upcast and a < 4 else 0
        # One k/v head (MQA, or k/v heads split down to one per rank): ``repeat_kv`` is an ``expand`` that
        # reshapes to a view (stride 0), so nothing repeated is held; ``matmul`` copies it only transiently.
        held_rep = 2 * rep if gqa and kvh > 1 else 0
        attn = 2 * x + qb + held_rep + allocator_bytes(scores * a) + max(upcast, cast) + probs
        name = "attention (eager)"
        if gqa and kvh == 1:
            # ``probs @ v`` with a stride-0 v: ``matmul`` reshapes it for ``bmm`` into a real copy, beside the
            # kept probabilities and the output (the larger of the two matmuls; decode's peak, where T·d > T).
            pv = 2 * x + 2 * qb + rep + allocator_bytes(scores * a)
            out.append(Moment(name="attention probs @ v (eager)", activations_bytes=pv))
    else:
        kernel = _kernel(spec, setup, masked=masked, flash=flash)
        if kernel is SdpaKernel.MATH:
            bias = allocator_bytes(q * kv_len * a) if q > 1 else 0
            attn = 2 * x + qb + (3 if gqa else 1) * rep + bias + (2 if q > 1 else 1) * allocator_bytes(scores * a)
        else:
            # A mask makes transformers repeat k/v per query head (``use_gqa_in_sdpa`` is false with a mask) —
            # except for one query token, where 5.24's ``pack_gqa`` folds the query heads onto the k/v heads
            # (a view; the mask broadcasts) and nothing is repeated (``sdpa_attention_forward``).
            repeat = 2 * rep if gqa and masked and q > 1 else 0
            # The efficient kernel turns a bool mask into an additive one in q's dtype, columns padded to 16
            # (``convert_boolean_attn_mask``, ``preprocess_mask``; see trainfit.trace.kernels).
            bias = allocator_bytes(b * q * (-(-kv_len // 16) * 16) * a) if masked else 0
            attn = 2 * x + 2 * qb + repeat + bias + allocator_bytes(b * nh * q * 4)
            if masked and kv_len % 16:
                # ``preprocess_mask`` pads the converted mask while the unpadded one is alive (before the
                # kernel's output and logsumexp exist): both beside q and the repeated k/v.
                unpadded = allocator_bytes(b * q * kv_len * a)
                pad = 2 * x + qb + repeat + unpadded + bias
                out.append(Moment(name=f"attention mask pad (sdpa {kernel.value})", activations_bytes=pad))
        name = f"attention (sdpa {kernel.value})"
    out.append(Moment(name=name, activations_bytes=attn))
    return _with_dequantised(spec, setup, kv_len, out)


def linear_transient_bytes(setup: InferenceSetup, rows: int, k: int, n: int) -> int:
    """The worst bytes one quantised linear holds beside its input while it runs, its output included, for
    ``rows`` tokens of ``k`` inputs and ``n`` outputs (the CUDA kernels of bitsandbytes 0.50,
    backends/cuda/ops.py; the trace emulates the same kernels, trainfit.trace.bnb):

    * nf4/fp4 (``gemm_4bit``): where bitsandbytes runs its fused kernel
      (:func:`trainfit.cuda_facts.bnb_gemm_4bit_fused`: up to 4 rows on every CUDA GPU with a block-aligned
      ``k``, up to 1536 rows as the GPU's architecture and SM count decide, ``setup.compute_capability`` /
      ``setup.sm_count`` from ``--gpu``) it writes the output only; otherwise ``_dequant_linear_fallback``
      dequantises the whole weight (n·k in the compute dtype) beside the output, and with double quantisation
      first the per-block absmax and its sum with the offset (two fp32 tensors of ⌈n·k/64⌉). A
      ``--compute-dtype`` other than the activations' (transformers' default fp32) adds ``Linear4bit.forward``'s
      casts: the input in the compute dtype, held through the matmul, and the output in it beside its cast
      back (``.to(inp_dtype)``); the dequantised weight and the output are then in the compute dtype;
    * int8 (``MatMul8bitLt``, outlier threshold 6.0): the fp16 copy of the input, the int8 rows and fp32 row
      scales, then ``A.abs()`` and its bool outlier mask (``int8_vectorwise_quant``); then, with the int8 rows
      and scales still held, the int32 product beside its fp16 dequantisation, and the fp16 beside the cast
      to the compute dtype (``int8_scaled_mm`` → ``int8_mm_dequant``);
    * fp8 (transformers ``FP8Linear``, Triton ``w8a8_block_dynamic_fp8_matmul`` or DeepGEMM): the input
      quantised in one pass — an fp8 copy (rows·k) and fp32 scales per 1 × 128 group — beside the output.
    """
    a = setup.compute_bits // 8
    out = allocator_bytes(rows * n * a)
    if setup.dtype in (WeightFormat.NF4, WeightFormat.FP4):
        c = setup.four_bit_compute.bits // 8
        x_c = allocator_bytes(rows * k * c) if c != a else 0  # x.to(compute_dtype), a local to the end
        out_c = allocator_bytes(rows * n * c)
        cast = x_c + out_c + out if c != a else 0  # the compute-dtype output beside its cast back
        fused = bnb_gemm_4bit_fused(
            rows,
            n,
            k,
            compute=setup.four_bit_compute.value,
            compute_capability=setup.compute_capability,
            sm_count=setup.sm_count,
        )
        if fused:
            return max(x_c + out_c, cast)
        absmax = 2 * allocator_bytes(4 * -(-(n * k) // BNB_4BIT_BLOCK)) if _double_quant(setup) else 0
        return max(x_c + absmax + allocator_bytes(n * k * c) + out_c, cast)
    if setup.dtype is WeightFormat.INT8:
        half = setup.dtype.compute is KVFormat.FP16
        held = allocator_bytes(rows * k) + allocator_bytes(rows * 4)  # int8 rows, fp32 row scales
        a16 = 0 if half else allocator_bytes(rows * k * 2)
        mask = allocator_bytes(rows * k)
        quant = a16 + held + max(allocator_bytes(rows * k * 2) + mask, mask + allocator_bytes(1))
        f16 = allocator_bytes(rows * n * 2)
        return max(quant, held + allocator_bytes(rows * n * 4) + f16, held + f16 + (0 if half else out))
    if setup.dtype is WeightFormat.FP8:
        return allocator_bytes(rows * k) + allocator_bytes(4 * rows * -(-k // FP8_BLOCK)) + out
    return out


def _quantised_linear_moments(
    spec: ModelSpec,
    setup: InferenceSetup,
    t: int,
    hidden: int,
    *,
    eager_probs: int = 0,
    mla_rows: int = 0,
    mla_attention: int = 0,
) -> list[Moment]:
    """One moment per bitsandbytes linear of a Llama-style layer (dense or MoE shared experts) for ``t`` tokens:
    what is alive when it is called plus :func:`linear_transient_bytes`. ``hidden``: the hidden-size tensors
    the layer holds through its MLP. Attention (``LlamaAttention.forward``): q_proj beside the layer input
    and its norm, k_proj beside q too, v_proj beside q and k, o_proj beside q after RoPE and the attention
    output. MLP (``LlamaMLP``: ``down(act(gate(x)) * up(x))``): gate beside the MLP's hidden tensors, up beside
    act(gate) too, down beside the product; Phi-3's fused ``gate_up_proj`` output stays alive (the ``gate``
    chunk is a view of it) through the down projection; a dense MLP's fc2 beside fc1's activated output.
    MoE layers: their shared experts (nn.Linear) — DeepSeek's after the routed experts, whose output is held
    (one more hidden-size tensor); the routed experts are fused tensors bitsandbytes does not quantise; a
    MoE model's leading dense layers (DeepSeek ``first_k_dense_replace``) run the dense MLP.
    ``hidden``: the hidden-size tensors the layer holds through its MLP, and eager attention's probabilities
    (``eager_probs``), which live from o_proj to the end of the layer.
    MLA (``DeepseekV2Attention.forward``): q_a_proj/q_proj beside the input and its norm, q_b_proj beside the
    normed q latent, kv_a_proj_with_mqa beside q, kv_b_proj over the whole cache (``mla_rows`` = batch × cached
    tokens, ``expand_kv``) beside q, the query cat and the kv latent, o_proj beside the attention moment
    (``mla_attention``: the expanded keys and values stay referenced) and the kv latent."""
    if not (setup.dtype.bnb or setup.dtype is WeightFormat.FP8):
        return []
    a, tp = setup.compute_bits // 8, setup.tp
    h, nh, kvh = spec.hidden_size, spec.num_heads // tp, kv_heads_per_gpu(spec, tp)
    x = allocator_bytes(t * h * a)
    out: list[Moment] = []

    def add(name: str, base: int, k: int, n: int) -> None:
        out.append(
            Moment(
                name=f"{name} ({setup.dtype.value})", activations_bytes=base + linear_transient_bytes(setup, t, k, n)
            )
        )

    if spec.mla is None:
        hd = spec.head_dim
        qb, kb = allocator_bytes(t * nh * hd * a), allocator_bytes(t * kvh * hd * a)
        add("q_proj", 2 * x, h, nh * hd)
        add("k_proj", 2 * x + qb, h, kvh * hd)
        add("v_proj", 2 * x + qb + kb, h, kvh * hd)
        add("o_proj", 2 * x + 2 * qb + eager_probs, nh * hd, h)
    else:
        m = spec.mla
        qd = allocator_bytes(t * nh * m.qk_head_dim * a)
        if m.q_lora_rank:
            add("q_a_proj", 2 * x, h, m.q_lora_rank)
            add("q_b_proj", 2 * x + allocator_bytes(t * m.q_lora_rank * a), m.q_lora_rank, nh * m.qk_head_dim)
        else:
            add("q_proj", 2 * x, h, nh * m.qk_head_dim)
        latent = allocator_bytes(t * (m.kv_lora_rank + m.qk_rope_head_dim) * a)
        add("kv_a_proj_with_mqa", 2 * x + qd, h, m.kv_lora_rank + m.qk_rope_head_dim)
        kv_b = linear_transient_bytes(setup, mla_rows, m.kv_lora_rank, nh * (m.qk_nope_head_dim + m.v_head_dim))
        out.append(Moment(name=f"kv_b_proj ({setup.dtype.value})", activations_bytes=2 * x + 2 * qd + latent + kv_b))
        add("o_proj", mla_attention + latent, nh * m.v_head_dim, h)

    def gated(base: int, inter: int, name: str = "") -> None:
        ti = allocator_bytes(t * inter * a)
        add(f"{name}gate_proj", base, h, inter)
        add(f"{name}up_proj", base + ti, h, inter)
        add(f"{name}down_proj", base + ti, inter, h)

    if spec.moe is not None:
        moe = spec.moe
        shared_i = moe.num_shared_experts * moe.shared_expert_intermediate_size // tp
        if shared_i:
            gated(hidden + (0 if moe.shared_expert_gate else x), shared_i, "shared ")
        if moe.num_dense_layers:
            gated(hidden, spec.intermediate_size // tp, "dense ")
        return out
    inter = spec.intermediate_size // tp
    if spec.model_type == "phi3":
        add("gate_up_proj", hidden, h, 2 * inter)
        add("down_proj", hidden + allocator_bytes(t * 2 * inter * a) + allocator_bytes(t * inter * a), inter, h)
    elif spec.mlp is MlpKind.GATED:
        gated(hidden, inter)
    else:
        add("fc1", hidden, h, inter)
        add("fc2", hidden + allocator_bytes(t * inter * a), inter, h)
    return out


def _with_dequantised(spec: ModelSpec, setup: InferenceSetup, kv_len: int, moments: list[Moment]) -> list[Moment]:
    """A Hugging Face fp8 cache hands attention compute-dtype K/V that are not the cache: the prompt's own
    K/V in prefill (``Fp8QuantizedLayer.update`` returns its inputs on the first call), the dequantised
    whole cache in decode (``_dequantize``: ``(q.float() * scale).to(dtype)``). They live through attention
    (and MLA's ``expand_kv``), where an unquantised cache is read in place."""
    if not hf_fp8(setup):
        return moments
    dq = sum(kv_layer_tensors(spec, setup, kv_len, bits=setup.compute_bits))
    return [
        Moment(name=m.name, activations_bytes=m.activations_bytes + dq) if m.name.startswith("attention") else m
        for m in moments
    ]


def fp8_quantise_moments(spec: ModelSpec, setup: InferenceSetup, tokens: int) -> list[tuple[str, int, int]]:
    """Prefill of a Hugging Face fp8 cache (transformers ``Fp8QuantizedLayer.lazy_initialization`` →
    ``_quantize``): per tensor, K then V, ``(t.float() / scale).to(float8_e4m3fn)`` holds the fp32 copy
    and the quotient (the copy is free for fp32 activations: ``.float()`` returns its input), then the
    quotient beside the fp8 result. Returns (moment, cache bytes not yet written, transient bytes) beside
    the running layer's ``cache write`` activations; the 0-dim scales are 512 bytes each."""
    kq, vq = kv_layer_tensors(spec, setup, tokens, scales=False)
    fk, fv = kv_layer_tensors(spec, setup, tokens, bits=32)
    copies = 1 if setup.compute_bits == 32 else 2
    sc = allocator_bytes(4)
    return [
        ("fp8 quantise (K)", kq + vq + sc, copies * fk),
        ("fp8 quantise (K)", vq + sc, fk),
        ("fp8 quantise (V)", vq, copies * fv),
        ("fp8 quantise (V)", 0, fv),
    ]


def fp8_dequantise_bytes(spec: ModelSpec, setup: InferenceSetup, tokens: int) -> tuple[int, int]:
    """Decode of a Hugging Face fp8 cache (``Fp8QuantizedLayer.update`` after the first call): the step's
    quantised K/V are ``cat`` onto the stored ones, then ``_dequantize`` makes ``q.float()`` and its product
    with the scale (fp32, two copies) and casts it to the compute dtype; K is dequantised first and held while
    V is. ``update``'s locals keep the *old* fp8 K and V (and the step's quantised token) alive until it
    returns. Returns (old fp8 K + V of the running layer, transient bytes) for a cache of ``tokens``."""
    ok, ov = kv_layer_tensors(spec, setup, tokens - 1, scales=False)
    nk, nv = kv_layer_tensors(spec, setup, 1, scales=False)
    fk, fv = kv_layer_tensors(spec, setup, tokens, bits=32)
    bk, _ = kv_layer_tensors(spec, setup, tokens, bits=setup.compute_bits)
    return ok + ov, nk + nv + max(2 * fk, bk + 2 * fv)


def _norm_moment(spec: ModelSpec, setup: InferenceSetup, q: int) -> int:
    """The final norm over every position (``logits_to_keep`` slices only its output): RMSNorm upcasts to
    fp32 (input, fp32 copy, normalised fp32, cast back) — LlamaRMSNorm.forward."""
    b, a = setup.batch, setup.compute_bits // 8
    t = b * q * spec.hidden_size
    if spec.norm is NormKind.RMSNORM and a != 4:
        return allocator_bytes(t * a) + 2 * allocator_bytes(t * 4)
    return 2 * allocator_bytes(t * a)


def _cache_write(moments: list[Moment]) -> int:
    return next(m.activations_bytes for m in moments if m.name == "cache write")


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseEstimate:
    """One phase's worst moment and what it is."""

    breakdown: PhaseBreakdown
    moment: str


def _logits_bytes(spec: ModelSpec, setup: InferenceSetup) -> int:
    """Last-token logits in the compute dtype (the head's output, vocab-parallel then gathered)."""
    return allocator_bytes(setup.batch * spec.vocab_size * setup.compute_bits // 8)


def _fp32_logits(spec: ModelSpec, setup: InferenceSetup) -> int:
    return allocator_bytes(setup.batch * spec.vocab_size * 4)


def phase_estimates(
    spec: ModelSpec, setup: InferenceSetup, *, flash: bool = True, weights: int | None = None
) -> dict[InferencePhase, PhaseEstimate]:
    """Prefill and decode: the largest of each phase's candidate moments, by component. A model transformers
    offers no SDPA for (Gemma-2) runs eager attention."""
    if setup.attention is Attention.SDPA and not spec.supports_sdpa:
        setup = dataclasses.replace(setup, attention=Attention.EAGER)
    w = weight_bytes(spec, setup) if weights is None else weights
    s, n = setup.prompt, setup.new_tokens
    kinds = layer_kinds(spec, setup)

    def best(cands: list[tuple[str, int, int, int]], phase: InferencePhase) -> PhaseEstimate:
        name, kv, act, logit = max(cands, key=lambda c: c[1] + c[2] + c[3])
        comps = {Component.WEIGHTS: w, Component.KV_CACHE: kv, Component.ACTIVATIONS: act}
        if logit:
            comps[Component.LOGITS_LOSS] = logit
        return PhaseEstimate(breakdown=PhaseBreakdown(phase=phase, components=comps), moment=name)

    # Prefill: the last layer runs with every cache entry written (S tokens) — or the static cache whole.
    kv_pre = kv_cache_bytes(spec, setup, 0)
    window_masked = kinds.window is not None and s >= kinds.window and setup.attention is Attention.SDPA
    resident = _resident_inputs(spec, setup, s, s)
    mask = 0
    if setup.padded and setup.attention is Attention.SDPA:
        mask = _padding_mask_4d(spec, setup, s, s)
        window_masked = True  # the masked kernel, as for a window
    elif setup.attention is Attention.EAGER:
        mask = spec.attention_masks * allocator_bytes(setup.batch * s * s * setup.compute_bits // 8)
    elif window_masked:
        mask = allocator_bytes(s * s)  # sdpa_mask: one bool [1, 1, s, s] broadcast over the batch
    elif spec.attention_masks > 1 and not spec.sliding_layers:
        # Qwen2-MoE builds its sliding mask even with no window: a bool [1, 1, s, s] (no padding mask: generate
        # dropped the all-ones one) no layer reads.
        mask = allocator_bytes(s * s)
    pre: list[tuple[str, int, int, int]] = []
    for mo in _layer_moments(spec, setup, s, s, masked=window_masked, flash=flash):
        pre.append((f"prefill {mo.name}", kv_pre, resident + mask + mo.activations_bytes, 0))
    if hf_fp8(setup):
        cw = _cache_write(_layer_moments(spec, setup, s, s, masked=window_masked, flash=flash))
        for name, unwritten, transient in fp8_quantise_moments(spec, setup, s):
            pre.append((f"prefill {name}", kv_pre - unwritten, resident + mask + cw + transient, 0))
    pre.append(("prefill final norm", kv_pre, resident + _norm_moment(spec, setup, s), 0))
    pre.append(
        (
            "prefill logits",
            kv_pre,
            _request_bytes(setup) + allocator_bytes(8 * setup.batch),
            _prefill_after_bytes(spec, setup),
        )
    )
    out = {InferencePhase.PREFILL: best(pre, InferencePhase.PREFILL)}
    if n < 2:
        return out
    dec: list[tuple[str, int, int, int]] = []
    for step in sorted({1, min(2, n - 1), n - 1}):
        total = s + step
        kv_after = kv_cache_bytes(spec, setup, step)
        res = _resident_inputs(spec, setup, 1, total)
        held = _step_bytes(spec, setup, total)
        if setup.attention is Attention.EAGER:
            res += spec.attention_masks * allocator_bytes(setup.batch * total * setup.compute_bits // 8)
        kv_len = _stored_tokens(setup, None, step) if setup.cache is not CacheKind.STATIC else s + n
        res += _padding_mask_4d(spec, setup, 1, total)
        layer = _layer_moments(spec, setup, 1, kv_len, masked=setup.padded, flash=flash)
        for mo in layer:
            kv = _decode_kv_moment(spec, setup, step) if mo.name == "cache write" else kv_after
            dec.append((f"decode step {step}: {mo.name}", kv, res + mo.activations_bytes, held))
        if hf_fp8(setup):
            old, transient = fp8_dequantise_bytes(spec, setup, kv_len)
            dec.append(
                (f"decode step {step}: fp8 dequantise", kv_after + old, res + _cache_write(layer) + transient, held)
            )
        dec.append(
            (f"decode step {step}: logits", kv_after, _request_bytes(setup), _after_step_bytes(spec, setup, total))
        )
    out[InferencePhase.DECODE] = best(dec, InferencePhase.DECODE)
    return out


# -- reserved memory: the generate call as an allocator event stream ------------------------------------


class _Stream:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self._next = 0

    def alloc(self, nbytes: int) -> int:
        self._next += 1
        if nbytes > 0:
            self.events.append(Event(Op.ALLOC, self._next, nbytes))
        return self._next if nbytes > 0 else 0

    def free(self, *keys: int) -> None:
        for key in keys:
            if key:
                self.events.append(Event(Op.FREE, key))


def generate_events(spec: ModelSpec, setup: InferenceSetup, *, flash: bool = True) -> list[Event]:
    """The allocations and frees of one ``generate`` call, in order, from the same quantities as the moments: the
    weights tensor by tensor (:func:`weight_allocations`); the request's ids and position ids, re-made one token
    longer after every pass (``torch.cat`` in ``_sample`` and ``_update_model_kwargs_for_generation``); per pass the
    position ids, embeddings and RoPE tables; per layer its ``cache write``, ``attention`` and ``mlp`` moments (each
    one block beside the layer input, freed when the next starts) and the cache's own allocations inside the first —
    ``DynamicLayer.update`` makes a one-token-longer K, then V, and frees the old ones (the growth that fragments a
    caching allocator); a sliding layer ``cat``s both before freeing; ``StaticLayer`` allocates the whole context at
    the prefill (a full static sliding layer ``roll``s into new tensors); an fp8 cache (:func:`hf_fp8`) quantises
    through fp32 copies and, from the first decode step, holds the dequantised K/V through attention; bitsandbytes
    weights add the layer's worst quantised linear as one block; then the final norm, the head's logits and
    ``generate``'s fp32 copy (the previous step's freed after the next forward). The blocks are coarser than the
    real tensors (one per moment), so its allocated peak is near the closed forms', not equal to it."""
    if setup.attention is Attention.SDPA and not spec.supports_sdpa:
        setup = dataclasses.replace(setup, attention=Attention.EAGER)
    st = _Stream()
    for n in weight_allocations(spec, setup):
        st.alloc(n)
    b, a, h = setup.batch, setup.compute_bits // 8, spec.hidden_size
    s, n_new = setup.prompt, setup.new_tokens
    kinds = layer_kinds(spec, setup)
    windows = [None] * kinds.full + [kinds.window] * kinds.sliding
    fp8 = hf_fp8(setup)
    ids, mask = st.alloc(8 * b * s), st.alloc(8 * b * s)
    cache: list[list[int]] = [[0, 0] for _ in windows]
    prev_lg32 = 0
    for step in range(n_new):
        q, total = (s, s) if step == 0 else (1, s + step)
        kv_len = _stored_tokens(setup, None, step) if setup.cache is not CacheKind.STATIC else s + n_new
        per_pass = [st.alloc(allocator_bytes(8 * b * q)), st.alloc(allocator_bytes(8 * q))]
        if spec.rotary_dim:
            rd = spec.mla.qk_rope_head_dim if spec.mla else spec.rotary_dim
            per_pass += [st.alloc(allocator_bytes(b * q * rd * a)) for _ in range(2)]
        if setup.attention is Attention.EAGER:
            per_pass += [st.alloc(allocator_bytes(b * q * total * a)) for _ in range(spec.attention_masks)]
        xb = allocator_bytes(b * q * h * a)
        if spec.learned_positions:
            per_pass.append(st.alloc(xb))
        x = st.alloc(xb)
        moments = {
            m.name: m.activations_bytes for m in _layer_moments(spec, setup, q, kv_len, masked=False, flash=flash)
        }
        attn = next(v for k, v in moments.items() if k.startswith("attention"))
        linear = max((v for k, v in moments.items() if k.endswith(f"({setup.dtype.value})")), default=0)
        for i, win in enumerate(windows):
            block = st.alloc(moments["cache write"] - xb)
            held = _cache_update(st, spec, setup, cache[i], win, step, fp8)
            st.free(block)
            block = st.alloc(
                attn - xb - sum(kv_layer_tensors(spec, setup, kv_len, bits=setup.compute_bits) if held else ())
            )
            st.free(block, *held)
            if linear:  # the layer's worst quantised linear (bitsandbytes' matmul transients), one block
                st.free(st.alloc(linear - xb))
            block = st.alloc(moments["mlp"] - xb)
            out = st.alloc(xb)
            st.free(block, x)
            x = out
        norm = st.alloc(_norm_moment(spec, setup, q))
        st.free(norm)
        lg = st.alloc(_logits_bytes(spec, setup))
        lg32 = st.alloc(_fp32_logits(spec, setup))
        st.free(lg, x, *per_pass, prev_lg32)
        prev_lg32 = lg32
        new_ids, new_mask = (
            st.alloc(allocator_bytes(8 * b * (total + 1))),
            st.alloc(allocator_bytes(8 * b * (total + 1))),
        )
        st.free(ids, mask)
        ids, mask = new_ids, new_mask
    return st.events


def _cache_update(
    st: _Stream, spec: ModelSpec, setup: InferenceSetup, keys: list[int], win: int | None, step: int, fp8: bool
) -> tuple[int, ...]:
    """One layer's cache allocations inside its ``update`` (``keys``: the layer's current K and V, replaced in
    place); returns what stays alive through attention (an fp8 cache's compute-dtype K/V)."""
    new = kv_layer_tensors(spec, setup, _stored_tokens(setup, win, step), scales=False)
    if fp8:
        sc = allocator_bytes(4)
        f32 = kv_layer_tensors(spec, setup, _stored_tokens(setup, win, step), bits=32)
        if step == 0:
            for j in (0, 1):
                st.alloc(sc)  # the per-tensor scale, kept by the cache
                c1, c2 = st.alloc(f32[j]), st.alloc(f32[j])
                st.free(c1)
                keys[j] = st.alloc(new[j])
                st.free(c2)
            return ()
        old = list(keys)
        keys[0], keys[1] = st.alloc(new[0]), st.alloc(new[1])
        comp = kv_layer_tensors(spec, setup, _stored_tokens(setup, win, step), bits=setup.compute_bits)
        out = []
        for j in (0, 1):
            c1, c2 = st.alloc(f32[j]), st.alloc(f32[j])
            st.free(c1)
            out.append(st.alloc(comp[j]))
            st.free(c2)
        st.free(*old)
        return tuple(out)
    if setup.cache is CacheKind.STATIC:
        roll = win is not None and setup.prompt + step - 1 >= win
        if step == 0 or roll:
            old = list(keys)
            keys[0], keys[1] = st.alloc(new[0]), st.alloc(new[1])
            st.free(*old)
        return ()
    if win is not None:  # DynamicSlidingWindowLayer: both cats before either assignment
        old = list(keys)
        keys[0], keys[1] = st.alloc(new[0]), st.alloc(new[1])
        st.free(*old)
        return ()
    for j in (0, 1):  # DynamicLayer: K's cat assigned (old K freed), then V's
        nk = st.alloc(new[j])
        st.free(keys[j])
        keys[j] = nk
    return ()


def simulate_generate(
    spec: ModelSpec, setup: InferenceSetup, config: AllocatorConfig | None = None, *, flash: bool = True
) -> AllocatorResult:
    """The caching allocator's peaks over :func:`generate_events` (``config``: ``PYTORCH_CUDA_ALLOC_CONF``,
    default PyTorch's defaults)."""
    return simulate(generate_events(spec, setup, flash=flash), config)


# -- what fits --------------------------------------------------------------------------------------------


def required_bytes(peak_bytes: int, gpu: GPUSpec | None = None, reserve: Fraction | None = None) -> int:
    """What must fit on the GPU: the ``nvidia-smi`` estimate — peak allocated + allocator reserve + what
    sits outside the allocator on ``gpu`` (:mod:`trainfit.overhead`, shared with training). ``reserve``: the
    allocator reserve as a fraction of the peak (a simulated one), else the fixed fraction."""
    if reserve is None:
        return peak_bytes + overhead_for(peak_bytes, gpu, inference=True).total_bytes
    over = outside_allocator(gpu, allocator_reserve_bytes=int(peak_bytes * reserve), inference=True)
    return peak_bytes + over.total_bytes


def peak_bytes(spec: ModelSpec, setup: InferenceSetup, *, flash: bool = True, weights: int | None = None) -> int:
    return max(p.breakdown.total_bytes for p in phase_estimates(spec, setup, flash=flash, weights=weights).values())


@dataclass(frozen=True, slots=True, kw_only=True)
class Capacity:
    """``generate`` capacities on one GPU (one tensor-parallel group): the largest batch at the setup's
    prompt and new tokens, and the longest context (prompt + new tokens, new tokens fixed) at its batch.
    0 when even the smallest does not fit; ``*_capped``: the search stopped at its limit (the model's
    context, or :data:`MAX_SEARCH`)."""

    usable_bytes: int
    max_batch: int
    max_batch_capped: bool
    max_context: int
    max_context_capped: bool


def _largest(fits: Callable[[int], bool], lo_value: int, cap: int) -> tuple[int, bool]:
    """Largest v in [lo_value, cap] with fits(v) (monotone), by doubling then bisection; (lo_value − 1, False)
    when none."""
    if not fits(lo_value):
        return lo_value - 1, False
    lo, hi = lo_value, lo_value * 2
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    if hi > cap:
        if fits(cap):
            return cap, True
        hi = cap
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, False


def capacity(
    spec: ModelSpec,
    setup: InferenceSetup,
    usable: int,
    *,
    flash: bool = True,
    gpu: GPUSpec | None = None,
    reserve: Fraction | None = None,
    extra_bytes: int = 0,
) -> Capacity:
    """Search batch and context with the closed forms (memory is monotone in both). ``reserve``: the
    allocator reserve as a fraction of each probe's peak (the request's simulated fraction; one simulation
    per probe would take minutes), else the fixed fraction. ``extra_bytes``: held in every probe besides its
    closed form (the cuBLAS workspaces)."""
    w = weight_bytes(spec, setup)

    def fits(s: InferenceSetup) -> bool:
        return required_bytes(peak_bytes(spec, s, flash=flash, weights=w) + extra_bytes, gpu, reserve) <= usable

    def fits_batch(b: int) -> bool:
        return fits(dataclasses.replace(setup, batch=b))

    def fits_prompt(p: int) -> bool:
        return fits(dataclasses.replace(setup, prompt=p))

    mb, mb_cap = _largest(fits_batch, 1, MAX_SEARCH)
    limit = (spec.max_position_embeddings or MAX_SEARCH) - setup.new_tokens
    mp, mp_cap = _largest(fits_prompt, 1, limit) if limit >= 1 else (0, False)
    return Capacity(
        usable_bytes=usable,
        max_batch=mb,
        max_batch_capped=mb_cap,
        max_context=mp + setup.new_tokens if mp > 0 else 0,
        max_context_capped=mp_cap,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class PagedCapacity:
    """A paged server's KV pool as vLLM sizes it at start-up (see the module docstring)."""

    gpu_memory_utilization: float
    requested_bytes: int  # total GPU memory × utilisation
    weights_bytes: int
    profile_peak_bytes: int  # activations of the profile run (our prefill formula over its tokens)
    non_torch_bytes: int  # CUDA context and kernels (trainfit.overhead for the GPU; vLLM measures it)
    kv_budget_bytes: int
    block_size: int
    block_bytes: int  # one block of every layer: block_size · bytes per token
    kv_blocks: int
    max_concurrent_tokens: int
    max_concurrent_sequences: int  # at the setup's context (prompt + new tokens)


def paged_capacity(
    spec: ModelSpec,
    setup: InferenceSetup,
    gpu_memory_bytes: int,
    utilization: float,
    *,
    flash: bool = True,
    gpu: GPUSpec | None = None,
) -> PagedCapacity:
    """KV blocks and concurrent tokens after weights and the profile run's peak under ``utilization`` —
    vLLM V1 ``Worker.determine_available_memory`` (requested = total × utilisation; available = requested −
    weights − profile peak − non-torch) and ``kv_cache_utils.get_num_blocks`` (available // page size of all
    layers). Where we differ: vLLM profiles a real forward over ``max_num_batched_tokens`` and a sampler run
    over ``max_num_seqs``; we compute that forward's prefill activations (one sequence of
    :data:`VLLM_PROFILE_TOKENS`, flash attention, no cache) and two fp32 logits rows per sequence slot, and
    take the memory outside the allocator from :mod:`trainfit.overhead` for ``gpu``. CUDA-graph memory
    (captured after the KV pool) is left out."""
    if not 0.0 < utilization <= 1.0:
        raise StrategyError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    w = weight_bytes(spec, setup)
    prof_setup = dataclasses.replace(
        setup, batch=1, prompt=VLLM_PROFILE_TOKENS, new_tokens=1, cache=CacheKind.DYNAMIC, attention=Attention.SDPA
    )
    pre = phase_estimates(spec, prof_setup, flash=flash, weights=w)[InferencePhase.PREFILL].breakdown
    sampler = 2 * allocator_bytes(256 * spec.vocab_size * 4)  # vLLM default max_num_seqs = 256
    profile = max(pre.get(Component.ACTIVATIONS), sampler)
    requested = int(gpu_memory_bytes * utilization)
    non_torch = overhead_for(0, gpu, inference=True).outside_allocator_bytes
    budget = requested - w - profile - non_torch
    per_token = kv_bytes_per_token(spec, setup)
    block = setup.block_size * per_token
    blocks = max(0, budget // block) if block else 0
    tokens = blocks * setup.block_size
    per_seq = -(-setup.context // setup.block_size) * setup.block_size
    return PagedCapacity(
        gpu_memory_utilization=utilization,
        requested_bytes=requested,
        weights_bytes=w,
        profile_peak_bytes=profile,
        non_torch_bytes=non_torch,
        kv_budget_bytes=budget,
        block_size=setup.block_size,
        block_bytes=block,
        kv_blocks=blocks,
        max_concurrent_tokens=tokens,
        max_concurrent_sequences=tokens // per_seq,
    )


def rule_of_thumb_bytes(params: int, setup: InferenceSetup) -> int:
    """The article's serving rule: parameters × bytes per parameter × 1.2 (per GPU: divided by ``tp``)."""
    return int(params * setup.dtype.bits / 8 * RULE_OF_THUMB_FACTOR / setup.tp)


def flash_for(gpu: GPUSpec | None) -> bool:
    return True if gpu is None else has_flash_attention(gpu.compute_capability)


def explain_terms(
    spec: ModelSpec, setup: InferenceSetup, phases: Mapping[InferencePhase, PhaseEstimate]
) -> tuple[Term, ...]:
    """The terms of the answer, each with its formula and source."""
    w = weight_bytes(spec, setup)
    kvh = kv_heads_per_gpu(spec, setup.tp)
    kv_formula = (
        f"layers · batch · T · (kv_lora_rank + qk_rope_head_dim) · {setup.kv_format.bits // 8} B, "
        f"T = {setup.context - 1}"
        if spec.mla is not None
        else f"2 · layers · {kvh} kv heads · {spec.head_dim} · T · batch · {setup.kv_format.bits // 8} B, "
        f"T = {setup.context - 1} (the last generated token is never fed back)"
    )
    if hf_fp8(setup):
        kv_formula += "; fp8 (float8_e4m3fn) with a 0-dim fp32 scale per tensor"
    out = [
        Term(
            name="weights",
            bytes=w,
            formula=f"every tensor in {setup.dtype.value}"
            + (
                " (linears but the head quantised"
                + (", fused MoE experts too (FP8Experts)" if setup.dtype is WeightFormat.FP8 and spec.moe else "")
                + "; embeddings, head, norms bf16)"
                if setup.dtype.bits < 16
                else ""
            )
            + (f", split {setup.tp} ways" if setup.tp > 1 else ""),
            source="trainfit.arch.params inventory; bitsandbytes layouts in trainfit.cuda_facts; transformers "
            "replace_with_bnb_linear / replace_with_fp8_linear",
        ),
        Term(
            name="kv cache (full length)",
            bytes=kv_cache_bytes(spec, setup),
            formula=kv_formula,
            source="Pope et al. 2022 §2; transformers cache_utils DynamicLayer/StaticLayer"
            + ("/Fp8QuantizedLayer (QuantizedCache backend fp8)" if hf_fp8(setup) else ""),
        ),
    ]
    for ph, est in phases.items():
        out.append(
            Term(
                name=f"{ph.value} transients",
                bytes=est.breakdown.get(Component.ACTIVATIONS) + est.breakdown.get(Component.LOGITS_LOSS),
                formula=f"worst moment: {est.moment}",
                source="transformers generate/_sample (logits_to_keep=1), modeling_llama; checked by the trace",
            )
        )
    return tuple(out)


__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_GPU_MEMORY_UTILIZATION",
    "DEFAULT_INFER_HEADROOM",
    "CacheKind",
    "Capacity",
    "InferenceSetup",
    "KVFormat",
    "PagedCapacity",
    "PhaseEstimate",
    "WeightFormat",
    "capacity",
    "explain_terms",
    "flash_for",
    "fp8_dequantise_bytes",
    "fp8_quantise_moments",
    "generate_events",
    "hf_fp8",
    "kv_bytes_per_token",
    "kv_cache_bytes",
    "paged_capacity",
    "peak_bytes",
    "phase_estimates",
    "required_bytes",
    "rule_of_thumb_bytes",
    "simulate_generate",
    "validate",
    "weight_allocations",
    "weight_bytes",
]

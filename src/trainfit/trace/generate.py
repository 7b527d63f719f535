"""``trainfit infer --method trace``: Hugging Face ``generate`` on fake tensors, every live byte counted.

We build the model from its ``config.json`` on the meta device (:func:`trainfit.trace.hf.build_meta`), make
its parameters fake CPU tensors, and call the real ``model.generate`` — greedy, a fixed number of new tokens,
the model's own cache classes (``DynamicCache`` with its ``DynamicLayer`` / ``DynamicSlidingWindowLayer``,
``StaticCache``) — under the storage tracker (:mod:`trainfit.trace.tracker`) and the CUDA kernel emulation
(:mod:`trainfit.trace.kernels`). Three things make ``generate`` run on fake tensors (DESIGN §4.4):

* data-dependent scalars (``_local_scalar_dense``) are answered: every boolean question ``generate`` asks
  (special-token checks, right padding, "are all sequences finished?") gets ``False`` until the model has
  run ``new_tokens`` forward passes, then the stop check gets ``True``; but "is the attention mask all ones?"
  (an ``all`` before the first pass) gets ``True``, so ``generate`` drops the mask as it does for an
  unpadded batch on a GPU (transformers 5.24: ``model_kwargs["attention_mask"] = None``; no per-step
  ``cat`` of it, and the models build batch-broadcast masks);
* the forward wrapper that marks the cache uses ``functools.wraps``, because ``generate`` inspects
  ``forward``'s signature to pass ``logits_to_keep=1`` (only the last position's logits);
* the batch is unpadded (an all-ones attention mask), and transformers' mask code is told so: under fake
  tensors ``masking_utils.is_tracing`` is true and the mask would never be skipped (a [b, 1, q, kv] mask,
  k/v repeated per query head), while a real GPU run skips it (``_ignore_causal_mask_sdpa``). A left-padded
  batch (``InferenceSetup.padded``) gets the other answers: "all ones?" no and ``fast_all`` false, so
  ``generate`` keeps and ``cat``-grows the 2-D mask and ``sdpa_mask`` builds the 4-D one every pass, as on a
  GPU (the values of the fake mask do not matter, only these answers).

``--kv-dtype fp8`` runs transformers' own fp8 cache: ``cache_implementation="quantized"`` with
``cache_config={"backend": "fp8"}`` builds ``QuantizedCache`` of ``Fp8QuantizedLayer``s (``cache_utils``,
transformers 5.24) — float8_e4m3fn K/V with a per-tensor fp32 scale frozen at the first update, new tokens
quantised and ``cat``-appended, and every later ``update`` returns the dequantised whole cache
(``(q.float() * scale).to(dtype)``) for attention. That is the non-fused path: real compute-dtype copies of
the running layer's cache at every attention call, which a server's fused kernels (vLLM ``kv_cache_dtype=
"fp8"``, dequantised inside attention) do not make. transformers has no static fp8 cache and its
``QuantizedCache`` refuses sliding-window layers, so the trace refuses those (one line), as it refuses a
cache dtype other than the compute dtype or fp8.

Phases: **prefill** is the first forward pass and the logits work after it, until the second pass starts;
**decode** is every later pass. Storages are classified by fate: parameters and buffers are weights;
whatever the cache object references after a pass is KV cache (the old storage ``torch.cat`` replaces stays
KV cache until it dies, so a decode peak shows the cache plus one layer's copy); storages born after the last
layer of a pass (final norm, head, the fp32 copy of the last-token logits) are logits; the rest are
activations (hidden states, MLP intermediates, masks, rotary tables, token ids).

Quantised weights: ``--dtype int8|nf4|fp4`` builds bitsandbytes layers as transformers'
``replace_with_bnb_linear`` does and gives bitsandbytes' custom ops their CUDA kernels' memory
(:mod:`trainfit.trace.bnb`, shared with the training trace); ``--dtype fp8`` builds transformers' ``FP8Linear``
layers (and ``FP8Experts`` on MoE models) with stand-ins for the fp8 matmul kernels (:mod:`trainfit.trace.fp8`).

Tensor parallelism (``--tp``): rank 0 of the group on PyTorch's fake process group and a 1-D CPU mesh, with
transformers' own plan — the model's ``base_model_tp_plan`` resolved and applied as ``from_pretrained``
does it for ``DistributedConfig(tp_size=tp)`` (:func:`_tensor_parallel`); each DTensor's local shard is a fake
tensor and the tracker counts local shards (:class:`trainfit.trace.tensor_parallel.TPTracker`). The report's
notes name where transformers' plan keeps more on a rank than a head-splitting server (unsharded attention,
gathered fused outputs, layer linears without a rule). ``--dtype fp8`` runs too: the fp8 linears are built
first and the quantizer's plan update applied (``trainfit.trace.fp8.update_tp_plan``), as ``from_pretrained``
runs ``preprocess_model`` before ``maybe_distribute_model``; each ``FP8Linear`` (``_hf_quantized_needs_local_tp``)
then runs on its local fp8 shard and local block scales. bitsandbytes weights are refused (:func:`_check_tp`).

Depth: as for training (:mod:`trainfit.trace.depth`), a repeated run of layers is traced at 2 and 3 units
and each *place* (before the stack, the run's first and last unit, after the stack) is extrapolated
linearly per component, then each phase takes its largest place. Two units, not one, are the base here:
with one layer the layer's input *is* the embedding output, with two or more they are different tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.utils._python_dispatch import TorchDispatchMode

from trainfit.allocator import Event, Op
from trainfit.arch.spec import ModelSpec
from trainfit.cuda_facts import SdpaKernel
from trainfit.errors import TraceError, TraceUnsupportedError
from trainfit.result import Component, InferencePhase
from trainfit.strategy import Checkpointing, Strategy
from trainfit.strategy.inference import CacheKind, InferenceSetup, KVFormat, WeightFormat
from trainfit.trace import hf
from trainfit.trace import runner as rn
from trainfit.trace import tracker as tk
from trainfit.trace._deps import require_transformers
from trainfit.trace.kernels import CudaKernels

#: Units of each repeated run in the base trace (the variant traces add one).
BASE_UNITS = 2

#: A request of more new tokens is traced as two short ``generate`` runs: the prompt with this many new tokens
#: (prefill and the first decode steps, where a sliding cache shrinks from the prompt to its window), and a
#: prompt of ``prompt + new − SPLIT_TOKENS`` tokens with this many, of which only the last pass is read — its
#: state (cache storages, token ids, mask, previous logits) is the original last step's exactly, for
#: dynamic, sliding and static caches. Decode memory between the two only grows to the last step or stays.
SPLIT_TOKENS = 3
LATE = "@late"

_KV = 100  # tracker kind for KV-cache storages (beyond the training kinds)

_DTYPES = {WeightFormat.FP32: torch.float32, WeightFormat.BF16: torch.bfloat16, WeightFormat.FP16: torch.float16}
_COMPUTE = {KVFormat.FP32: torch.float32, KVFormat.BF16: torch.bfloat16, KVFormat.FP16: torch.float16}


def _build_dtype(setup: InferenceSetup) -> torch.dtype:
    """The dtype the model is built in: the weights' own 16/32-bit format; for bitsandbytes weights the
    compute dtype (bf16), which the embeddings, head and norms keep (transformers loads the rest with
    ``dtype=torch.bfloat16`` and quantises the layer linears)."""
    if setup.dtype.bnb or setup.dtype is WeightFormat.FP8:
        return _COMPUTE[setup.dtype.compute]
    return _DTYPES[setup.dtype]


@contextlib.contextmanager
def _quantised(model: torch.nn.Module, mode: Any, setup: InferenceSetup) -> Iterator[None]:
    """bitsandbytes weights on the materialised ``model`` (trace/bnb.py) and their CUDA kernels' memory; the
    fp8 matmul stand-in for ``--dtype fp8`` (trace/fp8.py)."""
    if setup.dtype is WeightFormat.FP8:
        from trainfit.trace.fp8 import fp8_matmul_kernels

        with fp8_matmul_kernels():
            yield
        return
    if not setup.dtype.bnb:
        yield
        return
    import logging

    from trainfit.trace import bnb

    log = logging.getLogger("bitsandbytes.autograd._functions")  # MatMul8bitLt warns of its fp16 cast per call
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        if setup.dtype is WeightFormat.INT8:
            with bnb.int8_weights(model, mode):
                yield
        else:
            compute = _COMPUTE[setup.four_bit_compute]
            with bnb.four_bit_weights(
                model, mode, quant_type=setup.dtype.value, double_quant=setup.double_quant, compute=compute
            ):
                yield
    finally:
        log.setLevel(level)


def _to_bnb_layers(model: torch.nn.Module, setup: InferenceSetup) -> None:
    """On the meta model: transformers' ``replace_with_bnb_linear`` for ``--dtype int8|nf4|fp4`` (outlier
    threshold ``llm_int8_threshold=6.0``; ``bnb_4bit_compute_dtype`` = the compute dtype, bf16), its
    ``replace_with_fp8_linear`` for ``--dtype fp8`` (trainfit.trace.fp8)."""
    if setup.dtype is WeightFormat.FP8:
        from trainfit.trace.fp8 import to_fp8_layers

        to_fp8_layers(model, _COMPUTE[setup.dtype.compute])
        return
    if not setup.dtype.bnb:
        return
    from trainfit.cuda_facts import BNB_INT8_THRESHOLD
    from trainfit.trace import bnb

    if setup.dtype is WeightFormat.INT8:
        bnb.to_linear8bit(model, threshold=BNB_INT8_THRESHOLD)
    else:
        bnb.to_linear4bit(
            model,
            quant_type=setup.dtype.value,
            double_quant=setup.double_quant,
            compute=_COMPUTE[setup.four_bit_compute],
        )


Place = tuple[str, int, str]  # ("before" | "unit" | "after", run, "first" | "last")


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateTrace:
    """The trace's answer: each phase's worst moment by component, and what was traced."""

    phases: Mapping[InferencePhase, Mapping[Component, int]]
    kv_cache_bytes: int  # the cache after the last pass (full length)
    weights_bytes: int
    layers_traced: tuple[int, ...]
    extrapolated: bool
    sdpa_backends: Mapping[SdpaKernel, int]
    seconds: float
    notes: tuple[str, ...] = ()


class _Answers(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Answer ``generate``'s data-dependent scalar questions (see the module docstring). Before the first pass
    an ``all`` is ``generate``'s "is the attention mask all ones?" (transformers 5.24 ``generate``:
    ``(model_kwargs["attention_mask"] == 1).all()``), which an unpadded batch answers yes: ``generate`` then
    drops the mask (``attention_mask = None``) and makes no longer copy of it after each pass."""

    def __init__(self, passes: list[int], new_tokens: int, *, padded: bool = False) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.passes, self.new_tokens, self.padded = passes, new_tokens, padded
        self.all_ones: list[weakref.ref[torch.Tensor]] = []  # weak: the answer must not keep them alive

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default:
            if args[0].dtype == torch.bool:
                if not self.passes and any(args[0] is r() for r in self.all_ones):
                    return not self.padded
                return len(self.passes) >= self.new_tokens
            raise TraceUnsupportedError(
                "generate asked for a numeric value of a tensor; cannot answer it on fake tensors"
            )
        out = func(*args, **(kwargs or {}))
        if not self.passes and func in (torch.ops.aten.all.default, torch.ops.aten.all.dim):
            self.all_ones.append(weakref.ref(out))
        return out


@contextlib.contextmanager
def _mask_patches(padded: bool = False) -> Iterator[None]:
    """The batch as a real run sees it: mask skipping allowed; the padding mask all ones (unpadded) or, for a
    left-padded batch, not (``fast_all`` false: ``sdpa_mask`` then builds the 4-D mask)."""
    mu = require_transformers().masking_utils
    saved = {n: getattr(mu, n) for n in ("is_tracing", "fast_all", "find_packed_sequence_indices")}
    mu.is_tracing = lambda *_a, **_k: False
    mu.fast_all = lambda _t: not padded
    mu.find_packed_sequence_indices = lambda position_ids: None
    try:
        with hf.quiet_transformers():
            yield
    finally:
        for n, f in saved.items():
            setattr(mu, n, f)


def cache_tensors(cache: Any) -> list[torch.Tensor]:
    """What a cache object holds: each layer's ``keys``/``values``, and for transformers' quantised layers
    (``BaseQuantizedLayer``: ``Fp8QuantizedLayer``) the ``(fp8 tensor, scale)`` pairs ``_quantized_keys`` /
    ``_quantized_values`` (their ``keys``/``values`` are empty tensors that only carry the dtype)."""
    out: list[torch.Tensor] = []
    for layer in getattr(cache, "layers", ()):
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            t = getattr(layer, name, None)
            for x in t if isinstance(t, tuple) else (t,):
                if isinstance(x, torch.Tensor):
                    out.append(x)
    return out


@dataclass(slots=True)
class _PassMarks:
    start: int
    unit_starts: list[int]
    stack_end: int = -1
    end: int = -1


def _cache_implementation(setup: InferenceSetup) -> str | None:
    if setup.kv_format is KVFormat.FP8:
        return "quantized"  # QuantizedCache(backend="fp8"): Fp8QuantizedLayer on every layer
    if setup.cache is CacheKind.STATIC:
        return "static"
    if setup.cache in (CacheKind.DYNAMIC, CacheKind.SLIDING):
        return None  # DynamicCache: sliding layers get DynamicSlidingWindowLayer from the config
    raise TraceError("--method trace runs Hugging Face generate: --cache dynamic, static or sliding")


def _check_kv_dtype(spec: ModelSpec, setup: InferenceSetup) -> None:
    """The caches ``generate`` can build: the compute dtype (every cache kind), or fp8 through transformers'
    ``QuantizedCache(backend="fp8")`` (``cache_utils.Fp8QuantizedLayer``), which is dynamic and refuses
    sliding-window layers."""
    if setup.kv_format is setup.dtype.compute:
        return
    if setup.kv_format is not KVFormat.FP8:
        raise TraceError(
            f"--method trace: Hugging Face generate keeps the cache in the compute dtype or fp8 "
            f"(QuantizedCache), not {setup.kv_format.value}; drop --kv-dtype or use --kv-dtype fp8"
        )
    if setup.cache is not CacheKind.DYNAMIC:
        raise TraceError(
            "--method trace: transformers' fp8 cache (QuantizedCache, backend fp8) is dynamic only; "
            "use --cache dynamic with --kv-dtype fp8"
        )
    if spec.sliding_layers and spec.sliding_window:
        raise TraceError(
            f"--method trace: transformers' fp8 cache (QuantizedCache) refuses sliding-window layers, "
            f"which {spec.name} has; drop --kv-dtype fp8"
        )


def _tensor_parallel(model: torch.nn.Module, mesh: Any, mode: Any, setup: InferenceSetup) -> None:
    """Rank 0 of transformers' own tensor parallelism on the meta ``model``, then its tensors made fake.

    What ``from_pretrained(distributed_config=DistributedConfig(tp_size=tp))`` does before it loads weights
    (transformers 5.24 ``distributed/mixin.py`` ``maybe_distribute_model``): ``_resolve_parallel_plans``
    expands the model's plan (the config's ``base_model_tp_plan`` — ``colwise`` q/k/v/gate/up, ``rowwise``
    o/down — plus ``embedding_rowwise`` on ``embed_tokens`` and the class's ``colwise_gather_output`` head),
    and ``apply_tensor_parallelism`` (``distributed/tensor_parallel.py``) turns each planned weight into a
    ``DTensor`` placeholder (``distribute_tensor(meta, mesh, [Shard], src_data_rank=None)``) and installs the
    styles' forward wrappers; ``_tp_size`` is what ``generate`` reads to size a static cache per rank
    (``_get_static_cache_init_shape``). Loading then fills each rank's local shard: here each DTensor's local
    tensor becomes a fresh fake tensor of the shard's shape (the rank holds only its shard), every other
    tensor a fake copy of its meta shape (:func:`trainfit.trace.runner.materialize`)."""
    import importlib

    from torch.distributed.tensor import DTensor

    config: Any = importlib.import_module("transformers.distributed.configuration_utils")
    tensor_parallel: Any = importlib.import_module("transformers.distributed.tensor_parallel")
    # transformers builds the model untied (``init.no_tie_weights()``), distributes it, and ties the weights
    # when loading ends (modeling_utils.py ``from_pretrained`` → ``_finalize_model_loading``): a tied head is
    # sharded as its own parameter, then made the embedding's (both ``Shard(0)`` on the vocabulary).
    owners: dict[int, tuple[torch.nn.Module, str]] = {}
    tied: list[tuple[torch.nn.Module, str, torch.nn.Module, str]] = []
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) in owners:
                tied.append((mod, name, *owners[id(p)]))
                mod._parameters[name] = torch.nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
            else:
                owners[id(p)] = (mod, name)
    if setup.dtype is WeightFormat.FP8:
        from trainfit.trace.fp8 import update_tp_plan

        update_tp_plan(model)  # the quantizer's preprocess_model, before maybe_distribute_model
    resolve: Any = model._resolve_parallel_plans
    try:
        plan, _, _ = resolve(config.DistributedConfig(tp_size=mesh.size()))
    except ValueError as exc:  # no base_model_tp_plan for this architecture
        raise TraceUnsupportedError(f"transformers' tensor parallelism: {str(exc).splitlines()[0][:200]}") from None
    tensor_parallel.apply_tensor_parallelism(model, mesh, plan)
    model._tp_size = mesh.size()
    memo: dict[int, torch.nn.Parameter] = {}
    with mode:
        for mod in model.modules():
            for name, p in list(mod._parameters.items()):
                if not isinstance(p, DTensor):
                    continue
                if id(p) not in memo:
                    local = torch.zeros(p._local_tensor.shape, dtype=p.dtype)
                    d = DTensor.from_local(
                        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                    )
                    memo[id(p)] = torch.nn.Parameter(d, requires_grad=p.requires_grad)
                mod._parameters[name] = memo[id(p)]
    rest = [(m, n, p) for m in model.modules() for n, p in m._parameters.items() if isinstance(p, DTensor)]
    for m, n, _ in rest:  # keep the DTensors out of materialize, which copies every parameter's global shape
        m._parameters[n] = None
    rn.materialize(model, mode, None)
    for m, n, p in rest:
        m._parameters[n] = p
    for mod, name, owner, owner_name in tied:
        mod._parameters[name] = owner._parameters[owner_name]


def _run_layout(
    model: torch.nn.Module,
    stack: torch.nn.ModuleList,
    unit_first_layer: Sequence[int],
    setup: InferenceSetup,
    flash: bool,
    cache_len: int | None = None,
    mesh: Any = None,
) -> tuple[tk.Tracker, list[_PassMarks], dict[SdpaKernel, int]]:
    mode = rn.fake_mode()
    _to_bnb_layers(model, setup)
    if mesh is not None:
        _tensor_parallel(model, mesh, mode, setup)
    else:
        rn.materialize(model, mode, None)
    held = contextlib.ExitStack()  # the quantised weights' state, for the run
    held.enter_context(_quantised(model, mode, setup))
    model.eval()
    conf: Any = model.config
    conf.use_cache = True
    gc: Any = model.generation_config
    gc.eos_token_id, gc.pad_token_id, gc.bos_token_id = None, 0, None
    tr: tk.Tracker = tk.Tracker()
    if mesh is not None:
        from trainfit.trace.tensor_parallel import TPTracker

        tr = TPTracker()
    tr.mark(list(model.parameters()) + list(model.buffers()), tk.WEIGHTS)
    passes: list[_PassMarks] = []
    answers = _Answers([], setup.new_tokens, padded=setup.padded)
    firsts = set(unit_first_layer)
    handles = []
    for i, layer in enumerate(stack):
        if i in firsts:

            def pre(_m: torch.nn.Module, _a: Any) -> None:
                passes[-1].unit_starts.append(tr.t)

            handles.append(layer.register_forward_pre_hook(pre))
    last = stack[len(stack) - 1]

    def post(_m: torch.nn.Module, _a: Any, _o: Any) -> None:
        passes[-1].stack_end = tr.t

    handles.append(last.register_forward_hook(post))
    forward = model.forward

    @functools.wraps(forward)
    def traced_forward(*args: Any, **kwargs: Any) -> Any:
        passes.append(_PassMarks(start=tr.t, unit_starts=[]))
        out = forward(*args, **kwargs)
        tr.mark(cache_tensors(getattr(out, "past_key_values", None) or kwargs.get("past_key_values")), _KV)
        passes[-1].end = tr.t
        answers.passes.append(tr.t)
        return out

    model.forward = traced_forward
    kernels = CudaKernels(flash=flash)
    bnb_kernels: Any = contextlib.nullcontext()
    if setup.dtype.bnb:
        from trainfit.trace.bnb import CudaBnbKernels

        bnb_kernels = CudaBnbKernels(compute_capability=setup.compute_capability, sm_count=setup.sm_count)
    b, s = setup.batch, setup.prompt
    try:
        with mode, _mask_patches(setup.padded), kernels, tr, answers, bnb_kernels, torch.no_grad():
            ids = torch.zeros((b, s), dtype=torch.long)
            mask = torch.ones((b, s), dtype=torch.long)
            tr.mark([ids, mask], tk.NONE)
            gen: Any = model.generate
            extra: dict[str, Any] = {}
            if setup.cache is CacheKind.STATIC:  # the request's whole context, also in a split run
                extra["max_cache_len"] = cache_len or setup.context
            if setup.kv_format is KVFormat.FP8:
                extra["cache_config"] = {"backend": "fp8"}
            out = gen(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=setup.new_tokens,
                do_sample=False,
                cache_implementation=_cache_implementation(setup),
                **extra,
            )
            del out
    except DataDependentOutputException as exc:
        raise TraceUnsupportedError(f"generate needs a tensor value fake tensors cannot give: {exc}") from None
    finally:
        for h in handles:
            h.remove()
        held.close()
    tr.t += 1  # the end of generate: everything it returned is dropped
    return tr, passes, dict(kernels.sdpa_calls)


def _places(
    tr: tk.Tracker,
    passes: list[_PassMarks],
    unit_run: Sequence[int],
    counts: Sequence[int],
    *,
    tag: str = "",
    skip: int = 0,
    request_bytes: int | None = None,
) -> dict[tuple[InferencePhase, Place], dict[Component, int]]:
    """Worst moment of each place of each phase, by component; passes before ``skip`` are left out, place
    names get ``tag`` (the late-decode run's places are extrapolated apart from the first run's).
    ``request_bytes``: count the request's own tensors — those made before the first pass (token ids,
    attention mask, ``generate``'s position bookkeeping) — as this many bytes instead (a late run's prompt
    is longer than the request's)."""
    after: list[tuple[int, int]] = []
    ivs: list[tk.Interval[tuple[InferencePhase, Place]]] = []
    for c, pm in enumerate(passes):
        phase = InferencePhase.PREFILL if c == 0 else InferencePhase.DECODE
        nxt = passes[c + 1].start if c + 1 < len(passes) else tr.t
        after.append((pm.stack_end, nxt))
        if c < skip:
            continue
        starts = pm.unit_starts
        ivs.append(tk.Interval(label=(phase, ("before" + tag, -1, "")), start=pm.start if c else 0, end=starts[0]))
        seen: dict[int, int] = {}
        for u, us in enumerate(starts):
            r = unit_run[u]
            j = seen.get(r, 0)
            seen[r] = j + 1
            end = starts[u + 1] if u + 1 < len(starts) else pm.stack_end
            if j == 0:
                ivs.append(tk.Interval(label=(phase, ("unit" + tag, r, "first")), start=us, end=end))
            if j == counts[r] - 1:
                ivs.append(tk.Interval(label=(phase, ("unit" + tag, r, "last")), start=us, end=end))
        ivs.append(tk.Interval(label=(phase, ("after" + tag, -1, "")), start=pm.stack_end, end=nxt))

    first = passes[0].start

    def component(rec: tk.Record) -> Component | None:
        if rec.kind == _KV:
            return Component.KV_CACHE
        if rec.kind == tk.WEIGHTS:
            return Component.WEIGHTS
        if request_bytes is not None and rec.alloc_t < first:
            return None
        if any(lo < rec.alloc_t <= hi for lo, hi in after):
            return Component.LOGITS_LOSS
        return Component.ACTIVATIONS

    tr.component = component  # type: ignore[method-assign]
    out: dict[tuple[InferencePhase, Place], dict[Component, int]] = {}
    for pk in tr.peaks(ivs):
        comps = {k: v for k, v in pk.components.items() if v}
        if request_bytes:
            comps[Component.ACTIVATIONS] = comps.get(Component.ACTIVATIONS, 0) + request_bytes
        if pk.label not in out or sum(comps.values()) > sum(out[pk.label].values()):
            out[pk.label] = comps
    return out


def trace_generate(
    spec: ModelSpec,
    setup: InferenceSetup,
    *,
    flash: bool = True,
    extrapolate: bool = True,
    split: bool = True,
    progress: Callable[[str, float], None] | None = None,
) -> GenerateTrace:
    """Trace ``generate`` for ``spec`` under ``setup`` (one GPU or rank 0 of ``setup.tp``; 16/32-bit or
    fine-grained fp8 weights, and bitsandbytes int8/nf4/fp4 on one GPU; a cache in the compute dtype or
    transformers' dynamic fp8 cache)."""
    t0 = time.perf_counter()
    say = progress or (lambda _m, _f: None)
    _check_tp(spec, setup)
    dtype = _build_dtype(setup)
    _check_kv_dtype(spec, setup)
    say("building the model on the meta device", 0.0)
    strategy = Strategy(attention=setup.attention, checkpointing=Checkpointing.NONE)
    meta, notes = hf.build_meta(spec, strategy, dtype)
    meta_config: Any = meta.config
    conf = meta_config.get_text_config() if hasattr(meta_config, "get_text_config") else meta_config
    full = int(conf.num_hidden_layers)
    if setup.tp > 1:
        notes = [*notes, *_tp_notes(meta, setup.tp)]
    stack_path, stack = hf.find_stack(meta, full)
    sig_ids: dict[Any, int] = {}
    sigs = [sig_ids.setdefault(hf.layer_signature(layer), len(sig_ids)) for layer in stack]
    blocks = hf.blocks_for(full, Checkpointing.NONE)
    runs = hf.find_runs([(b.checkpointed, tuple(sigs[i] for i in b.layers)) for b in blocks])
    ext = [r for r, run in enumerate(runs) if run.count >= BASE_UNITS + 2] if extrapolate else []
    base = [BASE_UNITS if r in ext else run.count for r, run in enumerate(runs)]
    configs = [base] + [[c + (1 if r == e else 0) for r, c in enumerate(base)] for e in ext]
    keyed: list[dict[tuple[InferencePhase, Place], dict[Component, int]]] = []
    traced: list[int] = []
    sdpa: dict[SdpaKernel, int] = {}
    with _fake_tp_mesh(setup.tp) if setup.tp > 1 else contextlib.nullcontext() as mesh:
        for i, counts in enumerate(configs):
            layout = hf.layout_for(blocks, runs, counts)
            layers = layout.layers
            say(f"trace {i + 1}/{len(configs)}: generate with {len(layers)} layers", i / len(configs))
            starts, acc = [], 0
            for blk in layout.blocks:
                starts.append(acc)
                acc += len(blk.layers)
            unit_first = [starts[fb] for fb, _ in layout.unit_blocks]
            places: dict[tuple[InferencePhase, Place], dict[Component, int]] = {}
            request: int | None = None
            for run_setup, tag, skip in _runs(setup, split):
                model = hf.reduced_model(meta, stack_path, layers, full)
                _, sub = hf.find_stack(model, len(layers))
                tr, passes, calls = _run_layout(model, sub, unit_first, run_setup, flash, setup.context, mesh)
                if not sdpa:
                    sdpa = calls
                places.update(_places(tr, passes, layout.unit_run, counts, tag=tag, skip=skip, request_bytes=request))
                request = _request_bytes(tr, passes)
            keyed.append(places)
            traced.append(len(layers))
    say("extrapolating", 1.0)
    full_places: dict[tuple[InferencePhase, Place], dict[Component, int]] = {}
    for key, comps in keyed[0].items():
        out = dict(comps)
        for n, r in enumerate(ext, start=1):
            other = keyed[n].get(key, comps)
            scale = runs[r].count - BASE_UNITS
            for c in set(out) | set(other):
                out[c] = out.get(c, 0) + (other.get(c, 0) - comps.get(c, 0)) * scale
        full_places[key] = {c: max(0, v) for c, v in out.items()}
    phases: dict[InferencePhase, dict[Component, int]] = {}
    for ph in InferencePhase:
        cands = [v for (p, _), v in full_places.items() if p is ph]
        if cands:
            phases[ph] = max(cands, key=lambda v: sum(v.values()))
    # Steady-state cache and weights at full depth: from the "after" place of the last pass.
    end = full_places[_last_after(full_places)]
    note = (
        f"traced {', '.join(map(str, traced))} of {full} layers, extrapolated linearly per place"
        if ext
        else f"traced the full depth ({full} layers)"
    )
    return GenerateTrace(
        phases=phases,
        kv_cache_bytes=_final_kv(keyed, ext, runs, configs),
        weights_bytes=end.get(Component.WEIGHTS, 0),
        layers_traced=tuple(traced),
        extrapolated=bool(ext),
        sdpa_backends=sdpa,
        seconds=round(time.perf_counter() - t0, 2),
        notes=(*notes, note),
    )


def _check_tp(spec: ModelSpec, setup: InferenceSetup) -> None:
    """What the tensor-parallel trace runs: transformers' own plan (the model config's ``base_model_tp_plan``)
    on 16/32-bit or fine-grained fp8 weights. transformers shards k/v ``colwise`` and, unlike vLLM, never
    replicates a k/v head: with fewer k/v heads than ranks (or a count ``tp`` does not divide) ``generate``
    finds no even split (``get_kv_heads_per_rank`` returns None) and a rank's k_proj output is not whole heads.

    bitsandbytes weights are refused: transformers 5.24 shards them without complaint but loses their
    quantisation state — ``set_param_for_module`` wraps the loaded ``Params4bit``/``Int8Params`` into a plain
    ``DTensor`` (``_dtensor_from_local_like``), and the first forward fails ("quant_state is required",
    "'Tensor' object has no attribute 'CB'"; a real two-process ``torchrun`` of a tiny Llama with
    ``DistributedConfig(tp_size=2)``). nf4 with ``--tp`` is vLLM's (``analytic.inference.vllm_bnb``)."""
    if setup.tp == 1:
        return
    if setup.dtype.bnb:
        raise TraceError(
            f"--method trace runs transformers' tensor parallelism, which loses bitsandbytes' quantisation state "
            f"(the first forward fails): no trace of --dtype {setup.dtype.value} with --tp; "
            "--method analytic models nf4 with --tp as vLLM runs it"
        )
    if spec.mla is None and spec.num_kv_heads % setup.tp:
        raise TraceError(
            f"--method trace: transformers' tensor-parallel plan splits k/v heads evenly, and {spec.name}'s "
            f"{spec.num_kv_heads} do not split {setup.tp} ways (vLLM replicates them; --method analytic models that)"
        )


def _tp_notes(model: torch.nn.Module, tp: int) -> tuple[str, ...]:
    """What the report says about transformers' plan: rank 0 of ``tp``, and whether the plan splits attention
    (DeepSeek-V3's ``base_model_tp_plan`` names only the MLP and experts: MLA runs replicated on every rank)."""
    plan: Any = getattr(model, "tp_plan", None) or {}
    out = [
        f"rank 0 of TP {tp} on PyTorch's fake process group: transformers' own plan "
        "(base_model_tp_plan: colwise/rowwise linears, vocabulary-parallel embedding, gathered lm_head)"
    ]
    config: Any = model.config
    kind = config.model_type
    if not any(".self_attn." in key for key in plan):
        out.append(
            f"transformers' plan for {kind} leaves attention unsharded: every rank holds and runs all heads "
            "(the analytic method splits them, as vLLM does)"
        )
    gathered = sorted(
        {k.rsplit(".", 1)[-1] for k, v in plan.items() if ".layers." in k and v == "colwise_gather_output"}
    )
    if gathered:
        out.append(
            f"transformers' plan for {kind} gathers the output of {', '.join(gathered)} on every rank "
            "(colwise_gather_output): activations and the cache are not split (the analytic method splits them)"
        )

    def wild(name: str) -> str:
        return re.sub(r"\.\d+\.", ".*.", name)

    def fused_experts(name: str, module: torch.nn.Module) -> bool:
        # transformers 5's fused experts (``mlp.experts``: 3-D gate_up_proj/down_proj parameters, no Linear), which
        # transformers 5.25 shards only under its expert-parallel plan (``ep_size``), not its TP plan
        return name.endswith(".experts") and any(p.dim() == 3 for p in module.parameters(recurse=False))

    unplanned = sorted(
        {
            wild(n).rsplit(".*.", 1)[-1]
            for n, m in model.named_modules()
            if ".layers." in n
            and wild(n) not in plan
            and (
                (isinstance(m, torch.nn.Linear) and m.out_features > 1)
                or (fused_experts(n, m) and not any(k.startswith(wild(n) + ".") for k in plan))
            )
        }
    )
    if unplanned:
        out.append(
            f"transformers' plan for {kind} has no rule for {', '.join(unplanned)}: replicated on every rank "
            "(the analytic method splits them)"
        )
    return tuple(out)


@contextlib.contextmanager
def _fake_tp_mesh(tp: int) -> Iterator[Any]:
    """Rank 0 of a ``tp``-rank group on PyTorch's fake process group, its 1-D CPU mesh (DESIGN §4.3)."""
    from trainfit.trace.tensor_parallel import fake_mesh

    with fake_mesh(1, tp) as mesh:
        yield mesh["tp"]


def _request_bytes(tr: tk.Tracker, passes: Sequence[_PassMarks]) -> int:
    """Bytes of the request's own tensors (made before the first pass) still alive at the last pass."""
    first, last = passes[0].start, passes[-1].start
    return sum(
        r.nbytes
        for r in tr.records
        if r.kind not in (tk.WEIGHTS, _KV) and r.alloc_t < first and (r.free_t is None or r.free_t > last)
    )


def _last_after(places: Mapping[tuple[InferencePhase, Place], Any]) -> tuple[InferencePhase, Place]:
    """The key of the place after the last pass's stack: the late run's, else the only run's decode, else
    the prefill's."""
    for key in (
        (InferencePhase.DECODE, ("after" + LATE, -1, "")),
        (InferencePhase.DECODE, ("after", -1, "")),
        (InferencePhase.PREFILL, ("after", -1, "")),
    ):
        if key in places:
            return key
    raise AssertionError("no pass was traced")  # pragma: no cover


def _runs(setup: InferenceSetup, split: bool) -> list[tuple[InferenceSetup, str, int]]:
    """The generate runs that cover a request: (setup, place tag, passes to skip). See :data:`SPLIT_TOKENS`."""
    n = setup.new_tokens
    if not split or n <= SPLIT_TOKENS:
        return [(setup, "", 0)]
    early = dataclasses.replace(setup, new_tokens=SPLIT_TOKENS)
    late = dataclasses.replace(setup, prompt=setup.prompt + n - SPLIT_TOKENS, new_tokens=SPLIT_TOKENS)
    return [(early, "", 0), (late, LATE, SPLIT_TOKENS - 1)]


def _final_kv(
    keyed: list[dict[tuple[InferencePhase, Place], dict[Component, int]]],
    ext: list[int],
    runs: Sequence[hf.Run],
    configs: Sequence[Sequence[int]],
) -> int:
    """KV bytes right after the last pass (no copy in flight), extrapolated like the places."""
    key = _last_after(keyed[0])
    v0 = keyed[0][key].get(Component.KV_CACHE, 0)
    out = v0
    for n, r in enumerate(ext, start=1):
        out += (keyed[n][key].get(Component.KV_CACHE, 0) - v0) * (runs[r].count - configs[0][r])
    return out


def generate_events(spec: ModelSpec, setup: InferenceSetup, *, flash: bool = True) -> list[Event]:
    """The allocations and frees of one full-depth ``generate`` run on fake tensors, in order: the weights
    (as the model is put on the device), then every storage the tracker saw, freed when it died. What the
    caching-allocator simulation replays to check the closed forms' own stream
    (:func:`trainfit.analytic.inference.generate_events`); no depth extrapolation, no split (small models)."""
    if setup.tp != 1:
        raise TraceError("generate_events traces one GPU")
    dtype = _build_dtype(setup)
    _check_kv_dtype(spec, setup)
    meta, _ = hf.build_meta(spec, Strategy(attention=setup.attention, checkpointing=Checkpointing.NONE), dtype)
    meta_config: Any = meta.config
    conf = meta_config.get_text_config() if hasattr(meta_config, "get_text_config") else meta_config
    full = int(conf.num_hidden_layers)
    stack_path, _ = hf.find_stack(meta, full)
    model = hf.reduced_model(meta, stack_path, list(range(full)), full)
    _, sub = hf.find_stack(model, full)
    tr, _, _ = _run_layout(model, sub, [], setup, flash, setup.context)
    slots: list[Event | None] = [None] * (tr.t + 2)
    for idx, rec in enumerate(tr.records):
        slots[rec.alloc_t] = Event(Op.ALLOC, idx, rec.nbytes)
        if rec.free_t is not None:
            slots[rec.free_t] = Event(Op.FREE, idx)
    return [e for e in slots if e is not None]

"""One rank of a many-GPU run, traced: the real parallelisation code on PyTorch's fake process group.

The reference for :mod:`trainfit.analytic.parallel`. One process plays rank 0 of a world of W ranks:
``dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=W)``
(torch/testing/_internal/distributed/fake_pg.py) and a CPU device mesh; collectives return at once
without touching data, so every tensor the framework allocates on rank 0 is allocated, at its real size,
on fake tensors. The model is the reduced-depth Hugging Face model of the single-GPU trace
(:mod:`trainfit.trace.depth`), wrapped by the framework's own code, then run by the same step runner
under the same tracker and CUDA emulation; regions are extrapolated in depth as for one GPU (FSDP2's
peaks are exactly linear in the number of layers, DESIGN §4.3). The cost of a step does not depend on W.

* **FSDP2** (``--sharding fsdp``): ``fully_shard`` on every decoder layer, then on the root — the
  per-layer-plus-root policy of torchtitan and of accelerate's ``fsdp2_prepare_model`` with a
  transformer-layer auto-wrap — with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` over
  fp32 parameters for the 16-bit recipes, and ``reshard_after_forward`` as asked for the layers; the root
  keeps torch's own choice (``None``: not resharded after forward, as accelerate and the FSDP2 tutorial call it;
  passing the flag to the root too, as torchtitan does, frees and re-gathers the root's table around the loss).
  The model is on the device when it is wrapped (a loaded model), so each call splits its group's whole
  weights there; under ``sharded_init`` (built on meta, torchtitan) those are not device memory.
* **DDP** (``--sharding ddp``): ``DistributedDataParallel`` with the asked ``bucket_cap_mb`` and
  ``gradient_as_bucket_view``; its parameter-shape check across ranks is skipped (a collective on
  real data), a communication hook returns a completed future, and the reducer's bucket rebuild at the second
  forward, which reads tensor data, is done in Python as the C++ one does it (:class:`_RebuildingReducer`).

Fine-tuning: the reduced model gets real PEFT adapters on the meta device
(:func:`trainfit.trace.peft.apply_finetuning`) before it is materialised; QLoRA's 4-bit weights are quantised
on fake tensors *before* the framework wraps the model (a wrapper would otherwise keep the unquantised weights
it saw), and under FSDP2 bitsandbytes' recovery of the ``quant_state`` that the unsharded weight lost is done
on the fake tensor itself. ``--freeze`` freezes the reduced model's parameters (``freeze_patterns`` on the full-depth
meta model); a freeze range makes frozen and trainable layers two runs, whose reduced model keeps layers that are no
prefix of the stack: they are renumbered as on one GPU (:func:`trainfit.trace.depth.renumber_layers`). Under FSDP2
the extrapolation holds the temporaries at their largest traced value (:func:`_hold_transients`); the KV cache's
copies that die with the outputs (a dead layer's: no kernel saves them) are filed apart (:data:`CACHE`) so that
they are extrapolated, then folded back (:func:`fold_cache`; a run of 7 dead layers of 8: forward −2.7% against the
full depth before).

DeepSpeed ZeRO-1/2/3 (``--sharding zero1|zero2|zero3``) is traced by :mod:`trainfit.trace.deepspeed`, which
:func:`trace_distributed` hands it to.

What the tracker needs beyond one GPU (DESIGN §4.3): FSDP2 frees and re-allocates the unsharded
parameters with ``UntypedStorage.resize_`` (torch/distributed/fsdp/_fully_shard/_fsdp_common.py
``free_storage``/``alloc_storage``), which no dispatch mode sees, so ``resize_`` is patched for the run and
each re-allocation is a new storage record (:attr:`Component.UNSHARDED_PARAMS`); parameters, gradients
and optimizer states are DTensors, whose local tensors are what a rank holds; storages made while the
framework builds its buffers (DDP's buckets, also when it rebuilds them after the first step) are
:attr:`Component.COMM_BUFFERS`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from trainfit.allocator import AllocatorConfig
from trainfit.allocator.workspaces import Workspace
from trainfit.arch.spec import ModelSpec
from trainfit.errors import StrategyError, TraceUnsupportedError
from trainfit.fsdp_units import resolved_fsdp_wrap
from trainfit.result import (
    Component,
    MemoryReport,
    Method,
    Phase,
    PhaseBreakdown,
    RepeatedRun,
    TraceDetails,
)
from trainfit.strategy import Checkpointing, Engine, Float8, FsdpWrap, Precision, Quantization, Sharding, Strategy
from trainfit.strategy.parallel import TORCH_BUCKET_CAP_MB
from trainfit.trace import bnb, depth, hf, readout
from trainfit.trace import runner as rn
from trainfit.trace import tracker as tk
from trainfit.trace.float8 import inner_ops_tracked
from trainfit.trace.optim import make_optimizer
from trainfit.units import fmt_gib

#: Record kinds beyond the tracker's own.
UNSHARDED, COMM = 20, 21
#: The KV cache's ``torch.cat`` copies of k and v (training with ``use_cache``): alive to the forward's end, or saved.
CACHE = 22

Progress = Callable[[str, float], None]


class DistTracker(tk.Tracker):  # type: ignore[no-untyped-call]
    """The storage tracker with DTensor local shards, ``resize_`` re-allocations and comm-buffer regions."""

    def __init__(self, *, host_states: bool = False) -> None:
        super().__init__()
        self.comm_depth = 0
        self.comm_records: list[tk.Record] = []  # made in a comm region, in order (DDP's buckets and the rebuild's)
        # FSDP2's CPUOffloadPolicy: the sharded parameters, their gradients and the optimizer states live in
        # host memory and the step runs there; on the CPU mesh they are ordinary tensors, filed as host here.
        self.host_states = host_states

    def _local(self, t: Any) -> Any:
        from torch.distributed.tensor import DTensor

        return t._local_tensor if isinstance(t, DTensor) else t

    def _record(self, st: torch.UntypedStorage, op: str) -> tk.Record | None:
        rec = super()._record(st, op)
        if rec is not None and rec.kind == tk.NONE and self.comm_depth > 0 and rec.alloc_t == self.t:
            rec.kind = COMM
            self.comm_records.append(rec)
        return rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        """The tracker's own bookkeeping on what a rank holds: a DTensor's local tensor, never the wrapper
        (whose storage has the global size)."""
        from torch.distributed.tensor import DTensor
        from torch.utils._pytree import tree_leaves

        out = func(*args, **(kwargs or {}))
        name = func.__name__
        for t in tree_leaves(out):
            if isinstance(t, DTensor):
                t = t._local_tensor
            if not isinstance(t, torch.Tensor):
                continue
            rec = self._record(t.untyped_storage(), name)
            if rec is None or rec.alloc_t != self.t:
                continue
            if func is self._to_copy and rec.kind == tk.NONE:
                src = self.record_of(args[0])
                if src is not None and src.kind in (tk.WEIGHTS, tk.MASTER) and args[0].dtype != t.dtype:
                    rec.kind = tk.AUTOCAST
            elif func is self._add and self.phase == tk.BACKWARD and len(args) == 2 and not kwargs:
                self._maybe_accumulation(rec, t, args)
        return out

    def mark(
        self, tensors: Iterable[torch.Tensor | None], kind: int, *, only_unmarked: bool = False, device: bool = False
    ) -> None:
        """``device``: these states are on the GPU even under CPUOffloadPolicy (no_sync's kept unsharded
        gradients)."""
        if self.host_states and not device and kind in (tk.WEIGHTS, tk.MASTER, tk.GRAD, tk.OPT):
            kind = tk.HOST
        super().mark((self._local(t) for t in tensors), kind, only_unmarked=only_unmarked)

    def record_of(self, t: torch.Tensor) -> tk.Record | None:
        return super().record_of(self._local(t))

    def _freed(self, rec: tk.Record, _ref: object) -> None:
        if rec.free_t is None:  # a storage resized to 0 was freed then
            super()._freed(rec, _ref)

    def on_resize(self, st: torch.UntypedStorage, nbytes: int) -> None:
        """``storage.resize_(nbytes)`` happened: 0 frees the storage's record; a size makes a new one."""
        entry = self._info.get(st)
        if nbytes == 0:
            if entry is not None:
                entry[0].free_t = self._tick()
                del self._info[st]
            return
        if entry is not None:
            entry[0].free_t = self._tick()
            del self._info[st]
        rec = self._record(st, "resize_")
        if rec is not None:
            rec.kind = UNSHARDED

    @contextlib.contextmanager
    def comm_region(self) -> Iterator[None]:
        self.comm_depth += 1
        try:
            yield
        finally:
            self.comm_depth -= 1

    def component(self, rec: tk.Record) -> Component | None:
        if self.host_states and rec.kind == tk.NONE and rec.phase == tk.OPTIMIZER:
            return None  # the offloaded step's temporaries are host memory
        if rec.kind == UNSHARDED:
            return Component.UNSHARDED_PARAMS
        if rec.kind == COMM:
            return Component.COMM_BUFFERS
        if rec.kind == CACHE:
            # what an attention kernel saves is an activation; what only the cache holds dies with the outputs, a
            # forward temporary filed apart so that depth extrapolates it (:func:`_hold_transients` holds FSDP2's
            # temporaries at their largest traced value; :func:`fold_cache` files it back)
            end = self.forward_end.get(rec.step)
            if end is None or rec.free_t is None or rec.free_t > end:
                return Component.ACTIVATIONS
            return Component.KV_CACHE
        return super().component(rec)


def _mark_cache(tr: DistTracker, out: Any) -> Any:
    """The forward's outputs, with the KV cache's tensors marked (:data:`CACHE`)."""
    from trainfit.trace.generate import cache_tensors

    tr.mark(cache_tensors(getattr(out, "past_key_values", None)), CACHE, only_unmarked=True)
    return out


def fold_cache(phases: dict[Phase, PhaseBreakdown]) -> dict[Phase, PhaseBreakdown]:
    """The cache's forward copies (:data:`CACHE`, extrapolated on their own) back among the temporaries, where the
    analytic model and the one-GPU trace count them."""
    out = {}
    for ph, b in phases.items():
        kv = b.components.get(Component.KV_CACHE, 0)
        if kv:
            c = dict(b.components)
            c[Component.KV_CACHE] = 0
            c[Component.TEMPORARIES] = c.get(Component.TEMPORARIES, 0) + kv
            b = dataclasses.replace(b, components=c)
        out[ph] = b
    return out


@contextlib.contextmanager
def patched_resize(tr: DistTracker) -> Iterator[None]:
    orig = torch.UntypedStorage.resize_

    def resize_(st: torch.UntypedStorage, size: int) -> Any:
        out = orig(st, size)
        tr.on_resize(st, int(size))
        return out

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = orig  # type: ignore[method-assign]


@contextlib.contextmanager
def _quant_state_on_unsharded(strategy: Strategy) -> Iterator[None]:
    """FSDP2 replaces each ``Linear4bit`` weight by its unsharded tensor, which has lost the ``quant_state``
    attribute; bitsandbytes recovers it in ``Linear4bit.forward`` from the module
    (bitsandbytes/nn/modules.py ``fix_4bit_weight_quant_state_from_module``: "this happens for example for
    fsdp") by re-wrapping the weight as a ``Params4bit`` sharing its data, which a fake tensor refuses. For
    the trace the attribute is set on the unsharded tensor itself: the same storage, nothing allocated."""
    if strategy.base_weights.quantization is Quantization.NONE:
        yield
        return
    import importlib

    mods: Any = importlib.import_module("bitsandbytes.nn.modules")
    saved = mods.fix_4bit_weight_quant_state_from_module

    def fix(module: Any) -> None:
        if getattr(module.weight, "quant_state", None) is None:
            module.weight.quant_state = module.quant_state

    mods.fix_4bit_weight_quant_state_from_module = fix
    try:
        yield
    finally:
        mods.fix_4bit_weight_quant_state_from_module = saved


@contextlib.contextmanager
def fake_world(world_size: int, shard: int | None = None, rank: int = 0) -> Iterator[Any]:
    """Rank ``rank`` (0 unless asked) of ``world_size`` on the fake process group, and its CPU device mesh: 1-D, or
    2-D (replicate × shard) for HSDP when ``shard`` < ``world_size``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        if shard is None or shard >= world_size:
            yield init_device_mesh("cpu", (world_size,))
        else:
            yield init_device_mesh("cpu", (world_size // shard, shard), mesh_dim_names=("replicate", "shard"))
    finally:
        dist.destroy_process_group()


def check_traceable(strategy: Strategy) -> None:
    """The setups this trace runs: DDP and FSDP2 (torch engine), data parallel only, nothing offloaded."""
    par, sh = strategy.parallelism, strategy.sharding
    if par.pipeline > 1:
        raise StrategyError("--method trace does not run pipeline parallelism; use --method analytic")
    if sh in (Sharding.ZERO1, Sharding.ZERO2, Sharding.ZERO3) and strategy.engine.engine in (
        Engine.AUTO,
        Engine.DEEPSPEED,
    ):
        if strategy.checkpointing is Checkpointing.SELECTIVE:
            raise StrategyError(
                "--method trace runs --checkpointing selective with ddp|fsdp|hsdp, not DeepSpeed; use --method analytic"
            )
        from trainfit.trace.deepspeed import check_traceable as check_deepspeed  # DeepSpeed ZeRO

        check_deepspeed(strategy)
        return
    if sh not in (Sharding.DDP, Sharding.FSDP, Sharding.HSDP, Sharding.NONE) or strategy.engine.engine not in (
        Engine.AUTO,
        Engine.TORCH,
    ):
        raise StrategyError(
            f"--method trace runs --sharding ddp|fsdp|hsdp|zero1|zero2|zero3; for {sh.value} use --method analytic"
        )
    if strategy.offload.any and not (sh in (Sharding.FSDP, Sharding.HSDP) and strategy.offload.parameters_on_host):
        raise StrategyError("--method trace runs CPU offload only as FSDP2's CPUOffloadPolicy; use --method analytic")
    base = strategy.base_weights
    if base.quantization is Quantization.INT8:
        raise StrategyError("--method trace does not run LLM.int8 layers yet; use --method analytic")


def no_sync_passes(model: torch.nn.Module, strategy: Strategy, tr: DistTracker) -> Callable[[int, int], None] | None:
    """accelerate's ``no_sync`` for FSDP2 (``EngineOptions.sync_each_batch`` False, the HF Trainer's default under
    accumulation): every micro-step but the step's last runs with ``set_requires_gradient_sync(False)``
    (accelerate/accelerator.py ``no_sync``, transformers/trainer.py's inner loop). The unsharded gradients kept
    between them are filed as gradients (``tk.GRAD``): left to the tracker's fate rule they were temporaries, which
    the depth extrapolation holds at their largest traced value rather than extrapolating (``_hold_transients``),
    although they grow by a layer's per layer — the extrapolated trace was one layer's short (0.47 MiB, ~1%, on a
    tiny llama of five layers)."""
    if strategy.engine.sync_each_batch or strategy.grad_accum < 2 or not hasattr(model, "set_requires_gradient_sync"):
        return None

    switch: Callable[[bool], None] = model.set_requires_gradient_sync  # type: ignore[assignment]

    def before(micro: int, passes: int) -> None:
        if micro > 0:
            tr.mark(_kept_gradients(model), tk.GRAD, device=True)  # unsharded: on the GPU under offload too
        switch(micro == passes - 1)

    return before


def _kept_gradients(model: torch.nn.Module) -> list[torch.Tensor | None]:
    """Each FSDP2 parameter's gradient kept unsharded by a micro-step that did not reduce: upcast to the reduce dtype
    (_fsdp_param.py ``to_accumulated_grad_if_needed``: ``unsharded_accumulated_grad``) or autograd's own ``.grad``."""
    out: list[torch.Tensor | None] = []
    for m in model.modules():
        get_state = getattr(m, "_get_fsdp_state", None)
        if get_state is None:
            continue
        for group in getattr(get_state(), "_fsdp_param_groups", ()):
            for p in group.fsdp_params:
                acc = getattr(p, "unsharded_accumulated_grad", None)
                unsharded = getattr(p, "_unsharded_param", None)
                out.append(acc if acc is not None else getattr(unsharded, "grad", None))
    return out


def _wrap_fsdp(
    model: torch.nn.Module, layers: list[torch.nn.Module], mesh: Any, strategy: Strategy, *, units: bool
) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = (
        MixedPrecisionPolicy(
            param_dtype=torch.float16 if strategy.recipe.compute_dtype == "fp16" else torch.bfloat16,
            reduce_dtype=torch.float32,
        )
        if strategy.recipe.mixed
        else MixedPrecisionPolicy()
    )
    raf = strategy.engine.reshard_after_forward
    kw: dict[str, Any] = {}
    if strategy.offload.parameters_on_host:
        from torch.distributed.fsdp import CPUOffloadPolicy

        # pin_memory=False: fake tensors have no ``_pin_memory``, and pinning only changes the kind of host memory
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=raf, **kw)
    if units:
        # accelerate's fsdp2_prepare_model (1.15) and torchtitan's apply_fsdp: an untied token embedding as a unit
        # (resharded after forward as asked), then [final norm, head] — the tied table in it — kept unsharded after
        # forward (its backward follows at once); the root holds what is left
        hf_model: Any = model
        inp, out = hf_model.get_input_embeddings(), hf_model.get_output_embeddings()
        tied = out is not None and inp.weight is out.weight
        if not tied:
            fully_shard(inp, mesh=mesh, mp_policy=mp, reshard_after_forward=raf, **kw)
        norm = _final_norm(model)
        tail = [m for m in (norm, inp if tied else None, out) if m is not None]
        fully_shard(tail, mesh=mesh, mp_policy=mp, reshard_after_forward=False, **kw)
    fully_shard(model, mesh=mesh, mp_policy=mp, **kw)


def _final_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    """The last direct child of the base model whose class name says norm (accelerate's ``_find_final_norm``:
    ``model.norm`` for Llama, ``transformer.ln_f`` for GPT-2)."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else model
    if not isinstance(base, torch.nn.Module):
        return None
    found = None
    for child in base.children():
        if "Norm" in type(child).__name__:
            found = child
    return found


def _wrap_ddp(model: torch.nn.Module, strategy: Strategy, tr: DistTracker) -> torch.nn.Module:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    shelf = _NcclShelf()

    def done(_state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        shelf.stash(bucket)
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    # DDP checks the hook's annotations at run time (strings under ``from __future__ import annotations``).
    bucket_type = dist.GradBucket  # type: ignore[attr-defined]
    done.__annotations__ = {"_state": object, "bucket": bucket_type, "return": torch.futures.Future[torch.Tensor]}
    eo = strategy.engine
    # torch's default cap is passed as None, as accelerate does (``KwargsHandler.to_kwargs`` drops a default
    # ``bucket_cap_mb``; the HF Trainer passes it only when set): torch 2.13 gives an explicit cap to the first
    # bucket too, the default 1 MiB (``dist._DEFAULT_FIRST_BUCKET_BYTES``) only to None
    # (distributed.py ``_BucketCapacityConfig.create``).
    cap_mb = None if eo.bucket_cap_mb == TORCH_BUCKET_CAP_MB else eo.bucket_cap_mb
    # The quantisation state trace.bnb registers as buffers (to track and move it) is an attribute of the real
    # bitsandbytes weight, which DDP neither broadcasts at construction nor syncs before each forward.
    quant = [n for n, _ in model.named_buffers() if n.rsplit(".", 1)[-1].startswith(bnb.QUANT_BUFFER_PREFIX)]
    if quant:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, quant)  # type: ignore[no-untyped-call]
    first = len(tr.records)
    with _no_shape_check():
        ddp = DistributedDataParallel(model, bucket_cap_mb=cap_mb, gradient_as_bucket_view=eo.gradient_as_bucket_view)
    # The reducer's buckets: what DDP made and kept, less the model's own tensors (first seen by the tracker here)
    own = {id(tr.record_of(t)) for t in (*model.parameters(), *model.buffers())}
    buckets = [r for r in tr.records[first:] if r.free_t is None and id(r) not in own]
    ddp.register_comm_hook(None, done)
    # Without ``find_unused_parameters`` DDP builds one bucket of every gradient for the first iteration
    # (``BucketCapacityConfig.compute_bucket_size_limits``: ``[sys.maxsize]``) and buckets by ``bucket_cap_mb``
    # only when the reducer rebuilds them in the order the gradients arrived, at the second forward
    # (``_pre_forward`` → ``Reducer::rebuild_buckets``; real DDP on gloo: 8404992 bytes, then 1050624 + 7354368).
    # The C++ rebuild reads tensor data (``sync_bucket_indices``), which fake tensors have not: it is emulated
    # (:class:`_RebuildingReducer`).
    ddp.reducer = _RebuildingReducer(ddp, tr, buckets, shelf)  # type: ignore[assignment]
    return ddp


class _NcclShelf:
    """ProcessGroupNCCL's stash of the reducer's all-reduces, which keeps the first iteration's bucket alive past
    the rebuild. An asynchronous collective puts its input and output tensors on its work's ``TensorShelf``
    (c10d/ProcessGroupNCCL.cpp ``collective``); ``Work::wait`` releases them (``synchronizeStream`` →
    ``unstash``), but the reducer never waits on the work, only on its future (reducer.cpp ``finalize_backward``:
    ``bucket.future_work->wait()``). A work nobody waits on keeps its shelf until the watchdog, polling every
    ``kWatchdogThreadSleepMillis`` (100 ms), has seen it complete and handed the shelf to ``shelvesToUnstash_``,
    which the next collective's ``workEnqueue`` empties. In steady state that holds nothing extra (the buckets
    live on in the reducer), but the first iteration's bucket, dropped by ``initialize_buckets`` at the rebuild,
    stays on the shelf of its all-reduce: the broadcasts of the rebuild and of the buffers come right after the
    optimizer step, before the watchdog has looked, so it goes only at an all-reduce of the next backward
    (H200, torch 2.11, qwen2.5-0.5b on one NCCL rank: the second step's forward and backward peaks held one more
    all-gradient bucket, 988065792 bytes, gone by its end). Emulated: a backward's buckets are held until the
    next backward's first all-reduce (bucket 0), the earliest the watchdog can have let them go; the fake
    process group itself stashes nothing."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []

    def stash(self, bucket: Any) -> None:
        if bucket.index() == 0:
            self.tensors.clear()  # the next collective's ``workEnqueue`` unstashes the completed works' shelves
        self.tensors.append(bucket.buffer())


class _RebuildingReducer:
    """DDP's reducer, whose bucket rebuild is done in Python as ``Reducer::rebuild_buckets`` (c10d/reducer.cpp)
    does it. ``_pre_forward`` asks before every forward; the C++ rebuild acts once, at the first forward after a
    backward has filled ``rebuilt_params_`` in the order the gradients became ready (``autograd_hook`` →
    ``push_rebuilt_params``; recorded here by post-accumulate-grad hooks, which ``AccumulateGrad`` runs just
    before the reducer's post hook). The parameters in that order get torch's own
    ``dist._compute_bucket_assignment_by_size`` with ``[first bucket cap, bucket cap]``, unsorted (ready order);
    ``sync_bucket_indices`` makes two int32 device tensors (every index and the bucket count; each bucket's length),
    freed on return (the broadcast is the fake group's no-op); ``initialize_buckets`` clears the old buckets, then
    allocates the new ones. The old ones live in the C++ reducer, which cannot drop them alone: it is released with
    the ``Logger`` that owns it, and a new ``dist.Reducer`` with the rebuilt indices (its constructor runs
    ``initialize_buckets``, in the tracker's comm region as DDP's construction is) gets DDP's comm hooks and a new
    ``Logger``, as ``_ddp_init_helper`` does. With ``gradient_as_bucket_view`` resident gradients (a micro-step
    after the first) are views of the old bucket: the new reducer's ``initialize_bucket_views`` copies them into
    its views and lets them go, so the old bucket is freed after the new ones are made, as on a real reducer.
    Not reproduced: the new reducer's bookkeeping starts afresh (``prepare_for_forward`` counts this iteration;
    its own ``rebuilt_params_`` go unused, this wrapper answering every later call), and
    ``DDP_SET_LAST_BUCKET_CAP`` is ignored."""

    def __init__(self, ddp: Any, tr: DistTracker, buckets: list[tk.Record], shelf: _NcclShelf) -> None:
        """``buckets``: the tracker's records of the first iteration's buckets; ``shelf``: the comm hook's
        emulation of NCCL's stash, which may still hold them at the rebuild."""
        if ddp.static_graph or ddp.find_unused_parameters or getattr(ddp, "_use_python_reducer", False):
            raise TraceUnsupportedError("the DDP trace runs the reducer without static_graph or unused parameters")
        self._ddp = weakref.ref(ddp)  # DDP holds this wrapper
        self._reducer: Any = ddp.reducer
        self._tr = tr
        self._buckets = buckets
        self._shelf = shelf
        self._params, self._sparse = ddp._build_params_for_reducer()
        self._ready: list[int] = []
        self._rebuilt = False
        self._hooks = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_ready, i))
            for i, p in enumerate(self._params)
        ]

    def _on_ready(self, index: int, _param: torch.Tensor) -> None:
        if len(self._ready) < len(self._params):
            self._ready.append(index)

    def _rebuild_buckets(self) -> bool:
        if self._rebuilt or len(self._ready) < len(self._params):
            return False
        import torch.distributed as dist

        ddp: Any = self._ddp()
        tr, order = self._tr, self._ready
        first_cap, cap, rebuild_caps = bucket_caps(ddp)
        indices, per_bucket = dist._compute_bucket_assignment_by_size(  # type: ignore[attr-defined]
            [self._params[i] for i in order], rebuild_caps or [first_cap, cap], self._sparse, order
        )
        with tr.comm_region():
            # sync_bucket_indices: every index and the bucket count, then each bucket's length, on the device
            sync = [torch.empty(len(order) + 1, dtype=torch.int32), torch.empty(len(indices), dtype=torch.int32)]
        del sync
        self._reducer = None
        ddp.logger = None  # it holds the reducer (c10d/logger.hpp ``reducer_``)
        # Only gradients that are views of the old bucket, and NCCL's stash of its all-reduce (_NcclShelf), may hold
        # it now; the new reducer copies such gradients into its own views and lets them go
        # (``initialize_bucket_views``), after it has allocated the new buckets.
        viewed = ddp.gradient_as_bucket_view and any(p.grad is not None for p in self._params)
        if not viewed and self._unshelved():
            raise TraceUnsupportedError("the DDP trace could not free the first iteration's bucket before the rebuild")
        args = {
            "params": self._params,
            "bucket_indices": indices,
            "per_bucket_size_limits": per_bucket,
            "process_group": ddp.process_group,
            "expect_sparse_gradients": self._sparse,
            "bucket_bytes_cap": cap,
            "find_unused_parameters": ddp.find_unused_parameters,
            "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
            "param_to_name_mapping": ddp._build_debug_param_to_name_mapping(self._params),
            "first_bucket_bytes_cap": first_cap,
            "skip_all_reduce_unused_params": getattr(ddp, "skip_all_reduce_unused_params", False),
            "use_python_reducer": getattr(ddp, "_use_python_reducer", False),
            "bucket_bytes_cap_list": rebuild_caps,
            "batched_grad_copy": getattr(ddp, "batched_grad_copy", False),
        }
        with tr.comm_region():
            reducer = dist.Reducer(**reducer_kwargs(args))  # type: ignore[attr-defined]
        ddp.logger = dist.Logger(reducer)  # type: ignore[attr-defined]
        reducer.set_logger(ddp.logger)
        for hook, state in ddp._comm_hooks:
            ddp.logger._set_comm_hook_name(hook.__qualname__)
            dist._register_comm_hook(reducer, state, hook)  # type: ignore[attr-defined]
        if self._unshelved():
            raise TraceUnsupportedError("the DDP trace could not free the first iteration's bucket at the rebuild")
        reducer.prepare_for_forward()  # this iteration, which the old reducer had counted
        self._reducer, self._buckets = reducer, []
        self._rebuilt = True
        for h in self._hooks:
            h.remove()
        return True

    def _unshelved(self) -> bool:
        """Whether an old bucket is alive other than on NCCL's stash of its all-reduce."""
        shelved = {id(self._tr.record_of(t)) for t in self._shelf.tensors}
        return any(r.free_t is None and id(r) not in shelved for r in self._buckets)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)


def bucket_caps(ddp: Any) -> tuple[int, int, list[int]]:
    """(first bucket's cap, the others' cap, per-bucket caps of a rebuild — empty: the two caps) of a
    ``DistributedDataParallel``. torch 2.13 keeps them in ``_bucket_config`` (distributed.py
    ``_BucketCapacityConfig``: the first bucket 1 MiB, ``dist._DEFAULT_FIRST_BUCKET_BYTES``, only when
    ``bucket_cap_mb`` is None; ``compute_bucket_size_limits``' second item for a rebuild); torch 2.11 has no such
    attribute (the H200 session: ``AttributeError``) but the ``bucket_bytes_cap`` and ``bucket_bytes_cap_default``
    attributes, which 2.13 still sets from the config for backward compatibility, with the same first-bucket rule
    (``_ddp_init_helper`` passes ``dist._DEFAULT_FIRST_BUCKET_BYTES if self.bucket_bytes_cap_default else
    self.bucket_bytes_cap`` to the ``Reducer``)."""
    import torch.distributed as dist

    config = getattr(ddp, "_bucket_config", None)
    if config is not None:
        caps = config.compute_bucket_size_limits(static_graph=False, find_unused_parameters=False)[1]
        return int(config.first_bucket_bytes_cap), int(config.bucket_bytes_cap), list(caps)
    cap = int(ddp.bucket_bytes_cap)
    first = int(dist._DEFAULT_FIRST_BUCKET_BYTES) if ddp.bucket_bytes_cap_default else cap  # type: ignore[attr-defined]
    return first, cap, list(getattr(ddp, "bucket_bytes_cap_list", None) or [])


def reducer_kwargs(args: dict[str, Any]) -> dict[str, Any]:
    """``args`` less the keywords this torch's ``dist.Reducer`` does not take: its pybind11 signature
    (torch/csrc/distributed/c10d/init.cpp, every argument named) grows between releases — 2.13 added
    ``bucket_bytes_cap_list`` and ``batched_grad_copy`` — so the rebuilt reducer is built by keyword from the names
    in ``Reducer.__init__.__doc__``; a name it lacks must hold an empty or false value, which is what that keyword's
    default is where it exists (refused otherwise)."""
    import torch.distributed as dist

    doc = dist.Reducer.__init__.__doc__ or ""  # type: ignore[attr-defined]
    names = set(re.findall(r"(\w+): ", doc.split("->", 1)[0]))
    kept = {k: v for k, v in args.items() if k in names}
    for k in args.keys() - kept.keys():
        if args[k] not in ([], False, None):  # not the default the missing keyword would have had
            raise TraceUnsupportedError(f"this torch's DDP Reducer takes no {k!r}; the DDP trace cannot rebuild it")
    return kept


@contextlib.contextmanager
def _no_shape_check() -> Iterator[None]:
    import torch.distributed.utils as du
    import torch.nn.parallel.distributed as dd

    saved = dd._verify_param_shape_across_processes  # type: ignore[attr-defined]
    dd._verify_param_shape_across_processes = lambda *a, **k: None  # type: ignore[attr-defined]
    try:
        yield
    finally:
        dd._verify_param_shape_across_processes = saved  # type: ignore[attr-defined]
        _ = du


def _run_strategy(strategy: Strategy) -> tuple[Strategy, Any]:
    """(the strategy the model is built under, the recipe the runner runs). FSDP2's mixed precision: fp32
    parameters, bf16 compute by the policy, no autocast and no separate master copy."""
    if strategy.sharding in (Sharding.FSDP, Sharding.HSDP) and strategy.recipe.mixed:
        fp16 = strategy.recipe.compute_dtype == "fp16"
        built = dataclasses.replace(strategy, precision=Precision.AMP_FP16 if fp16 else Precision.AMP_BF16)
        rec = dataclasses.replace(built.recipe, autocast=False, loss_scaling=False)
        return built, rec
    return strategy, strategy.recipe


def run_layout_distributed(
    spec: ModelSpec,
    strategy: Strategy,
    plan: depth.DepthPlan,
    layout: hf.Layout,
    mesh: Any,
    *,
    steps: int,
    adamw_impl: str,
    progress: Progress | None = None,
) -> rn.TraceRun:
    """Build the reduced model of ``layout``, wrap it with the framework and run it under the tracker."""
    built, rec = _run_strategy(strategy)
    mode = rn.fake_mode()
    model = hf.reduced_model(plan.meta, plan.stack_path, layout.layers, plan.full_layers)
    depth.renumber_layers(model, plan.stack_path)  # a freeze range's two runs keep layers that are no prefix
    if strategy.float8 is not Float8.NONE:
        from trainfit.trace.float8 import apply_float8

        apply_float8(model, plan.stack_path, strategy)  # torchao Float8Linear before the wrapper (torchtitan's order)
    quantised: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if strategy.adapter is not None or not strategy.base_weights.is_default:
        from trainfit.trace.peft import apply_finetuning, quantised_weights

        # Real PEFT adapters on the meta model (trace/peft.py), in the dtype the run builds them in: PEFT's
        # fp32 adapters over an fp32 base for FSDP2's policy, which casts every parameter for compute.
        model = apply_finetuning(model, built)
        rn.materialize(model, mode, None)
        quantised = quantised_weights(model, mode, built)
    else:
        rn.materialize(model, mode, None)
    stack: Any = model.get_submodule(plan.stack_path)
    layers: list[torch.nn.Module] = list(stack)
    box: list[tk.Tracker] = []
    hf.install_checkpointing(model, layers, layout.blocks, box, sac=strategy.checkpointing is Checkpointing.SAC)
    first, last = depth.layer_positions(layout)
    tr = DistTracker(host_states=strategy.offload.parameters_on_host)
    box.append(tr)
    head = hf.head_of(model)
    # The 4-bit weights are quantised before the framework wraps the model (as a loaded QLoRA model is):
    # otherwise the wrapper would keep the unquantised weights it saw.
    held = contextlib.ExitStack()
    held.enter_context(quantised)
    held.enter_context(_quant_state_on_unsharded(strategy))
    try:
        with mode, tr, patched_resize(tr):
            if strategy.sharding in (Sharding.FSDP, Sharding.HSDP):
                if strategy.engine.sharded_init:
                    # Built on meta and materialised shard by shard after wrapping (torchtitan): the whole
                    # weights ``fully_shard`` splits here never exist on the device; only its shards do.
                    tr.mark(model.parameters(), tk.HOST)
                # --fsdp-wrap auto resolves as the analytic model does (units where it has them)
                units = resolved_fsdp_wrap(spec, strategy) is FsdpWrap.UNITS
                _wrap_fsdp(model, layers, mesh, strategy, units=units)
                run_model: torch.nn.Module = model
            else:
                with tr.comm_region():
                    run_model = _wrap_ddp(model, strategy, tr)
    except BaseException:
        held.close()
        raise
    fns = rn.StepFns(
        make_batch=hf.batch_fn(spec, strategy.micro_batch, strategy.seq_len, device="cpu"),
        forward=lambda m, batch: _mark_cache(tr, m(**batch)),
        loss_of=hf.loss_of(spec),
        make_optimizer=lambda params: make_optimizer(strategy.optimizer, params, adamw_impl=adamw_impl),
    )
    options = rn.RunOptions(
        recipe=rec,
        steps=steps,
        grad_accum=strategy.grad_accum,
        head_module=head,
        stack=rn.StackHooks(layers=layers, unit_first=first, unit_last=last) if plan.ext else rn.StackHooks(),
        progress=progress,
        flash_sdp=strategy.flash_sdp,
        before_pass=no_sync_passes(run_model, strategy, tr),
        # no_sync: a middle micro-step adds into the kept gradients without reducing (neither the first nor the last)
        accumulation_passes=rn.ACCUMULATION_PASSES if strategy.engine.sync_each_batch else 3,
        # The first step's micro-steps as a real run has them: under FSDP2/HSDP a single first pass reduce-scatters
        # where no real micro-step does (HSDP's reserve was 4–13% off on tiny cells); DDP, reducing each micro-step,
        # rebuilds its buckets at the second forward, the first step's second micro-step (_RebuildingReducer)
        accumulate_first_step=True,
    )
    execution = rn.Execution(mode=mode, tracker=lambda: tr)
    selective: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if strategy.checkpointing is Checkpointing.SELECTIVE:
        from trainfit.trace.savers import selective_recompute

        selective = selective_recompute(model, box)  # the attention core checkpointed, as on one GPU (depth.py)
    with held, hf.runtime_patches(), patched_resize(tr), inner_ops_tracked(box, strategy), selective:
        return rn.run_steps(run_model, fns, options, execution)


def _hold_transients(
    keyed: list[dict[Any, dict[Component, int]]], strategy: Strategy
) -> list[dict[Any, dict[Component, int]]]:
    """FSDP2's transient buffers — the all-gather inputs and outputs, the reduce-scatter input, the
    unsharded layers in flight (with ``reshard_after_forward``), the logits — cover the root plus at most
    the current and the prefetched layer, whatever the depth; which of them is alive at a region's worst
    moment shifts with the layers around it, so their difference between two depths is not a per-layer
    slope. Each place keeps the larger of the traced values for them and extrapolates only the states and
    the saved activations (exactly linear in depth)."""
    held = {Component.TEMPORARIES, Component.LOGITS_LOSS, Component.COMM_BUFFERS}
    if strategy.engine.reshard_after_forward:
        held.add(Component.UNSHARDED_PARAMS)
    return hold_at_max(keyed, held)


def keyed_rank(results: depth.Traced, strategy: Strategy, *, fsdp: bool, inner: bool = False) -> depth.Keyed:
    """A rank's traced layouts keyed by place (:func:`trainfit.trace.depth.keyed_traces`), FSDP2's transients held
    at their largest traced value (:func:`_hold_transients`)."""
    keyed = depth.keyed_traces(results, inner=inner)
    return _hold_transients(keyed, strategy) if fsdp else keyed


def hold_at_max(
    keyed: list[dict[Any, dict[Component, int]]], held: Iterable[Component]
) -> list[dict[Any, dict[Component, int]]]:
    """``keyed`` (one traced depth each, by region key) with each ``held`` component set to its largest
    traced value in every region: bounded by a buffer, not by the depth, so not extrapolated."""
    out = [{k: dict(v) for k, v in d.items()} for d in keyed]
    for key in out[0]:
        for c in held:
            top = max(d[key].get(c, 0) for d in out if key in d)
            for d in out:
                if key in d:
                    d[key][c] = top
    return out


def run_layouts(
    plan: depth.DepthPlan,
    run_one: Callable[[hf.Layout], rn.TraceRun],
    *,
    say: Progress,
    rank: str,
    failure: str,
    errors: tuple[type[Exception], ...] = (RuntimeError, NotImplementedError, AssertionError),
) -> list[tuple[list[int], hf.Layout, rn.TraceRun]]:
    """Each layout of ``plan`` run by ``run_one`` (a rank's trace on the fake process group), with progress; a
    framework's failure becomes one line (``failure: its first line``) unless ``TRAINFIT_DEBUG`` is set."""
    import os

    results: list[tuple[list[int], hf.Layout, rn.TraceRun]] = []
    for i, (counts, layout) in enumerate(plan.layouts):
        say(f"trace {i + 1}/{len(plan.layouts)} ({len(layout.layers)} layers), {rank}", i / len(plan.layouts))
        try:
            run = run_one(layout)
        except errors as exc:
            if os.environ.get("TRAINFIT_DEBUG"):
                raise
            raise TraceUnsupportedError(f"{failure}: {str(exc).splitlines()[0][:200]}") from None
        results.append((counts, layout, run))
    return results


def trace_distributed(
    spec: ModelSpec,
    strategy: Strategy,
    *,
    modules: bool = False,
    progress: Progress | None = None,
    steps: int = 2,
    adamw_impl: str | None = None,
    extrapolate: bool = True,
    allocator: AllocatorConfig | None = None,
    workspaces: tuple[Workspace, ...] = (),
    capacity_bytes: int | None = None,
    device_bytes: int | None = None,
) -> MemoryReport:
    """Rank 0 of ``strategy``'s run (DDP, FSDP2/HSDP, DeepSpeed ZeRO, DTensor TP), traced on the fake process group
    and extrapolated in depth. Reserved memory: the traced events are not replayed (the CPU trace has no CUDA
    streams, and FSDP2 and DeepSpeed allocate on several); with ``allocator`` it is the traced allocated peak plus
    the reserve of the analytic rank stream through the caching-allocator simulation where that stream is
    simulated (:func:`trainfit.analytic.parallel.simulated_reserve`; how close each stream is to the traced
    events' own replay on one stream: docs/accuracy.md), else the fixed fraction. ``workspaces``, ``capacity_bytes`` and
    ``device_bytes`` as :func:`trainfit.analytic.parallel.estimate_parallel`'s."""
    del modules
    report = _traced_rank(
        spec, strategy, progress=progress, steps=steps, adamw_impl=adamw_impl, extrapolate=extrapolate
    )
    return with_rank_reserve(
        report, spec, strategy, allocator, workspaces, capacity_bytes=capacity_bytes, device_bytes=device_bytes
    )


def with_rank_reserve(
    report: MemoryReport,
    spec: ModelSpec,
    strategy: Strategy,
    allocator: AllocatorConfig | None,
    workspaces: tuple[Workspace, ...] = (),
    *,
    capacity_bytes: int | None = None,
    device_bytes: int | None = None,
) -> MemoryReport:
    """``report`` (a traced rank, workspaces not yet added) with the simulated reserve of the same rank's analytic
    event stream above its traced allocated peak, or the fixed fraction where the stream is not simulated (or
    no ``allocator``); a note says which."""
    from trainfit.analytic.parallel import simulated_reserve

    held = report.peak_bytes + sum(w.size_bytes for w in workspaces)
    fixed = "reserved: the fixed reserve fraction of the traced allocated peak"
    if allocator is None:
        return dataclasses.replace(report, notes=(*report.notes, f"{fixed} (the allocator simulation is off)"))
    try:
        sim = simulated_reserve(
            spec, strategy, held, allocator, workspaces, capacity_bytes=capacity_bytes, device_bytes=device_bytes
        )
    except StrategyError:  # a setup the trace runs and the analytic model refuses: no stream to take a reserve from
        why = "the analytic model, whose stream it would take, does not cover this setup"
        return dataclasses.replace(report, notes=(*report.notes, f"{fixed} ({why})"))
    if sim is None:
        note = f"{fixed} (this setup's rank stream is not simulated; docs/accuracy.md)"
        return dataclasses.replace(report, notes=(*report.notes, note))
    note = (
        f"{sim.note}, its reserve added above the traced allocated peak (the stream's allocated peak "
        f"{fmt_gib(sim.stream_peak_allocated_bytes)}, the trace's {fmt_gib(held)}; the CPU trace has no CUDA streams "
        "to replay), and its blocks above the requests to the traced phases (allocator_rounding)"
    )
    # max_memory_allocated counts blocks: the same stream's, as its reserve (the reserved bytes unchanged)
    phases, ranks, reserve = sim.rounded(report.phases, report.ranks)
    return dataclasses.replace(
        report,
        phases=phases,
        ranks=ranks,
        overhead=dataclasses.replace(report.overhead, allocator_reserve_bytes=reserve),
        notes=(*report.notes, note),
        capped=sim.capped,
        reserve_simulated=True,
        reserve_stopped=sim.stopped,
    )


def _traced_rank(
    spec: ModelSpec,
    strategy: Strategy,
    *,
    progress: Progress | None,
    steps: int,
    adamw_impl: str | None,
    extrapolate: bool,
) -> MemoryReport:
    """The traced rank's phases (:func:`trace_distributed`), its reserve the fixed fraction."""
    from trainfit.analytic.parallel import nccl_basis

    if strategy.parallelism.tensor > 1:  # DTensor TP (± SP): trainfit.trace.tensor_parallel
        from trainfit.trace.tensor_parallel import trace_tensor_parallel

        return trace_tensor_parallel(
            spec, strategy, progress=progress, steps=steps, adamw_impl=adamw_impl, extrapolate=extrapolate
        )
    check_traceable(strategy)
    if strategy.sharding in (Sharding.ZERO1, Sharding.ZERO2, Sharding.ZERO3):
        from trainfit.trace.deepspeed import trace_deepspeed

        return trace_deepspeed(spec, strategy, progress=progress, steps=steps, extrapolate=extrapolate)
    adamw_impl = adamw_impl or strategy.optimizer_impl.value
    from trainfit.trace._deps import require_torch, require_transformers

    require_torch()
    require_transformers()
    t0 = time.perf_counter()
    say = progress or (lambda _m, _f: None)
    built, _ = _run_strategy(strategy)
    # FSDP2 prefetches the next layer and keeps the last reduce-scatter input: its backward is periodic from the
    # third layer on (the top has no input in flight, the bottom nothing to prefetch), so trace 3 and 4.
    fsdp = strategy.sharding in (Sharding.FSDP, Sharding.HSDP)
    base = 3 if fsdp else depth.BASE_UNITS
    plan = depth.plan_depth(spec, built, extrapolate=extrapolate, base_units=base)
    world = strategy.parallelism.world_size
    par = strategy.parallelism
    shard = min(world, par.gpus_per_node) if strategy.sharding is Sharding.HSDP else None

    def run_plan(plan: depth.DepthPlan) -> depth.Traced:
        with fake_world(world, shard) as mesh:
            return run_layouts(
                plan,
                lambda layout: run_layout_distributed(
                    spec, strategy, plan, layout, mesh, steps=steps, adamw_impl=adamw_impl
                ),
                say=say,
                rank=f"rank 0 of {world}",
                failure=f"the {strategy.sharding.value} trace failed",
            )

    # FSDP2: each post-backward reshards its layer and leaves its reduce-scatter input in flight, so the worst
    # backward moment can be the layer below the top or above the bottom at any depth (analytic.parallel
    # ``_fsdp_inner_moments``): key those units too (``inner``), so that they are extrapolated, not dropped as
    # middle ones.
    outcome = depth.extrapolated_depth(
        spec,
        strategy,
        plan,
        run_plan,
        lambda results: keyed_rank(results, strategy, fsdp=fsdp, inner=fsdp),
        depth.whole_phases,
        replan=lambda base: depth.plan_depth(spec, built, extrapolate=extrapolate, base_units=base),
        say=say,
    )
    plan, results, warnings, phases = outcome.plan, outcome.results, outcome.warnings, fold_cache(outcome.phases)
    traced = [len(layout.layers) for _, layout, _ in results]
    trainable = extrapolated_trainable(plan, results)
    what = (
        (
            "FSDP2 fully_shard per layer, the embedding, [final norm, head] and the root"
            if resolved_fsdp_wrap(spec, strategy) is FsdpWrap.UNITS
            else "FSDP2 fully_shard per layer + root"
        )
        + f", reshard_after_forward={strategy.engine.reshard_after_forward}"
        + (f", MixedPrecisionPolicy({strategy.recipe.compute_dtype}, fp32)" if strategy.recipe.mixed else "")
        if fsdp
        else f"DDP bucket_cap_mb={strategy.engine.bucket_cap_mb}, "
        f"gradient_as_bucket_view={strategy.engine.gradient_as_bucket_view}"
    )
    if strategy.adapter is not None:
        what += f"; real PEFT {strategy.adapter.kind.value} adapters on the frozen base"
    if fsdp and strategy.offload.parameters_on_host:
        what += "; CPUOffloadPolicy: shards, gradients, optimizer states and the step on the host (not counted)"
    notes = [
        f"rank 0 of {world} on PyTorch's fake process group: {what}",
        f"traced {', '.join(map(str, traced))} of {plan.full_layers} layers"
        + (" and extrapolated each region linearly" if plan.ext else ""),
        f"NCCL's own buffers are outside the allocator: {nccl_basis(strategy)}",
    ]
    return rank_report(
        spec,
        plan,
        phases,
        results,
        trainable_params=trainable,
        optimizer_impl=adamw_impl if strategy.optimizer.value == "adamw" else strategy.optimizer.value,
        notes=notes,
        warnings=warnings,
        started=t0,
    )


def extrapolated_trainable(plan: depth.DepthPlan, results: list[tuple[list[int], hf.Layout, rn.TraceRun]]) -> int:
    """The full-depth model's trainable parameters from the traced runs: each extrapolated run's per-unit
    increment times its missing units (the first run's count when nothing is extrapolated)."""
    trainable = results[0][2].trainable_params
    for k, r in enumerate(plan.ext):
        trainable += (results[k + 1][2].trainable_params - results[0][2].trainable_params) * (
            plan.runs[r].count - results[0][0][r]
        )
    return trainable


def rank_report(
    spec: ModelSpec,
    plan: depth.DepthPlan,
    phases: dict[Phase, PhaseBreakdown],
    results: list[tuple[list[int], hf.Layout, rn.TraceRun]],
    *,
    trainable_params: int,
    optimizer_impl: str,
    notes: list[str],
    warnings: list[str],
    started: float,
) -> MemoryReport:
    """The traced rank as a report (shared by the DDP/FSDP2, DTensor TP and DeepSpeed traces)."""
    peak = max(p.total_bytes for p in phases.values())
    return MemoryReport(
        method=Method.TRACE,
        model_name=spec.name,
        params=plan.params,
        trainable_params=trainable_params,
        phases=tuple(phases[ph] for ph in Phase),
        overhead=readout.overhead(peak),
        bytes_per_param=readout.bytes_per_param(phases, plan.params),
        notes=tuple(notes),
        warnings=tuple(warnings),
        details=TraceDetails(
            layers_traced=tuple(len(layout.layers) for _, layout, _ in results),
            extrapolated=bool(plan.ext),
            runs=tuple(RepeatedRun(start_block=r.start, unit_blocks=r.period, units=r.count) for r in plan.runs),
            sdpa_backends=dict(results[0][2].sdpa_backends),
            optimizer_impl=optimizer_impl,
            trace_seconds=round(time.perf_counter() - started, 2),
        ),
    )


#: Public names for the 2-D FSDP2×TP trace (:mod:`trainfit.trace.tensor_parallel`), which applies the same
#: FSDP2 wrapping, build strategy and depth rule over the ``dp`` mesh dimension of a TP-parallelised model.
wrap_fsdp = _wrap_fsdp
fsdp_run_strategy = _run_strategy

__all__ = [
    "DistTracker",
    "check_traceable",
    "fake_world",
    "fsdp_run_strategy",
    "hold_at_max",
    "keyed_rank",
    "rank_report",
    "run_layout_distributed",
    "run_layouts",
    "trace_distributed",
    "wrap_fsdp",
]

"""One rank of a DeepSpeed ZeRO run, traced: the real ``DeepSpeedEngine`` on PyTorch's fake process group.

The reference for the ZeRO part of :mod:`trainfit.analytic.parallel`. One rank of W on the fake process group
(:func:`trainfit.trace.distributed.fake_world`) — at stages 1–2 the closed form's worst (ranks differ by the
parameters their partitions meet, ``parallel.ZeroRank``; :func:`trace_deepspeed`), rank 0 at stage 3 —
``deepspeed.init_distributed(dist_backend="fake")`` on top of it, and DeepSpeed's CPU accelerator
(``get_accelerator()`` on a box without CUDA), so every buffer DeepSpeed makes with ``torch.empty(...,
device=get_accelerator().current_device_name())`` is a fake ``cpu`` tensor of its real size, seen by the same
storage tracker as the model's own tensors
(:class:`~trainfit.trace.distributed.DistTracker`). The model is the single-GPU trace's Hugging Face model at its
whole depth (below), built in the recipe's 16-bit dtype (what DeepSpeed's ``bf16``/``fp16`` blocks make of a
model); two steps run through ``engine(batch)``, ``engine.backward(loss)``, ``engine.step()``.

The configuration is the one ``trainfit export`` writes for the strategy
(:func:`trainfit.export.configs.export_plan`: stage, ``contiguous_gradients``, ``overlap_comm``,
``reduce_bucket_size``, ``allgather_bucket_size``, the bf16/fp16 block, clipping 1.0), with one change:
its ``optimizer`` block (DeepSpeed's FusedAdam, a CUDA op) is replaced by a client
``torch.optim.AdamW(fused=True)``, which ZeRO wraps exactly as it wraps FusedAdam — ``torch.optim.AdamW``
is in ``ZERO_SUPPORTED_OPTIMIZERS`` (deepspeed/runtime/zero/utils.py), ``DeepSpeedEngine.
_configure_optimizer`` hands it to the ZeRO optimizer, which points its parameter groups at the fp32
partitions — and which, like FusedAdam, steps without full-size temporaries. Another optimizer (SGD, Lion,
Adafactor, 8-bit AdamW) has no ``optimizer`` block in the exported config: the Trainer hands its own to DeepSpeed
as the client, built here as for one GPU (:func:`trainfit.trace.optim.make_optimizer`), which the config allows
(``zero_allow_untested_optimizer``) and which steps the flat fp32 partition as AdamW does.

Six patches make the engine run on fake tensors (DESIGN §4.3); none changes what is allocated:

* ``model.to(device)`` in ``DeepSpeedEngine._configure_distributed_model`` is a no-op (fake parameters
  cannot be swapped; the model is already on the fake ``cpu`` device in its dtype);
* ``DeepSpeedZeroOptimizer.has_overflow`` computes its per-gradient checks and answers "no overflow"
  (it reads the all-reduced flag with ``.item()``); the fp16 loss scale therefore never drops;
* so does stage 3's ``DeepSpeedZeroOptimizer_Stage3.has_overflow`` (``isinf``/``isnan`` over its gradient
  partition);
* ``is_invalid_grad_norm`` answers "valid" (it reads the norm);
* the CPU accelerator's ``is_fp16_supported`` answers yes (the traced device is a GPU);
* ``assert_ints_same_as_other_ranks`` (ZeRO-3's check that all ranks trace the same module order; it reads
  rank 0's list) is skipped.

Three more, at stage 3, make the trace's cost per step independent of W without changing what is allocated
(:mod:`trainfit.trace.deepspeed_comm`): the coalesced reduce-scatter, all-gather and the all-gather handle's ``wait``
run over a ``(W, chunk)`` view of their flat buffers instead of a Python list of W views.

What is counted (components filed by the tracker, :class:`DeepSpeedTracker`): the flat 16-bit parameter
buffer, the fp32 master partition and Adam's states (marked by the attributes the ZeRO optimizer keeps them
in); the gradients — autograd's ``.grad`` until the reduction, then ``grads_in_partition`` (what
``copy_grads_in_partition`` allocates); the reduce buckets (what ``setup_buckets`` allocates) as
:attr:`Component.COMM_BUFFERS`; every temporary DeepSpeed makes on the way (bucket copies, the step's fp64
norms, flattened and fp32 gradient partitions). Meta tensors (DeepSpeed keeps a ``zeros_like(p,
device="meta")`` per parameter) are not memory and are not recorded.

Depth: the whole depth, never extrapolated (since 2026-12-04). What a rank holds depends on where its partition's
edges fall among the parameters and where the bucket's reductions fall among the layers, neither linear in the
depth: a 2–3-layer model's partitions meet other parameters (llama-3.2-1b over 8 ranks, rank 6: −1.1% extrapolated)
and its reductions copy other buckets (rank 0: −1.5%, the 928 MiB copy of a bucket spanning a partition edge).
Fake tensors make the whole depth cheap: llama-3.1-70b over 64 ranks in 23 s (16 s extrapolated, which took two
reduced-depth runs and the optimizer step once more at full depth behind a stand-in loss).

ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``, parameters partitioned by ``deepspeed.initialize``, not
``zero.Init``): the config adds ``stage3_prefetch_bucket_size``, ``stage3_max_live_parameters`` and
``stage3_max_reuse_distance``; its buffers are filed by attribute (``lp_param_buffer`` and the whole
``ds_persist`` parameters as weights, ``fp32_partitioned_groups_flat``, ``grad_partitions_flat_buffer``,
the ``ipg_buckets`` buffer), and whatever ``PartitionedParameterCoordinator.fetch_sub_module`` allocates
(the coalesced all-gather buffers and the whole copies made from them) is
:attr:`Component.UNSHARDED_PARAMS`. It is traced at full depth, never extrapolated: the coordinator
records the module order in the first step and fetches, prefetches and releases by it from the second, so
what stays gathered depends on where each module is in that order (``stage3_max_reuse_distance``, the
prefetch scan), not linearly on the depth (:mod:`trainfit.analytic.zero3` replays it).

CPU offload (``--offload optimizer``: ``offload_optimizer: {device: cpu}``, stages 1–3; ``optimizer+params``:
``offload_param`` as well, stage 3) runs the exported config whole: its ``optimizer`` block makes the engine build
DeepSpeedCPUAdam, whose C++ extension alone is a stand-in; what DeepSpeed pins and what the CPU Adam step
allocates is filed as host memory and reported per node in ``host_components``
(:mod:`trainfit.trace.deepspeed_offload`, with the two further patched reads). On the CPU accelerator a
``.to(device)`` of a host tensor is no copy, so the device copies ZeRO-3 makes of a host partition before using
it (stage3.py ``grad_buffer.to(grad_partition.device)``; the offloaded parameter partition before its
all-gather) are not seen.

Fine-tuning: real PEFT adapters (LoRA, DoRA) on the meta model before it is materialised in the recipe's dtype —
DeepSpeed's bf16/fp16 block casts the whole module, adapters too — and ``--freeze``'s frozen parameters; the client
optimizer gets the trainable parameters only (as the HF Trainer's), so the flat groups hold only those, and under
ZeRO-3 a frozen parameter's partition is its own ``ds_tensor`` (filed as weights).

Refused in one line: NVMe and activation offload, optimizers other than AdamW, quantised or recast base weights.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import importlib.metadata
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from trainfit.arch.spec import ModelSpec
from trainfit.errors import DependencyError, StrategyError, TraceUnsupportedError
from trainfit.result import Component, MemoryReport, Phase, PhaseBreakdown
from trainfit.strategy import Checkpointing, OffloadTarget, Optimizer, Precision, Quantization, Sharding, Strategy
from trainfit.trace import depth, hf, readout
from trainfit.trace import runner as rn
from trainfit.trace import tracker as tk
from trainfit.trace.deepspeed_comm import matches_verified, world_flat_collectives
from trainfit.trace.deepspeed_offload import H_WEIGHTS, HOST_KINDS, host_live, mark_offload_states, offload_patches
from trainfit.trace.deepspeed_offload import tensors_in as _tensors
from trainfit.trace.distributed import (
    COMM,
    UNSHARDED,
    DistTracker,
    extrapolated_trainable,
    fake_world,
    patched_resize,
    rank_report,
)
from trainfit.trace.optim import make_optimizer, state_tensors
from trainfit.trace.timeline import Mark, PassMarks, StepMarks

Progress = Callable[[str, float], None]

ZERO_STAGES = {Sharding.ZERO1: 1, Sharding.ZERO2: 2, Sharding.ZERO3: 3}


def check_traceable(strategy: Strategy) -> None:
    """What this trace runs: ZeRO-1/2/3, data parallel only, on the device or with the optimizer offloaded (then
    DeepSpeed's CPU AdamW); fine-tuning with LoRA or --freeze."""
    off = strategy.offload
    if off.activations:
        raise StrategyError("--method trace does not run activation offload under DeepSpeed; use --method analytic")
    if OffloadTarget.NVME in (off.optimizer, off.parameters):
        raise StrategyError("--method trace runs DeepSpeed's offload to CPU memory, not NVMe")
    if off.parameters_on_host and (strategy.sharding is not Sharding.ZERO3 or not off.optimizer_on_host):
        raise StrategyError("parameter offload (ZeRO-Infinity) needs --sharding zero3 --offload optimizer+params")
    base = strategy.base_weights
    if base.quantization is not Quantization.NONE:  # as analytic.parallel.check_parallel_finetune
        raise StrategyError(
            "QLoRA with DeepSpeed ZeRO is not modelled (4-bit weights inside ZeRO partitions); "
            "use --sharding fsdp|hsdp|ddp"
        )
    if base.dtype is not None:
        raise StrategyError(
            "--method trace does not run DeepSpeed ZeRO with a recast base (--base-dtype); use --method analytic"
        )
    if strategy.checkpointing is Checkpointing.SAC:
        raise StrategyError("--method trace does not run --checkpointing sac under DeepSpeed; use --method analytic")
    if strategy.optimizer is not Optimizer.ADAMW and off.optimizer_on_host:
        raise StrategyError(
            f"--method trace runs DeepSpeed's CPU offload with its CPU AdamW; for --optimizer "
            f"{strategy.optimizer.value} with --offload use --method analytic"
        )


def ds_config(spec: ModelSpec, strategy: Strategy) -> dict[str, Any]:
    """The DeepSpeed config ``trainfit export`` writes for ``strategy``, without its ``optimizer`` block
    (a client AdamW replaces FusedAdam; see the module docstring) unless the optimizer is offloaded (then the
    engine builds DeepSpeedCPUAdam from it, :mod:`trainfit.trace.deepspeed_offload`)."""
    from trainfit.export.configs import export_plan

    cfg = export_plan(spec, strategy).deepspeed_config
    if cfg is None:  # pragma: no cover - export writes one for every zero* strategy without tp/pp
        raise StrategyError(f"no DeepSpeed config for --sharding {strategy.sharding.value}")
    cfg = dict(cfg)
    if not strategy.offload.optimizer_on_host:  # with offload the engine builds DeepSpeedCPUAdam from it
        cfg.pop("optimizer", None)
    return cfg


def _built(strategy: Strategy) -> Strategy:
    """The strategy the model is built under: DeepSpeed's bf16/fp16 blocks hold the module in 16 bits and
    run it without autocast (``DeepSpeedEngine._configure_distributed_model`` casts the module), so the
    activations are those of a pure 16-bit model, as the analytic model assumes."""
    if strategy.recipe.compute_bits == 32:
        return dataclasses.replace(strategy, precision=Precision.FP32)
    return dataclasses.replace(strategy, precision=Precision.PURE_BF16)


def _dtype(strategy: Strategy) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(strategy.recipe.compute_dtype, torch.float32)


@contextlib.contextmanager
def _deepspeed_world(world: int, rank: int = 0) -> Iterator[None]:
    """DeepSpeed's launcher variables, its communication layer on the fake process group, and the four
    patches of the module docstring; everything restored on exit."""
    import deepspeed
    from deepspeed.runtime import engine as ds_engine
    from deepspeed.runtime.zero import partition_parameters as pp
    from deepspeed.runtime.zero import partitioned_param_coordinator as ppc
    from deepspeed.runtime.zero import stage3 as s3
    from deepspeed.runtime.zero import stage_1_and_2 as s12

    env = {"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)

    def has_overflow(self: Any, partition_gradients: bool = True) -> bool:
        if not self.cpu_offload:
            self.has_overflow_partitioned_grads_serial()  # its allocations; the flag is read with .item()
        return False

    def has_overflow_stage3(self: Any, partition_gradients: bool = True) -> bool:
        # its checks over the gradient partition (stage3.py ``has_overflow``); the flag is read with .item()
        torch.isinf(self.grad_partitions_flat_buffer).any()
        torch.isnan(self.grad_partitions_flat_buffer).any()
        return False

    def configure(self: Any, model: torch.nn.Module) -> Any:
        saved_to = model.to
        model.to = lambda *a, **k: model  # type: ignore[method-assign]
        try:
            return orig_configure(self, model)
        finally:
            model.to = saved_to  # type: ignore[method-assign]

    orig_configure = ds_engine.DeepSpeedEngine._configure_distributed_model
    patches: list[tuple[Any, str, Any]] = [
        (ds_engine.DeepSpeedEngine, "_configure_distributed_model", configure),
        (s12.DeepSpeedZeroOptimizer, "has_overflow", has_overflow),
        (s3.DeepSpeedZeroOptimizer_Stage3, "has_overflow", has_overflow_stage3),
    ]
    from deepspeed.accelerator import get_accelerator

    ds_comm_torch = importlib.import_module("deepspeed.comm.torch")  # ``deepspeed.comm.torch`` is torch itself

    # DeepSpeed's CPU accelerator refuses fp16 (``CPU_Accelerator.is_fp16_supported``); the traced GPU has it.
    patches.append((get_accelerator(), "is_fp16_supported", lambda: True))
    # ``TorchBackend.__init__`` JIT-compiles DeepSpeed's CPU shared-memory all-reduce op (deepspeed/comm/torch.py
    # ``build_shm_op``: csrc/cpu/comm/shm*.cpp with ninja and c++, 45 s to 2 min, again for every install path).
    # Only ``inference_all_reduce`` (DeepSpeed's inference TP layers) calls it, never the traced ZeRO engines on the
    # fake process group: DeepSpeed's own "no shm op" result (None), without compiling.
    patches.append((ds_comm_torch, "build_shm_op", lambda: None))
    for mod in (s12, s3, ds_engine):
        if hasattr(mod, "is_invalid_grad_norm"):
            patches.append((mod, "is_invalid_grad_norm", lambda _norm: False))
    for mod in (ppc, pp, s3):
        if hasattr(mod, "assert_ints_same_as_other_ranks"):
            patches.append((mod, "assert_ints_same_as_other_ranks", lambda _ints: None))
    # DeepSpeed caches its communication backend and process groups in module globals
    # (deepspeed/comm/comm.py ``cdb``, deepspeed/utils/groups.py ``_WORLD_GROUP``, ...): a later trace on a new
    # fake process group must not find the destroyed one's.
    from deepspeed.comm import comm as ds_comm
    from deepspeed.utils import groups as ds_groups

    state = [(ds_comm, "cdb")] + [
        (ds_groups, name) for name in vars(ds_groups) if name.startswith("_") and name[1:2].isupper()
    ]
    # ZeRO-3 replaces torch.nn.functional.linear with its memory-efficient autograd function "until manually
    # reset" (partition_parameters.py ``_enable_mem_efficient_linear``): right for the traced engine, wrong for
    # every model traced after it in this process (its custom autocast changes what amp saves).
    state.append((torch.nn.functional, "linear"))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    saved += [(obj, name, copy.copy(getattr(obj, name))) for obj, name in state]
    for obj, name, new in patches:
        setattr(obj, name, new)
    try:
        with fake_world(world, rank=rank):
            deepspeed.init_distributed(dist_backend="fake", verbose=False)
            yield
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _backward_unwrapped() -> Iterator[None]:
    """``engine.backward`` calls ``loss.backward()``; route it to :func:`runner.run_backward` so the backward
    keeps the CUDA kernel emulation (see its docstring)."""
    orig = torch.Tensor.backward

    def backward(self: torch.Tensor, gradient: Any = None, retain_graph: Any = None, **_: Any) -> None:
        if gradient is not None or retain_graph:
            orig(self, gradient, retain_graph)  # type: ignore[no-untyped-call]
            return
        rn.run_backward(self)

    torch.Tensor.backward = backward  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.Tensor.backward = orig  # type: ignore[method-assign]


class DeepSpeedTracker(DistTracker):  # type: ignore[no-untyped-call]
    """The distributed tracker, less meta-device storages (DeepSpeed keeps ``zeros_like(p, device="meta")``
    shapes of every parameter, stage_1_and_2.py), with regions in which new storages take a given kind."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        from torch.utils._pytree import tree_leaves

        kw = kwargs or {}
        device = kw.get("device")
        tensors = [t for t in tree_leaves((args, kw)) if isinstance(t, torch.Tensor)]
        if (device is not None and torch.device(device).type == "meta") or (
            tensors and all(t.device.type == "meta" for t in tensors)
        ):
            return func(*args, **kw)  # shapes only, no memory
        return super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[no-untyped-call]

    def component(self, rec: tk.Record) -> Component | None:
        if rec.kind in HOST_KINDS:
            return None  # host memory (trainfit.trace.deepspeed_offload)
        return super().component(rec)

    def _record(self, st: torch.UntypedStorage, op: str) -> tk.Record | None:
        rec = super()._record(st, op)
        if rec is not None and self.kinds and rec.kind == tk.NONE and rec.alloc_t == self.t:
            rec.kind = self.kinds[-1]
        return rec

    @contextlib.contextmanager
    def kind_region(self, kind: int) -> Iterator[None]:
        self.kinds.append(kind)
        try:
            yield
        finally:
            self.kinds.pop()


@contextlib.contextmanager
def _allocations_as(tr: DeepSpeedTracker, where: list[tuple[Any, str, int]]) -> Iterator[None]:
    """While the methods ``where`` = [(class, name, kind)] run, what they allocate is of that kind."""
    saved = []
    for cls, name, kind in where:
        orig = getattr(cls, name)

        def wrapped(*a: Any, _orig: Any = orig, _kind: int = kind, **k: Any) -> Any:
            with tr.kind_region(_kind):
                return _orig(*a, **k)

        saved.append((cls, name, orig))
        setattr(cls, name, wrapped)
    try:
        yield
    finally:
        for cls, name, orig in saved:
            setattr(cls, name, orig)


def _buffer_methods(stage: int) -> list[tuple[Any, str, int]]:
    """DeepSpeed's methods that allocate its reduce buckets and gradient partitions."""
    from deepspeed.runtime.zero import stage_1_and_2 as s12

    if stage == 3:
        from deepspeed.runtime.zero import partitioned_param_coordinator as ppc

        # What a fetch allocates (the all-gather buffers the gathered parameters are views of) is unsharded.
        return [(ppc.PartitionedParameterCoordinator, "fetch_sub_module", UNSHARDED)]
    z = s12.DeepSpeedZeroOptimizer
    return [(z, "setup_buckets", COMM), (z, "copy_grads_in_partition", tk.GRAD)]


class _EngineLoop(rn._StepLoop):
    """The runner's step loop with DeepSpeed's engine doing the backward, the reduction and the step."""

    def __init__(
        self,
        model: torch.nn.Module,
        fns: rn.StepFns,
        options: rn.RunOptions,
        ex: rn.Execution,
        cfg: Any,
        optimizer: Optimizer = Optimizer.ADAMW,
    ):
        super().__init__(model, fns, options, ex)
        self.cfg = cfg
        self.optimizer = optimizer
        self.engine: Any = None
        self.stage = int(cfg["zero_optimization"]["stage"])
        self.offload = "offload_optimizer" in cfg["zero_optimization"]

    def build_optimizer(self) -> rn._Optim:
        import deepspeed

        # With offload the config's optimizer block makes the engine build DeepSpeedCPUAdam itself; otherwise the
        # Trainer's optimizer is the client (AdamW fused, the others as trace.optim builds them for one GPU), which
        # ZeRO then steps on the rank's flat fp32 partition
        client = None
        if not self.offload:
            client = (
                torch.optim.AdamW(self.trainable, lr=2e-5, weight_decay=0.0, fused=True)
                if self.optimizer is Optimizer.ADAMW
                else make_optimizer(self.optimizer, self.trainable)
            )
        params = self.trainable if self.offload else None
        engine, optimizer, _, _ = deepspeed.initialize(
            model=self.model, model_parameters=params, optimizer=client, config=self.cfg
        )
        self.engine = engine
        self.mark_states()
        return rn._Optim(optimizer=optimizer, master=None, scaler=None, params=self.trainable, host_keys=set())

    def mark_states(self) -> None:
        """Give DeepSpeed's long-lived buffers their component, by the attributes ``DeepSpeedZeroOptimizer``
        keeps them in (deepspeed/runtime/zero/stage_1_and_2.py)."""
        o, tr = self.engine.optimizer, self.tr
        if self.stage == 3:
            self.mark_stage3_states()
        else:
            tr.mark(_tensors(o.bit16_groups_flat), tk.WEIGHTS)
            if not self.offload:
                tr.mark(_tensors(o.single_partition_of_fp32_groups), tk.MASTER)
                tr.mark(_tensors(getattr(o, "grads_in_partition", None)), tk.GRAD)
                for _key, t in state_tensors(o.optimizer):
                    tr.mark([t], tk.OPT)
            else:  # DeepSpeed's device-side staging buffer for the copies to the host
                tr.mark(_tensors(getattr(o, "temp_grad_buffer_for_gpu_offload", None)), COMM)
        if self.offload:
            mark_offload_states(o, tr, self.stage)

    def mark_stage3_states(self) -> None:
        """Stage 3's long-lived buffers (deepspeed/runtime/zero/stage3.py ``DeepSpeedZeroOptimizer_Stage3``):
        the flat 16-bit partition ``lp_param_buffer`` and the whole persistent parameters (``ds_persist``),
        the fp32 partitions, the gradient partition ``grad_partitions_flat_buffer`` and the reduce buckets."""
        o, tr = self.engine.optimizer, self.tr
        tr.mark(_tensors(getattr(o, "lp_param_buffer", None)), tk.WEIGHTS)
        tr.mark([p.data for p in self.model.parameters() if getattr(p, "ds_persist", False)], tk.WEIGHTS)
        # a frozen parameter's partition (adapters, --freeze) is no part of the optimizer's flat buffer: its own
        # ``ds_tensor`` (partition_parameters.py ``_partition_param``), made on the ``remote_device`` — with
        # ``offload_param`` the host, pinned (parameter_offload.py ``_convert_to_zero_parameters`` passes
        # ``remote_device=self.offload_device``); a persistent one's stays on the device
        host = "offload_param" in self.cfg["zero_optimization"]
        frozen = [
            (getattr(p, "ds_tensor", None), bool(getattr(p, "ds_persist", False)))
            for p in self.model.parameters()
            if not p.requires_grad
        ]
        tr.mark([t for t, persist in frozen if not host or persist], tk.WEIGHTS)
        tr.mark([t for t, persist in frozen if host and not persist], H_WEIGHTS)
        tr.mark(_tensors(o.fp32_partitioned_groups_flat), tk.MASTER)
        tr.mark(_tensors(getattr(o, "grad_partitions_flat_buffer", None)), tk.GRAD)
        tr.mark([b.buffer for b in o.ipg_buckets.values() if b.buffer is not None], COMM)
        for _key, t in state_tensors(o.optimizer):
            tr.mark([t], tk.OPT)

    def backward(self, m: PassMarks, label: str, optim: rn._Optim) -> None:
        loss, self.loss = self.loss, None
        assert loss is not None
        with self.phase(tk.BACKWARD, label):
            self.tr.bwd_head = True
            m.bwd_start = self.now(Mark.BACKWARD_START)
            with _backward_unwrapped():
                self.engine.backward(loss)
            del loss
            self.tr.bwd_head = False
            self.mark_states()
            m.bwd_end = self.now(Mark.BACKWARD_END)

    def optimizer_step(self, sm: StepMarks, optim: rn._Optim) -> None:
        with self.phase(tk.OPTIMIZER, str(sm.step)):
            sm.opt_start = self.now(Mark.OPTIMIZER_START)
            # ``.grad`` left by the reduction (stage 1: autograd's; views of buffers already filed keep their kind)
            self.tr.mark([p.grad for p in self.trainable], tk.GRAD, only_unmarked=True)
            self.engine.step()
            self.mark_states()
            sm.opt_end = self.now(Mark.OPTIMIZER_END)
        self.tr.phase = tk.SETUP


def run_layout_deepspeed(
    spec: ModelSpec,
    strategy: Strategy,
    plan: depth.DepthPlan,
    layout: hf.Layout,
    *,
    steps: int,
    progress: Progress | None = None,
) -> rn.TraceRun:
    """Build the model of ``layout`` in the recipe's dtype and run it through DeepSpeed's engine."""
    built = _built(strategy)
    mode = rn.fake_mode()
    model = hf.reduced_model(plan.meta, plan.stack_path, layout.layers, plan.full_layers)
    depth.renumber_layers(model, plan.stack_path)  # a freeze range's two runs keep layers that are no prefix
    if strategy.adapter is not None:
        from trainfit.trace.peft import apply_finetuning

        # Real PEFT adapters on the meta model (trace/peft.py); DeepSpeed's bf16/fp16 block casts the whole module,
        # adapters too (``DeepSpeedEngine._configure_distributed_model``: ``module.bfloat16()``), as materialising
        # it in the recipe's dtype does here
        model = apply_finetuning(model, built)
    rn.materialize(model, mode, _dtype(strategy))
    stack: Any = model.get_submodule(plan.stack_path)
    layers: list[torch.nn.Module] = list(stack)
    box: list[tk.Tracker] = []
    hf.install_checkpointing(model, layers, layout.blocks, box)  # (sac is refused: check_traceable)
    tr = DeepSpeedTracker()
    box.append(tr)
    loop_box: list[_EngineLoop] = []
    params = [p for p in model.parameters() if p.requires_grad]

    def forward(_m: torch.nn.Module, batch: Any) -> Any:
        return loop_box[0].engine(**batch)

    loss_of = hf.loss_of(spec)

    fns = rn.StepFns(
        make_batch=hf.batch_fn(spec, strategy.micro_batch, strategy.seq_len, device="cpu"),
        forward=forward,
        loss_of=loss_of,
        make_optimizer=lambda params: None,
    )
    options = rn.RunOptions(
        recipe=built.recipe,
        steps=steps,
        grad_accum=strategy.grad_accum,
        max_grad_norm=None,  # DeepSpeed clips inside engine.step (gradient_clipping 1.0)
        # accumulation: the engine is told which pass ends the step (``set_gradient_accumulation_boundary``, the
        # documented way to call ``engine.step()`` once after the step's passes), as its micro-step counter
        # would at every pass with ``step()`` after each
        before_pass=lambda micro, passes: loop_box[0].engine.set_gradient_accumulation_boundary(micro == passes - 1),
        head_module=hf.head_of(model),
        stack=rn.StackHooks(),
        progress=progress,
        flash_sdp=strategy.flash_sdp,
    )
    loop = _EngineLoop(
        model, fns, options, rn.Execution(mode=mode, tracker=lambda: tr), ds_config(spec, strategy), strategy.optimizer
    )
    loop_box.append(loop)
    offload = offload_patches(tr) if loop.offload else contextlib.nullcontext()
    # stage 3's reduce-scatter and all-gather without a Python loop over the ranks (the same allocations)
    collectives = world_flat_collectives() if loop.stage == 3 else contextlib.nullcontext()
    # counted before the engine runs: ZeRO-3 empties each partitioned parameter's ``.data`` (its numel is 0 after)
    counts = sum(p.numel() for p in model.parameters()), sum(p.numel() for p in params)
    allocations = _allocations_as(tr, _buffer_methods(loop.stage))
    with hf.runtime_patches(), patched_resize(tr), allocations, offload, collectives:
        run = loop.run()
    return dataclasses.replace(run, params=counts[0], trainable_params=counts[1])


def trace_deepspeed(
    spec: ModelSpec,
    strategy: Strategy,
    *,
    progress: Progress | None = None,
    steps: int = 2,
    extrapolate: bool = True,
    rank: int | None = None,
) -> MemoryReport:
    """Rank ``rank`` of ``strategy``'s DeepSpeed ZeRO run, traced at full depth on the fake process group (the
    module docstring says why not extrapolated; ``extrapolate`` is accepted for the other traces' signature).
    None: stages 1–2's worst rank by the closed form (:class:`~trainfit.analytic.parallel.ZeroRank`: ranks differ by
    what their partitions meet), rank 0 at stage 3."""
    from trainfit.analytic.parallel import estimate_parallel, nccl_basis
    from trainfit.analytic.parallel import plan as parallel_plan

    parallel_plan(spec, strategy)  # what no one models is refused first (QLoRA with ZeRO, adapters on MoE layers)
    check_traceable(strategy)
    chosen = rank is None
    if rank is None:
        closed = estimate_parallel(spec, strategy)
        rank = max(closed.ranks, key=lambda e: e.peak_bytes).ranks[0] if closed.ranks else 0
    if not 0 <= rank < strategy.parallelism.world_size:
        raise StrategyError(f"rank {rank} is not one of the {strategy.parallelism.world_size} ranks")
    from trainfit.trace._deps import require_torch, require_transformers

    require_torch()
    require_transformers()
    t0 = time.perf_counter()
    say = progress or (lambda _m, _f: None)
    stage = ZERO_STAGES[strategy.sharding]
    world = strategy.parallelism.world_size
    results: list[tuple[list[int], hf.Layout, rn.TraceRun]] = []
    plan = depth.plan_depth(spec, _built(strategy), extrapolate=False)
    with _quiet_deepspeed(), _deepspeed_world(world, rank), _one_line_failure(stage):
        (counts, layout) = plan.layouts[0]
        say(f"trace ({len(layout.layers)} layers), rank {rank} of {world}", 0.0)
        results.append((counts, layout, run_layout_deepspeed(spec, strategy, plan, layout, steps=steps)))
    warnings: list[str] = []
    pk = readout.phase_peaks(results[0][2])
    phases = {ph: readout.breakdown(ph, pk[ph].components) for ph in Phase}
    if strategy.offload.any:
        phases = _with_host(phases, results[0][2], min(world, strategy.parallelism.gpus_per_node))
    traced = [len(layout.layers) for _, layout, _ in results]
    zero = ds_config(spec, strategy)["zero_optimization"]
    which = " (the closed form's worst: ZeRO partitions meet different parameters)" if chosen and rank else ""
    notes = [
        f"rank {rank} of {world}{which} on PyTorch's fake process group: DeepSpeed ZeRO-{stage} engine, the exported "
        "config "
        f"(reduce_bucket_size {zero['reduce_bucket_size']:.0e}, overlap_comm {zero['overlap_comm']}, "
        f"{strategy.recipe.compute_dtype}) "
        + (
            "with ZeRO-Offload: DeepSpeedCPUAdam built by the engine, its C++ step replaced by a torch stand-in "
            "on the host tensors; host bytes per node"
            if strategy.offload.any
            else "with a client torch AdamW in place of FusedAdam"
        )
        + (
            f"; real PEFT {strategy.adapter.kind.value} adapters on the frozen base, the optimizer's parameters"
            if strategy.adapter is not None
            else ""
        ),
        f"traced {', '.join(map(str, traced))} of {plan.full_layers} layers"
        + " (the whole depth: what a rank holds is not linear in it)",
        f"NCCL's own buffers are outside the allocator: {nccl_basis(strategy)}",
    ]
    if stage == 3 and not matches_verified():
        release = importlib.metadata.version("deepspeed")
        notes.append(
            f"DeepSpeed {release}'s ZeRO-3 collectives are not the code trainfit's loop-free stand-ins were checked "
            "against (0.19.8): traced with DeepSpeed's own, whose cost grows with the world size"
        )
    return rank_report(
        spec,
        plan,
        phases,
        results,
        trainable_params=extrapolated_trainable(plan, results),
        optimizer_impl="fused",
        notes=notes,
        warnings=warnings,
        started=t0,
    )


def _with_host(phases: dict[Phase, PhaseBreakdown], run: rn.TraceRun, per_node: int) -> dict[Phase, PhaseBreakdown]:
    """Each phase with the host bytes (by component) the full-depth run holds at that phase's device peak, times
    the ranks of a node, as the analytic reports them (its host memory is the node's)."""
    peaks = readout.phase_peaks(run)
    out = {}
    for ph, b in phases.items():
        host = host_live(run.tracker, peaks[ph].event)
        out[ph] = dataclasses.replace(b, host_components={c: n * per_node for c, n in host.items()})
    return out


@contextlib.contextmanager
def _one_line_failure(stage: int) -> Iterator[None]:
    """DeepSpeed failing on fake tensors is a one-line :class:`TraceUnsupportedError` (``TRAINFIT_DEBUG=1``
    keeps the traceback)."""
    try:
        yield
    except (RuntimeError, NotImplementedError, AssertionError, ValueError) as exc:
        if os.environ.get("TRAINFIT_DEBUG"):
            raise
        msg = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise TraceUnsupportedError(f"the ZeRO-{stage} trace failed: {msg}") from None


@contextlib.contextmanager
def _quiet_deepspeed() -> Iterator[None]:
    """DeepSpeed prints to stdout (its accelerator choice when imported, the build of its communication op)
    and logs its configuration there: while it traces, stdout goes to the null device and its logger to
    ERROR, so that ``--json`` stays clean; the warnings fake tensors provoke in it (``data_ptr`` of a
    FakeTensor, deprecated collectives) are silenced. Raises DependencyError without DeepSpeed."""
    import logging
    import warnings

    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
        try:
            from deepspeed.utils import logger
        except ImportError:
            raise DependencyError(
                "--method trace for --sharding zero* needs DeepSpeed: DS_BUILD_OPS=0 pip install deepspeed"
            ) from None
        # A handler made on first import writes to the stdout of that moment (the sink): point it at stderr.
        for h in logger.handlers:
            if isinstance(h, logging.StreamHandler) and h.stream is sink:
                h.setStream(sys.stderr)
        level = logger.level
        logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            logger.setLevel(level)


__all__ = ["check_traceable", "ds_config", "run_layout_deepspeed", "trace_deepspeed"]

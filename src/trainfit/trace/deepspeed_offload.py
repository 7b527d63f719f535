"""DeepSpeed's CPU offload in the ZeRO trace: which traced storages are host memory, and what stands in for
the one piece of DeepSpeed that cannot run here.

:mod:`trainfit.trace.deepspeed` runs the real engine with the exported ``offload_optimizer: {device: cpu,
pin_memory: true}`` (ZeRO-Offload, stages 1–3) and ``offload_param`` (ZeRO-Infinity to CPU, stage 3). On the
CPU accelerator the device and the host are the same ``cpu`` device, so the tracker cannot tell them apart by
device; it tells them apart by what DeepSpeed does with a tensor:

* whatever DeepSpeed pins (``get_accelerator().pin_memory(t)``; on CUDA ``t.pin_memory()``, a page-locked
  copy, on the CPU accelerator the tensor itself) is host memory — the fp32 master partition, the fp32
  gradient partition (``single_partition_of_fp32_groups[i].grad``, stage_1_and_2.py
  ``initialize_optimizer_states``; stage 3's pinned ``grad_partitions_flat_buffer`` /
  ``subgroup_gradient_buffer``), the 16-bit staging copy of the partition
  (``param_buffer_of_bit16_for_cpu_offload_groups``) and the one-parameter staging buffer
  ``temp_grad_buffer_for_cpu_offload``; stage 3 with ``offload_param``: ``param_groups_fp16_flat_cpu_memory``;
* whatever ``DeepSpeedCPUAdam.step`` allocates (it asserts its parameters are on ``cpu``) is host memory: Adam's
  ``exp_avg``/``exp_avg_sq`` and the stand-in's temporaries;
* everything else is the device's, as without offload — in particular DeepSpeed's own device-side staging:
  ``temp_grad_buffer_for_gpu_offload`` (one 16-bit buffer of the largest parameter, stage_1_and_2.py
  ``__init__``), the fp64 copy of each gradient slice whose norm is taken (``set_norm_for_param_grad_in_gpu``)
  and the fp32 copy of it made before the device-to-host copy (``async_inplace_copy_grad_to_fp32_buffer_from_gpu``:
  ``src_tensor.to(master_weights_and_grads_dtype)``).

Host records are then refined by the attribute DeepSpeed keeps them in (:func:`mark_offload_states`) into
the components the analytic reports in ``host_components``: master weights, optimizer states, gradients (the
fp32 gradient partition), weights (stage 3's offloaded 16-bit partition) and ``comm_buffers`` (the pinned
16-bit staging buffers).

The stand-in: ``DeepSpeedCPUAdam`` is a Python optimizer over the ``cpu_adam`` C++ extension
(deepspeed/ops/adam/cpu_adam.py: ``CPUAdamBuilder().load()``, then ``ds_opt_adam.create_adam`` /
``adam_update`` / ``destroy_adam``), which cannot be built here. Only that extension is replaced
(:class:`HostAdamBuilder`): ``adam_update`` applies the same AdamW update in place with torch ops on the host
fp32 tensors it is given (csrc/adam/cpu_adam_impl.cpp ``Adam_Optimizer::Step_1``: bias-corrected moments,
decoupled weight decay in AdamW mode). Everything else — the engine building ``DeepSpeedCPUAdam`` from the
config's ``optimizer`` block (engine.py ``get_optimizer_configuration``), its lazy state creation, the ZeRO
optimizer's copies between device and host — is DeepSpeed's own code. Host memory is not the device's, so
what the stand-in allocates does not change the device result.

``cpuinfo.get_cpu_info``, which ``DeepSpeedCPUAdam.__init__`` asks for the CPU vendor, runs a Python subprocess on
every call (a second or so, once per traced layout); for the run it answers from the first call of the process
(:func:`_host_cpu_info`: the same dictionary).

Data-dependent reads under fake tensors, patched for the run (each computes what the original allocates,
then answers without reading a value):

* ``DeepSpeedZeroOptimizer.update_offload_overflow_tracker`` (stage_1_and_2.py): ``if grad is not None and
  self._has_inf_or_nan(grad.data)`` reads the flag per gradient; it runs the check and leaves
  ``local_overflow`` False;
* ``DeepSpeedZeroOptimizer.complete_grad_norm_calculation_for_cpu_offload`` (stage_1_and_2.py): sums
  ``param_norm.item()**2`` over the partition's parameters and reads the all-reduced total with ``.item()``;
  it makes and all-reduces the same one-element tensor and answers a finite norm (1.0) on ``self.device``;
* stage 3's ``DeepSpeedZeroOptimizer_Stage3.has_overflow`` already answers "no overflow" in
  :mod:`trainfit.trace.deepspeed` (under offload it reads ``local_overflow``, a Python bool).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from trainfit.result import Component
from trainfit.trace import tracker as tk

#: Record kinds of host storages (never device memory), by the component they are reported under.
H_WEIGHTS, H_MASTER, H_GRAD, H_OPT, H_BUF = 30, 31, 32, 33, 34
HOST_KINDS: dict[int, Component] = {
    H_WEIGHTS: Component.WEIGHTS,
    H_MASTER: Component.MASTER_WEIGHTS,
    H_GRAD: Component.GRADIENTS,
    H_OPT: Component.OPTIMIZER_STATES,
    H_BUF: Component.COMM_BUFFERS,
}


class _HostAdamOp:
    """Stands in for the ``cpu_adam`` extension (module docstring): one AdamW update in place on host fp32
    tensors, with the arguments ``DeepSpeedCPUAdam.step`` passes to ``adam_update``."""

    def __init__(self) -> None:
        self.adamw: dict[int, bool] = {}

    def create_adam(self, opt_id: int, *args: Any) -> int:
        adamw = args[5]  # (lr, beta1, beta2, eps, weight_decay, adamw_mode, should_log)
        self.adamw[opt_id] = bool(adamw)
        return 0

    def destroy_adam(self, opt_id: int) -> int:
        self.adamw.pop(opt_id, None)
        return 0

    @torch.no_grad()
    def adam_update(
        self,
        opt_id: int,
        step: int,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        bias_correction: bool,
        params: torch.Tensor,
        grads: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
    ) -> int:
        if weight_decay and self.adamw.get(opt_id, True):
            params.mul_(1.0 - lr * weight_decay)
        elif weight_decay:
            grads = grads.add(params, alpha=weight_decay)
        exp_avg.mul_(beta1).add_(grads, alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grads, grads, value=1.0 - beta2)
        c1 = 1.0 - beta1**step if bias_correction else 1.0
        c2 = (1.0 - beta2**step) ** 0.5 if bias_correction else 1.0
        params.addcdiv_(exp_avg, exp_avg_sq.sqrt().div_(c2).add_(eps), value=-lr / c1)
        return 0


@functools.cache
def _host_cpu_info() -> dict[str, Any]:
    """``cpuinfo.get_cpu_info()``, asked once per process: it starts a Python subprocess (py-cpuinfo's
    ``get_cpu_info_json``: ``python cpuinfo.py --json``), a second or so, and ``DeepSpeedCPUAdam.__init__`` asks it
    for every optimizer it builds (one per traced layout) only to read the CPU vendor. The machine's CPU does not
    change within a process; each caller gets its own copy of the same answer."""
    import importlib

    impl = importlib.import_module("cpuinfo.cpuinfo")  # the module itself: the package's name is what is patched
    return dict(impl.get_cpu_info())


def _cpu_info_once() -> dict[str, Any]:
    return dict(_host_cpu_info())


class HostAdamBuilder:
    """In place of ``deepspeed.ops.op_builder.CPUAdamBuilder``: ``load()`` returns :class:`_HostAdamOp`."""

    def load(self, *_: Any, **__: Any) -> _HostAdamOp:
        return _HostAdamOp()


def tensors_in(*objs: Any) -> list[torch.Tensor]:
    """The tensors in ``objs`` and in the lists, tuples and dicts among them (DeepSpeed's buffer attributes)."""
    out: list[torch.Tensor] = []
    for o in objs:
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, (list, tuple)):
            out.extend(tensors_in(*o))
        elif isinstance(o, dict):
            out.extend(tensors_in(*o.values()))
    return out


def mark_offload_states(o: Any, tr: Any, stage: int) -> None:
    """File DeepSpeed's host buffers by the attribute the ZeRO optimizer ``o`` keeps them in."""
    from trainfit.trace.optim import state_tensors

    ts = tensors_in
    if stage < 3:
        fp32 = ts(o.single_partition_of_fp32_groups)
        tr.mark(ts(getattr(o, "param_buffer_of_bit16_for_cpu_offload_groups", None)), H_BUF)
        tr.mark(ts(getattr(o, "temp_grad_buffer_for_cpu_offload", None)), H_BUF)
    else:
        fp32 = ts(o.fp32_partitioned_groups_flat)
        tr.mark(ts(getattr(o, "grad_partitions_flat_buffer", None)), H_GRAD)
        tr.mark(ts(getattr(o, "param_groups_fp16_flat_cpu_memory", None)), H_WEIGHTS)
    tr.mark(fp32, H_MASTER)
    tr.mark([t.grad for t in fp32 if t.grad is not None], H_GRAD)
    for _key, t in state_tensors(o.optimizer):
        tr.mark([t], H_OPT)


def host_live(tr: Any, event: int) -> dict[Component, int]:
    """Host bytes by component alive after ``event`` (the records of :data:`HOST_KINDS`)."""
    out: dict[Component, int] = {}
    for rec in tr.live_at(event, lambda r: r.kind in HOST_KINDS):
        c = HOST_KINDS[rec.kind]
        out[c] = out.get(c, 0) + rec.nbytes
    return out


@contextlib.contextmanager
def offload_patches(tr: Any) -> Iterator[None]:
    """The stand-in extension, host filing of pinned buffers and of the CPU Adam step, and the two patched
    reads of the module docstring; everything restored on exit."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import cpu_adam
    from deepspeed.runtime.zero import stage3 as s3
    from deepspeed.runtime.zero import stage_1_and_2 as s12

    try:
        import cpuinfo  # DeepSpeed's dependency (py-cpuinfo), read by DeepSpeedCPUAdam.__init__
    except ImportError:  # pragma: no cover - DeepSpeed requires it
        cpuinfo = None

    acc = get_accelerator()
    orig_pin = acc.pin_memory
    orig_step = cpu_adam.DeepSpeedCPUAdam.step

    def pin_memory(tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
        out = orig_pin(tensor, *a, **k)
        # Page-locked memory is the host's, whatever region made it: ZeRO-2's per-parameter accumulation buffers
        # (``async_accumulate_grad_in_cpu_via_gpu``: ``torch.zeros(..., device=self.device)`` on the host, pinned) are
        # made inside ``copy_grads_in_partition``, whose allocations are otherwise the device's gradients
        # (trace.deepspeed ``_buffer_methods``). Host kinds already given stay (refined by attribute in
        # mark_offload_states).
        rec = tr.record_of(out)
        if rec is None or rec.kind not in HOST_KINDS:
            tr.mark([out], H_BUF)
        return out

    def step(self: Any, *a: Any, **k: Any) -> Any:
        with tr.kind_region(tk.HOST):
            return orig_step(self, *a, **k)

    def update_offload_overflow_tracker(self: Any, grad: Any) -> None:
        if grad is not None:
            self._has_inf_or_nan(grad.data)  # its reductions; the flag is read with ``if``

    def complete_grad_norm_calculation_for_cpu_offload(self: Any, params: Any) -> torch.Tensor:
        import deepspeed.comm as dist

        total = get_accelerator().FloatTensor([0.0])
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_process_group)
        return torch.tensor(1.0, device=self.device, dtype=torch.float)

    def complete_grad_norm_stage3(self: Any, params: Any) -> torch.Tensor:
        import deepspeed.comm as dist

        total = get_accelerator().FloatTensor([0.0])
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self._get_param_partition_group(params[0]))
        return torch.tensor(1.0)  # ``total_norm.cpu()``

    def on_host(orig: Any) -> Any:
        """Stage 3 with ``offload_optimizer``: ``self.device`` is ``cpu`` (stage3.py ``__init__``), and what ``orig``
        makes is the host's — in ``has_overflow`` the ``isinf``/``isnan`` over the host gradient partition; in
        ``_create_fp32_partitions`` the fp32 partition ``.to(cpu, dtype=fp32)`` of the 16-bit one, whose blocking
        device-to-host copy converts on the CPU "to avoid allocating extra GPU memory" (aten/src/ATen/native/cuda/
        Copy.cu ``copy_kernel_cuda``), and its clone; in ``initialize_optimizer_states`` the zero gradient buffers.
        On the CPU accelerator they would read as the device's."""

        def run(self: Any, *a: Any, **k: Any) -> Any:
            with tr.kind_region(tk.HOST) if self.offload_optimizer else contextlib.nullcontext():
                return orig(self, *a, **k)

        return run

    patches: list[tuple[Any, str, Any]] = [
        (acc, "pin_memory", pin_memory),
        (cpu_adam, "CPUAdamBuilder", HostAdamBuilder),
        (cpu_adam.DeepSpeedCPUAdam, "step", step),
        (s12.DeepSpeedZeroOptimizer, "update_offload_overflow_tracker", update_offload_overflow_tracker),
        (
            s12.DeepSpeedZeroOptimizer,
            "complete_grad_norm_calculation_for_cpu_offload",
            complete_grad_norm_calculation_for_cpu_offload,
        ),
        (s3.DeepSpeedZeroOptimizer_Stage3, "complete_grad_norm_calculation_for_cpu_offload", complete_grad_norm_stage3),
        (s3.DeepSpeedZeroOptimizer_Stage3, "has_overflow", on_host(s3.DeepSpeedZeroOptimizer_Stage3.has_overflow)),
        (
            s3.DeepSpeedZeroOptimizer_Stage3,
            "_create_fp32_partitions",
            on_host(s3.DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions),
        ),
        (
            s3.DeepSpeedZeroOptimizer_Stage3,
            "initialize_optimizer_states",
            on_host(s3.DeepSpeedZeroOptimizer_Stage3.initialize_optimizer_states),
        ),
    ]
    if cpuinfo is not None:
        patches.append((cpuinfo, "get_cpu_info", _cpu_info_once))  # the same answer, one subprocess per process
    # (object, name, what its own __dict__ held: None where the attribute came from its class)
    saved = [(obj, name, vars(obj).get(name)) for obj, name, _ in patches]
    for obj, name, new in patches:
        setattr(obj, name, new)
    try:
        yield
    finally:
        for obj, name, old in saved:
            if old is None:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


__all__ = ["HOST_KINDS", "HostAdamBuilder", "host_live", "mark_offload_states", "offload_patches", "tensors_in"]

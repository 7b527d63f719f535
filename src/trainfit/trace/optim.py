"""Optimizers as a GPU training run would use them, in forms that run under fake tensors.

Which implementation an optimizer name means matters for memory: PyTorch's ``foreach`` AdamW — what
``torch.optim.AdamW(params)`` picks on CUDA when nothing is requested, and what the analytic model assumes —
materialises ``sqrt(exp_avg_sq)`` for every parameter at once (``torch._foreach_sqrt`` in
``_multi_tensor_adam``): a transient 4 bytes/param at fp32 states. The fused kernel (``fused=True``; the
Hugging Face Trainer's default ``adamw_torch_fused`` on torch ≥ 2.8) allocates nothing. ``adamw`` means
``foreach`` unless ``adamw_impl="fused"`` is asked for. The other names follow the Trainer's ``optim=``
choices:

* ``sgd`` / ``sgd-momentum``: ``torch.optim.SGD`` (foreach, momentum 0.9 → one buffer per parameter);
* ``adafactor``: ``transformers.optimization.Adafactor`` with ``scale_parameter=False,
  relative_step=False`` (the Trainer's ``optim="adafactor"``): factored second moments, per-tensor loop;
  ``torch.optim.Adafactor`` calls ``.item()`` and cannot run on fake tensors;
* ``lion``: the update of Chen et al. 2023 ("Symbolic Discovery of Optimization Algorithms", Alg. 2) as
  written in lucidrains/lion-pytorch: one momentum buffer, one per-tensor temporary;
* ``adamw-8bit``: bitsandbytes ``AdamW8bit`` cannot run here, so it is modelled by its state: two uint8
  buffers per parameter plus one fp32 absmax per 256-element block each (``Optimizer2State.init_state``,
  blocksize 256), fp32 states for tensors under ``min_8bit_size = 4096`` elements, and a fused update
  that allocates nothing.

``MasterWeights`` implements the master-* recipes: the model holds 16-bit weights and gradients, the
optimizer updates an fp32 copy (Micikevicius et al. 2018, §3.1): at the step each 16-bit gradient is
upcast into an fp32 master gradient (a transient 4 bytes/param), the inner optimizer steps the master
weights, and the result is copied back into the 16-bit weights in place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from trainfit.cuda_facts import BNB_MIN_8BIT_SIZE
from trainfit.cuda_facts import BNB_OPTIM_BLOCK as BNB_BLOCKSIZE
from trainfit.errors import StrategyError
from trainfit.strategy import Optimizer as OptName

#: bitsandbytes ``Optimizer2State``: block size of the blockwise-quantised states and the smallest tensor
#: given 8-bit states (``min_8bit_size``).


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, Alg. 2), per-tensor loop as in lucidrains/lion-pytorch ``update_fn``."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99)):
        super().__init__(params, {"lr": lr, "betas": betas})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                update = exp_avg.clone().mul_(b1).add(p.grad, alpha=1 - b1).sign_()
                p.add_(update, alpha=-group["lr"])
                exp_avg.mul_(b2).add_(p.grad, alpha=1 - b2)
                del update  # lucidrains' update_fn is a function: its update dies with each call


class AdamW8bitModel(torch.optim.Optimizer):
    """bitsandbytes AdamW8bit, modelled by its state tensors (see module docstring)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-5):
        super().__init__(params, {"lr": lr})
        self._qmaps: tuple[torch.Tensor, torch.Tensor] | None = None

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    n = p.numel()
                    if n < BNB_MIN_8BIT_SIZE:
                        state["state1"] = torch.zeros_like(p, dtype=torch.float32)
                        state["state2"] = torch.zeros_like(p, dtype=torch.float32)
                    else:
                        if self._qmaps is None:  # the shared "dynamic"/"udynamic" 256-entry maps
                            self._qmaps = (
                                torch.zeros(256, dtype=torch.float32),
                                torch.zeros(256, dtype=torch.float32),
                            )
                        blocks = -(-n // BNB_BLOCKSIZE)
                        state["state1"] = torch.zeros_like(p, dtype=torch.uint8)
                        state["qmap1"] = self._qmaps[0]
                        state["state2"] = torch.zeros_like(p, dtype=torch.uint8)
                        state["qmap2"] = self._qmaps[1]
                        state["absmax1"] = torch.zeros(blocks, dtype=torch.float32)
                        state["absmax2"] = torch.zeros(blocks, dtype=torch.float32)
                p.mul_(1.0)  # the fused blockwise kernel updates in place


def make_optimizer(name: OptName, params: list[torch.nn.Parameter], *, adamw_impl: str = "foreach") -> Any:
    """The optimizer a GPU run would construct for ``name`` (see module docstring)."""
    if name is OptName.ADAMW:  # weight_decay 0.0: the Trainer default, so no decay temporaries
        if adamw_impl == "fused":
            return torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, fused=True)
        if adamw_impl == "foreach":
            return torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, foreach=True)
        raise StrategyError(f"unknown AdamW implementation '{adamw_impl}'; choose fused or foreach")
    if name is OptName.SGD:
        return torch.optim.SGD(params, lr=1e-3, foreach=True)
    if name is OptName.SGD_MOMENTUM:
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True)
    if name is OptName.ADAFACTOR:
        from trainfit.trace._deps import require_transformers

        tf = require_transformers()
        return tf.optimization.Adafactor(params, lr=1e-3, scale_parameter=False, relative_step=False, warmup_init=False)
    if name is OptName.LION:
        return Lion(params)
    if name is OptName.ADAMW_8BIT:
        return AdamW8bitModel(params)
    raise StrategyError(f"no trace model for optimizer '{name}'")  # pragma: no cover


def host_state_keys(optimizer: Any) -> set[str]:
    """State entries a CUDA run keeps on the host: ``step`` counters of non-fused, non-capturable torch
    optimizers are CPU scalars (``torch.optim.adam._init_group``), so they are not GPU memory."""
    groups = getattr(optimizer, "param_groups", [])
    on_device = any(g.get("fused") or g.get("capturable") for g in groups)
    return set() if on_device else {"step"}


def state_tensors(optimizer: Any) -> Iterator[tuple[str, torch.Tensor]]:
    state = getattr(optimizer, "state", {})
    for per_param in state.values():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                yield key, value


class MasterWeights:
    """fp32 master copy for 16-bit model weights (module docstring). Looks like an optimizer."""

    def __init__(self, model_params: list[torch.nn.Parameter], make_inner: Callable[[list[Any]], Any]):
        self.model_params = model_params
        with torch.no_grad():
            self.master = [torch.nn.Parameter(p.detach().float(), requires_grad=True) for p in model_params]
        self.inner = make_inner(self.master)

    @property
    def state(self) -> Any:
        return self.inner.state

    @property
    def param_groups(self) -> Any:
        return self.inner.param_groups

    def grads_to_master(self) -> list[torch.Tensor]:
        out = []
        for p, m in zip(self.model_params, self.master, strict=True):
            if p.grad is not None:
                m.grad = p.grad.float()
                out.append(m.grad)
        return out

    @torch.no_grad()
    def master_to_model(self) -> None:
        for p, m in zip(self.model_params, self.master, strict=True):
            p.copy_(m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            p.grad = None
        for m in self.master:
            m.grad = None


class FakeSafeGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` minus the host sync: under fake tensors ``found_inf.item()`` has no value,
    so the step always runs (the steady state of a healthy fp16 run). Same tensors otherwise."""

    def _maybe_opt_step(self, optimizer: Any, optimizer_state: Any, *args: Any, **kwargs: Any) -> Any:
        return optimizer.step(*args, **kwargs)

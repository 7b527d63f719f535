"""Model states: weights, gradients, fp32 master weights and optimizer states, plus the optimizer
step's own temporaries. Computed tensor by tensor from the parameter inventory, each tensor rounded
up to the caching allocator's 512-byte blocks.

Optimizer state sizes (per parameter tensor ``p`` of ``n`` elements, states created like ``p`` unless
stated):

* ``adamw``      — exp_avg + exp_avg_sq: 2·n elements (torch.optim.AdamW; ``step`` lives on the CPU).
* ``adamw-8bit`` — bitsandbytes blockwise 8-bit Adam: 2·n bytes + one fp32 absmax per 256-element block
  per state; tensors under 4096 elements keep 32-bit states (bnb ``min_8bit_size``; Dettmers et al.
  2022, "8-bit Optimizers via Block-wise Quantization").
* ``sgd``        — none.  ``sgd-momentum`` — one momentum buffer (n elements).
* ``adafactor``  — factored second moment for ≥2-D tensors: rows + columns in fp32, full fp32 for 1-D,
  no first moment (Shazeer & Stern 2018; transformers ``Adafactor`` defaults, beta1=None).
* ``lion``       — one momentum buffer (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

Step temporaries (what ``optimizer.step()`` allocates on top):

* AdamW with torch's default ``foreach`` implementation on CUDA allocates ``sqrt(exp_avg_sq)`` for every
  tensor of a dtype group at once: one more state-sized buffer (torch/optim/adam.py ``_multi_tensor_adam``).
  The ``fused`` implementation (HF Trainer's default with torch ≥ 2.8) has no such buffer.
* ``master-*`` recipes cast the 16-bit grads to fp32 for the fp32 master parameters: 4 bytes/param.
* Per-tensor optimizers (bnb 8-bit, Adafactor, Lion) need ~2 copies of the largest tensor in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainfit.analytic.overhead import ALLOCATOR_BLOCK_BYTES
from trainfit.arch.params import ParamInventory, inventory
from trainfit.arch.spec import ModelSpec, ParamTensor
from trainfit.strategy import Optimizer, OptimizerImpl, Strategy
from trainfit.units import round_up

BNB_BLOCK = 256  # bitsandbytes blockwise quantisation block (optim/optimizer.py, Optimizer8bit)
BNB_MIN_8BIT_SIZE = 4096


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelStates:
    weights_bytes: int
    grads_bytes: int
    master_bytes: int
    optimizer_bytes: int
    step_temp_bytes: int  # transient, inside optimizer.step()
    autocast_copies_bytes: int  # all low-precision copies of matmul weights (AMP only)
    params: int

    def per_param(self, n: int) -> float:
        return n / self.params if self.params else 0.0


def _alloc(numel: int, bits: int) -> int:
    return round_up(numel * bits // 8, ALLOCATOR_BLOCK_BYTES)


def _opt_state_bytes(t: ParamTensor, opt: Optimizer, state_bits: int) -> int:
    n = t.numel
    if opt is Optimizer.ADAMW:
        return 2 * _alloc(n, state_bits)
    if opt is Optimizer.ADAMW_8BIT:
        if n < BNB_MIN_8BIT_SIZE:
            return 2 * _alloc(n, 32)
        blocks = -(-n // BNB_BLOCK)
        return 2 * (_alloc(n, 8) + _alloc(blocks, 32))
    if opt is Optimizer.SGD:
        return 0
    if opt in (Optimizer.SGD_MOMENTUM, Optimizer.LION):
        return _alloc(n, state_bits)
    if opt is Optimizer.ADAFACTOR:
        if len(t.shape) >= 2:
            rows = n // t.shape[-1]
            cols = n // t.shape[-2]
            return _alloc(rows, 32) + _alloc(cols, 32)
        return _alloc(n, 32)
    raise AssertionError(opt)  # pragma: no cover


def _per_param_bits(opt: Optimizer, state_bits: int) -> float:
    """Bytes·8 per parameter for explicit what-if models (no tensor shapes known)."""
    return {
        Optimizer.ADAMW: 2 * state_bits,
        Optimizer.ADAMW_8BIT: 2 * 8 + 2 * 32 / BNB_BLOCK,
        Optimizer.SGD: 0,
        Optimizer.SGD_MOMENTUM: state_bits,
        Optimizer.LION: state_bits,
        Optimizer.ADAFACTOR: 0.0,  # ~ (rows + cols)/(rows·cols) ≈ 0 for large matrices
    }[opt]


def model_states(spec: ModelSpec, strategy: Strategy) -> ModelStates:
    r = strategy.recipe
    opt = strategy.optimizer
    # Optimizer states are created like the tensor the optimizer updates: the fp32 master copy if any.
    state_bits = 32 if r.master_bits else r.state_bits
    inv: ParamInventory = inventory(spec)
    tensors = inv.all_tensors()
    largest_any = max((t.numel for t, _ in tensors), default=0)

    if spec.params_override is not None:
        p = spec.params_override
        matmul_p = int(p * inv.matmul_params / inv.total) if inv.total else p
        weights = p * r.weight_bits // 8
        grads = p * r.grad_bits // 8
        master = p * r.master_bits // 8
        optim = int(p * _per_param_bits(opt, state_bits) / 8)
        copies = matmul_p * r.compute_bits // 8 if r.autocast else 0
    else:
        p = inv.total
        weights = sum(m * _alloc(t.numel, r.weight_bits) for t, m in tensors)
        grads = sum(m * _alloc(t.numel, r.grad_bits) for t, m in tensors)
        master = sum(m * _alloc(t.numel, r.master_bits) for t, m in tensors) if r.master_bits else 0
        optim = sum(m * _opt_state_bytes(t, opt, state_bits) for t, m in tensors)
        copies = sum(m * _alloc(t.numel, r.compute_bits) for t, m in tensors if t.matmul) if r.autocast else 0

    temp = 0
    if opt is Optimizer.ADAMW and strategy.optimizer_impl is OptimizerImpl.FOREACH:
        temp += p * state_bits // 8  # foreach sqrt(exp_avg_sq) over the whole dtype group
    elif opt in (Optimizer.ADAMW_8BIT, Optimizer.ADAFACTOR, Optimizer.LION):
        temp += 2 * _alloc(largest_any, 32)
    if r.master_bits:
        temp += p * 4  # fp32 copies of the 16-bit grads for the fp32 master parameters
    return ModelStates(
        weights_bytes=weights,
        grads_bytes=grads,
        master_bytes=master,
        optimizer_bytes=optim,
        step_temp_bytes=temp,
        autocast_copies_bytes=copies,
        params=p,
    )

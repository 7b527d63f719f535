"""Model states: weights, gradients, fp32 master weights and optimizer states, plus the optimizer
step's own temporaries. Computed tensor by tensor from the parameter inventory, each tensor rounded
up to the caching allocator's 512-byte blocks.

Optimizer state sizes (per parameter tensor ``p`` of ``n`` elements, states created like ``p`` unless
stated):

* ``adamw``      — exp_avg + exp_avg_sq: 2·n elements (torch.optim.AdamW). ``step`` is a host scalar for
  ``foreach``; the ``fused`` kernel keeps it on the device, one fp32 0-dim tensor (a 512-byte block) per
  tensor (torch/optim/adam.py ``_init_group``).
* ``adamw-8bit`` — bitsandbytes blockwise 8-bit Adam: 2·n bytes + one fp32 absmax per 256-element block
  per state; tensors under 4096 elements keep 32-bit states (bnb ``min_8bit_size``; Dettmers et al.
  2022, "8-bit Optimizers via Block-wise Quantization"); plus the two shared 256-entry fp32 quantisation
  maps (``Optimizer2State.init_state``, ``create_dynamic_map``), once per optimizer.
* ``sgd``        — none.  ``sgd-momentum`` — one momentum buffer (n elements).
* ``adafactor``  — factored second moment for ≥2-D tensors: rows + columns in fp32, full fp32 for 1-D,
  no first moment (Shazeer & Stern 2018; transformers ``Adafactor`` defaults, beta1=None), and the
  parameter's RMS, a 0-dim fp32 tensor on the device (``state["RMS"] = self._rms(p)``).
* ``lion``       — one momentum buffer (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

Step temporaries (what ``optimizer.step()`` allocates on top), each tensor its own allocation:

* AdamW with torch's default ``foreach`` implementation on CUDA allocates ``sqrt(exp_avg_sq)`` for every
  tensor of a dtype group at once: one more state-sized buffer (torch/optim/adam.py ``_multi_tensor_adam``,
  ``torch._foreach_sqrt``). The ``fused`` implementation (HF Trainer's default with torch ≥ 2.8) has no such
  buffer.
* ``master-*`` recipes cast the 16-bit grads to fp32 for the fp32 master parameters: 4 bytes/param.
* ``adamw-8bit``: nothing. bitsandbytes updates each tensor in place with one fused CUDA kernel
  (``Optimizer2State.update_step`` → ``F.optimizer_update_8bit_blockwise`` → ``kOptimizerStatic8bit2StateBlockwise``,
  or ``kOptimizer32bit2State`` for the 32-bit small tensors; bitsandbytes/backends/cuda/ops.py, csrc/ops.cu).
* ``lion`` (lucidrains/lion-pytorch ``update_fn``, per tensor): ``exp_avg.clone()`` and the out-of-place
  ``add`` of the gradient are alive together: 2 copies of the largest trainable tensor, in the state dtype.
* ``adafactor`` (transformers ``Adafactor.step``, per tensor): ``grad**2`` with ``+ eps``, then the factored
  estimate while the previous ``update`` is referenced: 2 fp32 copies of the largest trainable tensor; a
  16-bit parameter adds its fp32 gradient and fp32 parameter copies (``grad.float()``, ``p.float()``): 4.
  The per-row and per-column vectors of the factored estimate are left out (O(rows + cols)).

One rule, per parameter tensor (:func:`param_states`): a tensor is stored in its own format (the recipe's
weight width; a frozen base may be stored in ``BaseWeights.dtype``; a quantised base keeps each layer linear
packed, see :mod:`trainfit.cuda_facts`) and, *only if it is trainable*, has a gradient, an fp32 master copy
(master-* recipes) and optimizer states. Full fine-tuning makes every tensor trainable; an adapter freezes
the base. Autocast keeps a 16-bit copy of each floating matmul weight stored wider than it computes.

A tied token table's two gradients meet at the end of backward (:func:`tied_gradient_sum`): autograd adds them out
of place when the LM head reads the table itself, in place behind autocast's cast (input_buffer.cpp ``accumulate``).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainfit._memo import Memo, spec_key
from trainfit.analytic.adapters import (
    bnb_converted,
    finetuning,
    frozen_layer_counts,
    is_frozen,
    packed_bias_names,
    packed_param_bytes,
    packed_weight_bytes,
    trainable_adapter_counts,
)
from trainfit.analytic.float8 import converted_weight_names
from trainfit.arch.params import ParamInventory, inventory
from trainfit.arch.spec import ModelSpec, ParamTensor
from trainfit.cuda_facts import ALLOCATOR_BLOCK_BYTES, BNB_MIN_8BIT_SIZE, allocator_bytes, quantized_weight_tensors
from trainfit.cuda_facts import BNB_OPTIM_BLOCK as BNB_BLOCK
from trainfit.strategy import Engine, LossImpl, Optimizer, OptimizerImpl, Strategy
from trainfit.units import round_up


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelStates:
    weights_bytes: int
    grads_bytes: int
    master_bytes: int
    optimizer_bytes: int
    step_temp_bytes: int  # transient, inside optimizer.step()
    autocast_copies_bytes: int  # all low-precision copies of matmul weights (AMP only)
    params: int
    trainable_params: int
    adapter_weights_bytes: int = 0  # LoRA/DoRA tensors (trainable; their grads and states are counted above)

    def per_param(self, n: int) -> float:
        return n / self.params if self.params else 0.0


def _alloc(numel: int, bits: int) -> int:
    return round_up(numel * bits // 8, ALLOCATOR_BLOCK_BYTES)


def _opt_state_bytes(t: ParamTensor, opt: Optimizer, state_bits: int, impl: OptimizerImpl) -> int:
    n = t.numel
    if opt is Optimizer.ADAMW:
        step = _alloc(1, 32) if impl is OptimizerImpl.FUSED else 0  # the fused kernel's device step counter
        return 2 * _alloc(n, state_bits) + step
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
        rms = _alloc(1, 32)  # state["RMS"], a 0-dim device tensor
        if len(t.shape) >= 2:
            rows = n // t.shape[-1]
            cols = n // t.shape[-2]
            return _alloc(rows, 32) + _alloc(cols, 32) + rms
        return _alloc(n, 32) + rms
    raise AssertionError(opt)  # pragma: no cover


def optimizer_state_tensors(t: ParamTensor, opt: Optimizer, state_bits: int, impl: OptimizerImpl) -> tuple[int, ...]:
    """The allocator-rounded state tensors ``opt`` keeps for parameter ``t``, one entry per tensor (their sum
    is :func:`_opt_state_bytes`): what an allocator simulation allocates when the states are created."""
    n = t.numel
    if opt is Optimizer.ADAMW:
        step = (_alloc(1, 32),) if impl is OptimizerImpl.FUSED else ()
        return (_alloc(n, state_bits), _alloc(n, state_bits), *step)
    if opt is Optimizer.ADAMW_8BIT:
        if n < BNB_MIN_8BIT_SIZE:
            return (_alloc(n, 32), _alloc(n, 32))
        blocks = -(-n // BNB_BLOCK)
        return (_alloc(n, 8), _alloc(blocks, 32), _alloc(n, 8), _alloc(blocks, 32))
    if opt is Optimizer.SGD:
        return ()
    if opt in (Optimizer.SGD_MOMENTUM, Optimizer.LION):
        return (_alloc(n, state_bits),)
    if opt is Optimizer.ADAFACTOR:
        if len(t.shape) >= 2:
            return (_alloc(n // t.shape[-1], 32), _alloc(n // t.shape[-2], 32), _alloc(1, 32))
        return (_alloc(n, 32), _alloc(1, 32))
    raise AssertionError(opt)  # pragma: no cover


#: bitsandbytes' two shared quantisation maps ("dynamic", "udynamic"): 256 fp32 entries each.
BNB_QMAPS_BYTES = 2 * _alloc(256, 32)


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


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamState:
    """How one parameter tensor (times ``count`` identical ones) is held: its stored bytes, and whether it
    trains (then it has a gradient, a master copy under master-* recipes, and optimizer states)."""

    tensor: ParamTensor
    count: int
    weight_bytes: int  # per tensor, allocator-rounded (every piece of a quantised tensor rounded)
    trainable: bool
    autocast_copy: bool  # autocast caches a 16-bit copy of it
    bits: int = 0  # its own dtype width when it differs from the recipe's (adapters); 0: the recipe's
    adapter: bool = False  # an adapter tensor (LoRA A/B, DoRA magnitude)
    #: The parameter's own storage as ``named_parameters`` holds it, unrounded (a packed 4-bit or LLM.int8 weight:
    #: its uint8/int8 data alone; the quantisation state is not a parameter), and its element width in bits (what
    #: groups it by dtype in a coalesced collective: :func:`trainfit.analytic.parallel.ddp_broadcast_bytes`).
    param_bytes: int
    param_bits: int


#: :func:`param_states` of recent (spec, strategy) pairs: one estimate asks for them several times.
_PARAM_STATES: Memo[tuple[ParamState, ...]] = Memo(256)


def param_states(spec: ModelSpec, strategy: Strategy) -> tuple[ParamState, ...]:
    """Every parameter tensor of ``spec`` under ``strategy``'s trainable mask and per-tensor formats (memoized)."""
    return _PARAM_STATES.get((spec_key(spec), strategy), lambda: _param_states(spec, strategy))


def _param_states(spec: ModelSpec, strategy: Strategy) -> tuple[ParamState, ...]:
    if finetuning(strategy):
        return finetune_param_states(spec, strategy)
    r = strategy.recipe
    base = strategy.base_weights
    full = strategy.trains_every_weight
    quant = base.quantization.dtype
    inv = inventory(spec)
    out: list[ParamState] = []
    layer_tensors = {id(t) for g in inv.layers for t in g.tensors}
    # torchao's Float8Linear casts its weight straight to fp8, never to bf16: no autocast copy (analytic.float8).
    fp8 = converted_weight_names(spec, strategy)
    for t, m in inv.all_tensors():
        trainable = full
        packed = quant is not None and not trainable and bnb_converted(t) and id(t) in layer_tensors
        if packed:
            assert quant is not None
            pieces = quantized_weight_tensors(t.numel, t.shape[0], quant.value, double_quant=base.double_quant)
            weight, own, bits = sum(allocator_bytes(n) for n in pieces), pieces[0], 8
        else:
            bits = r.weight_bits if trainable or base.dtype is None else base.dtype.bits
            weight, own = _alloc(t.numel, bits), t.numel * bits // 8
        out.append(
            ParamState(
                tensor=t,
                count=m,
                weight_bytes=weight,
                trainable=trainable,
                autocast_copy=r.autocast and t.matmul and not packed and not (id(t) in layer_tensors and t.name in fp8),
                param_bytes=own,
                param_bits=bits,
            )
        )
    return tuple(out)


def finetune_param_states(spec: ModelSpec, strategy: Strategy) -> tuple[ParamState, ...]:
    """The per-tensor rule under an adapter or ``--freeze`` patterns (:mod:`trainfit.analytic.adapters`).

    A frozen tensor is stored in ``BaseWeights.dtype`` (else the recipe's weight width); a frozen layer linear
    of a quantised base is packed (bitsandbytes bytes, :func:`trainfit.cuda_facts.quantized_weight_tensors`);
    after ``prepare_model_for_kbit_training`` every other 16-bit tensor is fp32 (peft/utils/other.py). Adapter
    tensors train in the adapter dtype (``ParamState.bits``). Autocast keeps a 16-bit copy of every matmul
    weight wider than it computes: cached for trainable leaves, cast per call (and saved by the matmul for
    the input gradient) for frozen ones."""
    r = strategy.recipe
    base = strategy.base_weights
    quant = base.quantization.dtype
    inv = inventory(spec)
    adapter = strategy.adapter
    out: list[ParamState] = []

    # Linear4bit.forward casts its bias to the compute dtype on the first call, for good (bitsandbytes/nn/modules.py:
    # ``bias.data = bias.data.to(x.dtype)`` after ``x.to(compute_dtype)``): a 4-bit layer's bias is that wide.
    bias_4bit = packed_bias_names(spec) if quant is not None and quant.bits == 4 else frozenset()

    def frozen_bits(t: ParamTensor, *, after_first_call: bool = True) -> int:
        if after_first_call and t.name in bias_4bit:
            return r.compute_bits
        bits = r.weight_bits if base.dtype is None else base.dtype.bits
        return 32 if base.kbit_prepared and bits == 16 else bits

    def add(t: ParamTensor, count: int, *, trainable: bool, in_layer: bool) -> None:
        if count == 0:
            return
        packed = quant is not None and not trainable and bnb_converted(t) and in_layer
        if packed:
            assert quant is not None
            weight = packed_weight_bytes(spec, t, quant.value, double_quant=base.double_quant)
            own, own_bits = packed_param_bytes(spec, t, quant.value), 8
            bits = quant.bits
        else:
            bits = r.weight_bits if trainable else frozen_bits(t)
            weight = _alloc(t.numel, bits)
            # before the first forward (DDP's construction broadcast) a 4-bit layer's bias still has the width
            # prepare_model_for_kbit_training left it
            own_bits = bits if trainable or t.name not in bias_4bit else frozen_bits(t, after_first_call=False)
            own = t.numel * own_bits // 8
        out.append(
            ParamState(
                tensor=t,
                count=count,
                weight_bytes=weight,
                trainable=trainable,
                autocast_copy=r.autocast and t.matmul and not packed and bits > r.compute_bits,
                param_bytes=own,
                param_bits=own_bits,
            )
        )

    patterns = base.frozen
    for t in inv.model_tensors:
        frozen = adapter is not None or is_frozen(t, patterns, None, layers=spec.num_layers)
        add(t, 1, trainable=not frozen, in_layer=False)
    for g in inv.layers:
        for t in g.tensors:
            n_frozen = g.count if adapter is not None else frozen_layer_counts(spec, patterns, g, t)
            add(t, n_frozen, trainable=False, in_layer=True)
            add(t, g.count - n_frozen, trainable=True, in_layer=True)
    if adapter is not None:
        bits = adapter.dtype.bits
        for t, count in trainable_adapter_counts(spec, adapter):
            out.append(
                ParamState(
                    tensor=t,
                    count=count,
                    weight_bytes=_alloc(t.numel, bits),
                    trainable=True,
                    autocast_copy=r.autocast and t.matmul and bits > r.compute_bits,
                    bits=bits,
                    adapter=True,
                    param_bytes=t.numel * bits // 8,
                    param_bits=bits,
                )
            )
    return tuple(out)


def model_states(spec: ModelSpec, strategy: Strategy) -> ModelStates:
    if finetuning(strategy):
        return finetune_model_states(spec, strategy)
    r = strategy.recipe
    opt = strategy.optimizer
    # Optimizer states are created like the tensor the optimizer updates: the fp32 master copy if any.
    state_bits = 32 if r.master_bits else r.state_bits
    inv: ParamInventory = inventory(spec)
    largest_any = max((t.numel for t, _ in inv.all_tensors()), default=0)

    if spec.params_override is not None:
        p = trainable_p = spec.params_override
        matmul_p = int(p * inv.matmul_params / inv.total) if inv.total else p
        weights = p * r.weight_bits // 8
        grads = p * r.grad_bits // 8
        master = p * r.master_bits // 8
        optim = int(p * _per_param_bits(opt, state_bits) / 8)
        copies = matmul_p * r.compute_bits // 8 if r.autocast else 0
        # No shapes: the state-sized lists are unrounded, the largest tensor is the inventory's.
        list_state = p * state_bits // 8
        list_fp32 = p * 4
        largest = largest_any
    else:
        states = param_states(spec, strategy)
        trained = [(x.tensor, x.count) for x in states if x.trainable]
        p = inv.total
        trainable_p = sum(t.numel * m for t, m in trained)
        weights = sum(x.count * x.weight_bytes for x in states)
        grads = sum(m * _alloc(t.numel, r.grad_bits) for t, m in trained)
        master = sum(m * _alloc(t.numel, r.master_bits) for t, m in trained) if r.master_bits else 0
        impl = strategy.optimizer_impl
        optim = sum(m * _opt_state_bytes(t, opt, state_bits, impl) for t, m in trained)
        if opt is Optimizer.ADAMW_8BIT and any(t.numel >= BNB_MIN_8BIT_SIZE for t, _ in trained):
            optim += BNB_QMAPS_BYTES
        copies = sum(x.count * _alloc(x.tensor.numel, r.compute_bits) for x in states if x.autocast_copy)
        list_state = sum(m * _alloc(t.numel, state_bits) for t, m in trained)
        list_fp32 = sum(m * _alloc(t.numel, 32) for t, m in trained)
        largest = max((t.numel for t, _ in trained), default=0)

    temp = _step_temp_bytes(strategy, list_state, list_fp32, largest, state_bits)
    return ModelStates(
        weights_bytes=weights,
        grads_bytes=grads,
        master_bytes=master,
        optimizer_bytes=optim,
        step_temp_bytes=temp,
        autocast_copies_bytes=copies,
        params=p,
        trainable_params=trainable_p,
    )


def _step_temp_bytes(strategy: Strategy, list_state: int, list_fp32: int, largest: int, state_bits: int) -> int:
    """``optimizer.step()``'s temporaries (see the module docstring): ``list_state``/``list_fp32`` are the
    trainable tensors' state-sized and fp32-sized lists, ``largest`` the largest trainable tensor."""
    r = strategy.recipe
    opt = strategy.optimizer
    temp = 0
    if opt is Optimizer.ADAMW and strategy.optimizer_impl is OptimizerImpl.FOREACH:
        temp += list_state  # foreach sqrt(exp_avg_sq): one tensor per parameter, all alive at once
    elif opt is Optimizer.LION:
        temp += 2 * _alloc(largest, state_bits)  # exp_avg.clone() and the out-of-place add
    elif opt is Optimizer.ADAFACTOR:
        # 2 fp32 update tensors; a 16-bit parameter adds grad.float() and p.float() (an fp32 master: none).
        updated_bits = 32 if r.master_bits else r.weight_bits
        temp += (2 if updated_bits == 32 else 4) * _alloc(largest, 32)
    if r.master_bits:
        temp += list_fp32  # fp32 copies of the 16-bit grads for the fp32 master parameters
    return temp


def tensor_step_temp_bytes(strategy: Strategy, t: ParamTensor, state_bits: int) -> int:
    """The temporaries of ``optimizer.step()`` over the one tensor ``t`` (torchtune's optimizer in backward: one
    optimizer per parameter, ``register_optim_in_bwd_hooks``): :func:`_step_temp_bytes` over a list of one — under
    foreach AdamW its ``sqrt(exp_avg_sq)``, as the traced hook shows. No master weights (refused with it)."""
    return _step_temp_bytes(strategy, _alloc(t.numel, state_bits), 0, t.numel, state_bits)


def trained_widths(strategy: Strategy, x: ParamState) -> tuple[int, int, int]:
    """(gradient, master, optimizer-state) bits of one trainable tensor: the recipe's, or for a tensor held in its own
    dtype (an adapter) that dtype's — its gradient (autograd makes a parameter's gradient in its dtype), an fp32
    master only under a master-* recipe when it is 16-bit, and states like the tensor the optimizer updates
    (torch/optim/adam.py ``_init_group``: ``zeros_like(p)``)."""
    r = strategy.recipe
    if not x.bits:
        return r.grad_bits, r.master_bits, 32 if r.master_bits else r.state_bits
    master = 32 if r.master_bits and x.bits < 32 else 0
    return x.bits, master, 32 if master else x.bits


def finetune_model_states(spec: ModelSpec, strategy: Strategy) -> ModelStates:
    """Model states under an adapter or ``--freeze``: only trainable tensors have gradients, master copies and
    optimizer states. An adapter tensor is held in its own dtype: its gradient too (autograd makes a
    parameter's gradient in its dtype), a master copy only under a master-* recipe when it is 16-bit, and
    states like the tensor the optimizer updates (torch/optim/adam.py ``_init_group``: ``zeros_like(p)``)."""
    r = strategy.recipe
    opt = strategy.optimizer
    impl = strategy.optimizer_impl
    states = param_states(spec, strategy)
    trained = [x for x in states if x.trainable]

    def widths(x: ParamState) -> tuple[int, int, int]:
        return trained_widths(strategy, x)

    grads = master = optim = list_state = list_fp32 = 0
    for x in trained:
        g, mb, sb = widths(x)
        n, m = x.tensor.numel, x.count
        grads += m * _alloc(n, g)
        master += m * _alloc(n, mb) if mb else 0
        optim += m * _opt_state_bytes(x.tensor, opt, sb, impl)
        list_state += m * _alloc(n, sb)
        list_fp32 += m * _alloc(n, 32) if mb else 0
    if opt is Optimizer.ADAMW_8BIT and any(x.tensor.numel >= BNB_MIN_8BIT_SIZE for x in trained):
        optim += BNB_QMAPS_BYTES
    state_bits = max((widths(x)[2] for x in trained), default=32)
    largest = max((x.tensor.numel for x in trained), default=0)
    temp = _step_temp_bytes(strategy, list_state, list_fp32 if r.master_bits else 0, largest, state_bits)
    base_params = inventory(spec).total
    return ModelStates(
        weights_bytes=sum(x.count * x.weight_bytes for x in states if not x.adapter),
        grads_bytes=grads,
        master_bytes=master,
        optimizer_bytes=optim,
        step_temp_bytes=temp,
        autocast_copies_bytes=sum(x.count * _alloc(x.tensor.numel, r.compute_bits) for x in states if x.autocast_copy),
        params=base_params,
        trainable_params=sum(x.tensor.numel * x.count for x in trained),
        adapter_weights_bytes=sum(x.count * x.weight_bytes for x in states if x.adapter),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class FinetuneParts:
    """Per-layer and model-level pieces of the states that the step's moments need under fine-tuning."""

    grad_layer_bytes: int  # one layer's trainable gradients (adapters included), the largest layer's
    grad_head_bytes: int  # the LM head's (or tied table's) gradient, 0 when frozen
    grad_late_bytes: int  # the untied token table's gradient, 0 when frozen
    copies_layer_bytes: int  # one layer's autocast weight copies
    cached_copies_layer_bytes: int  # of which autocast caches (trainable leaves) for the whole forward
    copies_head_bytes: int  # the copies outside the layer stack


def finetune_parts(spec: ModelSpec, strategy: Strategy) -> FinetuneParts:
    """Split :func:`finetune_param_states` into what one layer and the head contribute (gradients in the
    tensor's own dtype, autocast copies in the compute dtype)."""
    r = strategy.recipe
    inv = inventory(spec)
    layers = max(1, sum(g.count for g in inv.layers))
    model_ids = {id(t) for t in inv.model_tensors}
    grad_layer = grad_head = grad_late = copies_layer = copies_head = cached = 0
    for x in param_states(spec, strategy):
        t = x.tensor
        copy = _alloc(t.numel, r.compute_bits) if x.autocast_copy else 0
        grad = _alloc(t.numel, x.bits or r.grad_bits) if x.trainable else 0
        if id(t) in model_ids or t.name.startswith(("embed", "lm_head", "final_norm")):
            copies_head += copy
            if t.name.startswith("lm_head") or (spec.tie_word_embeddings and t.name == "embed_tokens.weight"):
                grad_head += grad
            elif t.name == "embed_tokens.weight":
                grad_late += grad
        else:
            copies_layer += x.count * copy
            cached += x.count * copy if x.trainable else 0
            grad_layer += grad  # the largest layer: one trainable copy of each tensor
    return FinetuneParts(
        grad_layer_bytes=grad_layer,
        grad_head_bytes=grad_head,
        grad_late_bytes=grad_late,
        copies_layer_bytes=copies_layer // layers,
        cached_copies_layer_bytes=cached // layers,
        copies_head_bytes=copies_head,
    )


def optimizer_state_bytes(t: ParamTensor, opt: Optimizer, state_bits: int, impl: OptimizerImpl) -> int:
    """Optimizer-state bytes of one parameter tensor (or shard of one), as :func:`model_states` counts them."""
    return _opt_state_bytes(t, opt, state_bits, impl)


@dataclass(frozen=True, slots=True, kw_only=True)
class TiedGradientSum:
    """The end of backward of a model whose LM head is its token table: the table's two dense gradients meet."""

    embedding_grad_bytes: int  # the embedding's own dense gradient (``embedding_dense_backward``), transient
    out_of_place_bytes: int  # the sum's new tensor when autograd cannot add in place; 0 when it adds in place


def tied_gradient_sum(spec: ModelSpec, strategy: Strategy) -> TiedGradientSum | None:
    """How autograd adds a trainable tied table's two gradients (None: no tied trainable table).

    The head's gradient arrives first and waits in the table's ``AccumulateGrad`` input buffer; the embedding's
    arrives last. torch/csrc/autograd/input_buffer.cpp ``accumulate`` adds in place (``old_var.add_(var)``) only
    when grad mode is off and ``can_accumulate_inplace(old_var)``: a plain dense tensor holding the last
    reference to its TensorImpl and to its storage; otherwise ``old_var + var`` allocates a third table while both
    are alive. ``InputBuffer::add`` picks only the stream by device (CUDA: the consumer's; CPU: none) and calls
    the same ``accumulate``, so CUDA decides like a real CPU run. Which gradient is buffered decides it:

    * the head's matmul reads the table itself (no autocast cast: fp32, pure-/master-16-bit recipes): ``F.linear``
      multiplies by ``weight.t()``, whose column-major layout makes ``mm_mat2_backward``
      (torch/csrc/autograd/FunctionsManual.cpp) return ``grad.t().mm(mat1).t()`` and ``TBackward0`` transposes
      it back: a view, whose base keeps a second reference to the storage → **out of place**;
    * autocast casts a wider table (amp recipes): ``ToCopyBackward0`` casts that view into a fresh tensor → in
      place; Liger's fused linear cross-entropy returns its own ``grad_weight`` → in place; a chunked loss's
      first two chunk gradients are summed out of place into a fresh tensor, into which the embedding's is added
      → in place.

    Checked: the fake-tensor trace replays exactly this rule (trainfit.trace.tracker
    ``merge_inplace_accumulations``), and tests/trace/test_real_cpu.py holds the trace to a real CPU run of a
    tied table; the GPU check is benchmarks/gpu_session.py ``tied``.
    """
    if not (spec.tie_word_embeddings and spec.kind.has_vocab_logits):
        return None
    table = next((x for x in param_states(spec, strategy) if x.tensor.name == "embed_tokens.weight"), None)
    if table is None or not table.trainable:
        return None
    grad = _alloc(table.tensor.numel, table.bits or strategy.recipe.grad_bits)
    sv = strategy.savers
    fresh = (
        table.autocast_copy or sv.loss is LossImpl.FUSED_LINEAR or (sv.loss is LossImpl.CHUNKED and sv.loss_chunks > 1)
    )
    return TiedGradientSum(embedding_grad_bytes=grad, out_of_place_bytes=0 if fresh else grad)


def tied_sum_modelled(strategy: Strategy) -> bool:
    """Whether :func:`tied_gradient_sum`'s rule holds under ``strategy``'s framework: one GPU, and data
    parallelism (DDP's, FSDP2's and ZeRO's hooks fire on the table's ``AccumulateGrad``, after autograd's sum:
    their traces, tests/trace/test_tied_many_gpus.py). Tensor parallelism refuses a tied table and Megatron's
    layers write ``main_grad`` themselves: those keep the in-place form."""
    par = strategy.parallelism
    return par.tensor == 1 and par.pipeline == 1 and strategy.engine.engine is not Engine.MEGATRON

"""FP8 training of the blocks' linears (``--fp8 tensorwise``): torchao ``Float8Linear`` as torchtitan runs it.

torchtitan's float8 converter (torchtitan/components/quantization/float8.py, ``Float8LinearConverter``) calls
torchao's ``convert_to_float8_training`` with ``module_filter_fn`` (components/quantization/utils.py): an
``nn.Linear`` is swapped only when both weight dims are multiples of 16 and its FQN matches no ``filter_fqns``
entry (the LM head, ``output``, is left in bf16). Here: the decoder blocks' linears with both dims ÷ 16.

What a ``Float8Linear`` (torchao 0.18, torchao/float8/float8_linear.py) holds, eager, tensorwise scaling:

* **Saved for backward**: ``matmul_with_hp_or_float8_args.forward`` calls ``ctx.save_for_backward(input_hp,
  weight_hp_t)`` — the *high-precision* input and the weight's transposed view. No fp8 tensor is saved: the
  backward casts again. So the saved activations are exactly a bf16 linear's. Under ``torch.autocast``
  ``Float8Linear.forward`` casts the input with ``input.to(autocast_dtype)`` (one copy per linear, like
  autocast's uncached activation casts) and never casts the fp32 weight to bf16: the converted linears have no
  cached autocast weight copies (the fp32 parameter's view is what is saved).
* **One cast** (``hp_tensor_to_float8_dynamic`` → ``tensor_to_scale``: ``torch.max(torch.abs(x))`` in x's
  dtype, then ``_ToFloat8ConstrFunc.forward``: ``tensor_scaled = tensor.to(float32) * scale`` and
  ``to_fp8_saturated``: ``x.clamp(...)`` then ``.to(float8)``) has ``tensor_scaled`` (4 B/elem), the clamped
  copy (4 B/elem) and the fp8 result (1 B/elem) alive at once: 9 bytes per element at its peak, 1 after
  (:func:`cast_peak_bytes`). ``torch.compile`` fuses this into one kernel; trainfit models eager execution
  (what its trace runs), an upper bound for a compiled run.
* **Forward** (input x: t × k, weight n × k): the input's cast, then the weight's with the fp8 input held;
  ``torch._scaled_mm`` then reads both (``float8_ops.preprocess_addmm``: the weight's fp8 copy is column-major
  already, no copy). Extra beyond a bf16 linear: max(9·t·k, t·k + 9·n·k).
* **Backward** (``matmul_with_hp_or_float8_args.backward``; every fp8 tensor is a local that lives until it
  returns): grad_output cast (9·t·n), the weight cast again (t·n + 9·n·k), grad_input's ``_scaled_mm`` (b is
  the row-major ``w8.t()``: ``preprocess_addmm`` copies it column-major, + n·k), grad_output cast again for
  grad_weight (10·t·n + n·k), the input cast (2·t·n + n·k + 9·t·k), grad_weight's ``_scaled_mm`` (a =
  ``go8.t()`` is column-major: ``.contiguous()`` copies it, + t·n; b = the row-major x8 copied, + t·k):
  3·t·n + n·k + 2·t·k. The peak is the largest of these (:func:`linear_backward_extra`).

Many GPUs (torch DDP, FSDP2, HSDP): :mod:`trainfit.analytic.parallel` builds a rank's moments from its compute
strategy (``compute_strategy`` keeps ``float8``), so the same terms apply with bf16 weights under FSDP2.

Not modelled (refused with one line): rowwise scaling, ``torch.compile``, FSDP2's fp8 all-gather
(``enable_fsdp_float8_all_gather``: ``WeightWithDynamicFloat8CastTensor``), ZeRO, tensor/pipeline parallelism,
offload, MoE experts (torchtitan converts them separately), MLA, fused qkv projections, non-gated MLPs (GPT-2's
``Conv1D`` is no ``nn.Linear``), per-op SAC.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from trainfit.arch.params import inventory
from trainfit.arch.spec import MlpKind, ModelSpec
from trainfit.errors import StrategyError
from trainfit.strategy import Checkpointing, Float8, Strategy

#: torchtitan ``module_filter_fn``: "All dims must be divisible by 16 due to float8 tensorcore hardware
#: requirements."
FLOAT8_DIM_MULTIPLE = 16
#: Bytes per element of one eager dynamic cast at its peak: fp32 scaled (4) + fp32 clamped (4) + fp8 (1).
CAST_PEAK_BYTES_PER_ELEMENT = 9


@dataclass(frozen=True, slots=True, kw_only=True)
class Float8Linear:
    """One linear of a block: its weight's name, in/out features, and whether torchtitan's filter converts it."""

    name: str
    in_features: int
    out_features: int
    converted: bool


def enabled(strategy: Strategy) -> bool:
    return strategy.float8 is not Float8.NONE


def check_float8(spec: ModelSpec, strategy: Strategy) -> None:
    """Refuse, in one line, the models and settings fp8 linears are not modelled for."""
    if not enabled(strategy):
        return
    why = ""
    if spec.moe is not None or spec.num_moe_layers:
        why = "MoE layers (torchtitan converts experts with a separate grouped-GEMM converter)"
    elif spec.mla is not None:
        why = "multi-head latent attention"
    elif spec.fused_qkv or spec.mlp is not MlpKind.GATED:
        why = "fused qkv projections or non-gated MLPs (modelled: Llama-style q/k/v/o + gate/up/down linears)"
    elif spec.params_override is not None:
        why = "a --params what-if model (the linears' shapes are needed)"
    elif strategy.checkpointing is Checkpointing.SAC:
        why = "--checkpointing sac (its save list names bf16 matmuls)"
    elif not any(x.converted for x in block_linears(spec)):
        why = f"{spec.name}: no block linear has both dims divisible by {FLOAT8_DIM_MULTIPLE}"
    if why:
        raise StrategyError(f"--fp8 {strategy.float8.value} is not modelled for {why}")


def block_linears(spec: ModelSpec) -> tuple[Float8Linear, ...]:
    """The linear weights of one (the first) block, in forward order, with torchtitan's filter applied."""
    out: list[Float8Linear] = []
    for t in inventory(spec).layers[0].tensors:
        if not t.matmul or len(t.shape) != 2:
            continue
        n, k = t.shape
        ok = n % FLOAT8_DIM_MULTIPLE == 0 and k % FLOAT8_DIM_MULTIPLE == 0
        out.append(Float8Linear(name=t.name, in_features=k, out_features=n, converted=ok))
    return tuple(out)


def converted_weight_names(spec: ModelSpec, strategy: Strategy) -> frozenset[str]:
    """Names (as :func:`trainfit.arch.params.inventory` spells them) of the layer weights fp8 linears replace."""
    if not enabled(strategy):
        return frozenset()
    return frozenset(x.name for x in block_linears(spec) if x.converted)


def cast_peak_bytes(numel: int) -> int:
    """Live bytes at the peak of one eager dynamic float8 cast of ``numel`` elements (besides its input):
    torchao/float8/float8_training_tensor.py ``_ToFloat8ConstrFunc.forward`` (``tensor.to(float32) * scale``)
    and float8_utils.py ``to_fp8_saturated`` (``clamp`` then ``.to(float8)``) — 4 + 4 + 1 bytes per element."""
    return CAST_PEAK_BYTES_PER_ELEMENT * numel


def linear_forward_extra(t: int, k: int, n: int) -> int:
    """Bytes beyond a bf16 linear's at the peak of a ``Float8Linear`` forward over t tokens, k → n features:
    the input's cast, then the weight's with the fp8 input (t·k bytes) held (module docstring)."""
    return max(cast_peak_bytes(t * k), t * k + cast_peak_bytes(n * k))


def linear_backward_extra(t: int, k: int, n: int) -> int:
    """Bytes beyond a bf16 linear's backward (grad_output and the saved input present, grad_input counted as
    any linear's) at the peak of ``matmul_with_hp_or_float8_args.backward`` (module docstring)."""
    tn, nk, tk = t * n, n * k, t * k
    return max(
        cast_peak_bytes(tn),  # grad_output → e5m2 for grad_input
        tn + cast_peak_bytes(nk),  # weight → e4m3 again
        tn + 2 * nk,  # grad_input = go8 @ w8.t(): preprocess_addmm copies the row-major w8.t()
        tn + nk + cast_peak_bytes(tn),  # grad_output cast again for grad_weight (go8 and w8 still held)
        2 * tn + nk + cast_peak_bytes(tk),  # input → e4m3 again
        3 * tn + nk + 2 * tk,  # grad_weight = go8.t() @ x8: both operands copied to the layout _scaled_mm needs
    )


def layer_forward_extra(spec: ModelSpec, strategy: Strategy) -> int:
    """The largest fp8 forward transient among one block's converted linears."""
    return _worst(spec, strategy, linear_forward_extra)


def layer_backward_extra(spec: ModelSpec, strategy: Strategy) -> int:
    """The largest fp8 backward transient among one block's converted linears."""
    return _worst(spec, strategy, linear_backward_extra)


def _worst(spec: ModelSpec, strategy: Strategy, extra: Callable[[int, int, int], int]) -> int:
    if not enabled(strategy):
        return 0
    t = strategy.tokens_per_micro_batch
    return max((extra(t, x.in_features, x.out_features) for x in block_linears(spec) if x.converted), default=0)

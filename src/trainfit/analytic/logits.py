"""Logits and the loss: the largest single term for 128k–256k vocabularies.

HF causal-LM losses (transformers ``loss/loss_utils.py``, ``ForCausalLMLoss``) upcast the logits with
``logits.float()`` and call ``cross_entropy`` = ``log_softmax`` + ``nll_loss``. With ``V = b·s·vocab``:

* forward, inside the loss: 16-bit logits (a·V) + their fp32 copy (4·V, none in fp32) + the saved
  log-softmax output (4·V);
* backward, at ``log_softmax_backward``: the saved output, the gradient from ``nll_loss`` (dense,
  4·V) and the gradient it produces (4·V): 12·V.

BERT's masked-LM loss applies ``CrossEntropyLoss`` to the logits directly: under autocast 16-bit log-probs
and nll_loss's fp32 copy of them (2·a·V + 4·V; see the code for the sources).
Gemma-2's final soft-cap (``tanh(logits / cap) * cap``) keeps tanh's output (a·V) in both phases.
The HF Trainer drops the model outputs before ``backward()``, so the 16-bit logits are not alive in
backward; a loop that keeps ``outputs`` alive adds a·V there (``keep_logits``).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainfit.arch.spec import ModelKind, ModelSpec
from trainfit.strategy import Strategy


@dataclass(frozen=True, slots=True, kw_only=True)
class LogitsMemory:
    forward_peak_bytes: int
    backward_peak_bytes: int
    logits_bytes: int


def logits_width(strategy: Strategy) -> int:
    """Bytes per element of the LM head's output: the compute dtype under autocast; without it the head weight's
    dtype, which is the residual stream's (:func:`~trainfit.analytic.activations.residual_bits`) — the recipe's, or
    under an adapter the frozen base's. ``prepare_model_for_kbit_training`` (peft/utils/other.py) casts every
    parameter that is not 4-bit, the LM head too, to fp32, so QLoRA under a pure 16-bit recipe makes fp32 logits and
    no upcast copy (found by the trace of real bitsandbytes layers: the closed form was 501 MiB over it on
    llama-3.2-1b at 2 × 1024 tokens)."""
    from trainfit.analytic.activations import residual_bits

    if strategy.recipe.autocast:
        return strategy.recipe.compute_bits // 8
    return residual_bits(strategy) // 8


def logits_memory(spec: ModelSpec, strategy: Strategy, *, keep_logits: bool = False) -> LogitsMemory:
    a = strategy.recipe.compute_bits // 8
    if not spec.kind.has_vocab_logits:
        return classifier_logits_memory(spec, strategy, keep_logits=keep_logits)
    n = strategy.tokens_per_micro_batch * spec.vocab_size
    if spec.kind is ModelKind.MASKED_LM:
        # BERT: CrossEntropyLoss on the logits as they are (no .float()). cross_entropy_loss has no CUDA
        # autocast kernel and decomposes (aten/src/ATen/native/LossNLL.cpp ``cross_entropy_loss_symint``:
        # ``nll_loss_nd(log_softmax(self, class_dim, self.scalar_type()))``): log_softmax gets an explicit
        # dtype, so fp32_set_opt_dtype keeps it 16-bit (a·n, saved by LogSoftmaxBackward), and nll_loss is
        # on autocast's fp32 list (autocast_mode.h AT_FORALL_FP32), so it reads an fp32 copy of that output
        # (4·n), which NllLossBackward keeps (nll_loss_backward takes ``self``). Forward end: 16-bit logits +
        # 16-bit log-probs + their fp32 copy. Backward at nll_loss_backward: the copy, the log-probs and the
        # dense fp32 gradient. Without autocast all of it is in the weights' dtype, no copy (backward: the
        # log-probs, nll_loss's gradient and log_softmax's).
        cast = 4 * n if strategy.recipe.autocast and a != 4 else 0
        forward = a * n + a * n + cast
        backward = cast + a * n + (4 * n if cast else 2 * a * n) + (a * n if keep_logits else 0)
    else:
        a = logits_width(strategy)
        upcast = 4 * n if a != 4 else 0
        forward = a * n + upcast + 4 * n
        backward = 12 * n + (a * n if keep_logits else 0)
    if spec.final_logit_softcapping:
        # logits = tanh(logits / cap) * cap: tanh saves its output for backward (Gemma-2).
        forward += a * n
        backward += a * n
    return LogitsMemory(forward_peak_bytes=forward, backward_peak_bytes=backward, logits_bytes=a * n)


def classifier_logits_memory(spec: ModelSpec, strategy: Strategy, *, keep_logits: bool = False) -> LogitsMemory:
    """Logits and loss of a classification head (trainfit.arch.heads): ``num_labels`` wide, never vocabulary-wide.

    ``token-cls`` (transformers ``loss_utils.py`` ``ForTokenClassification``: ``logits.float()`` then
    cross-entropy) has the causal-LM forms with ``V = t·num_labels``. ``seq-cls`` on a decoder
    (``GenericForSequenceClassification``) computes ``t·num_labels`` logits, picks one row per sequence
    (b·num_labels) and takes cross-entropy of those without an upcast (``ForSequenceClassificationLoss``);
    its backward scatters the picked gradient into a zero ``t·num_labels`` tensor. BERT's ``seq-cls`` has only
    the b·num_labels logits. ``none`` has no logits (the loss is the caller's).
    """
    from trainfit.analytic.activations import residual_bits
    from trainfit.arch.heads import is_encoder

    a = strategy.recipe.compute_bits // 8
    t, b, nl = strategy.tokens_per_micro_batch, strategy.micro_batch, spec.num_labels
    lsm = 4 if strategy.recipe.autocast else a  # log_softmax runs in fp32 under CUDA autocast
    if spec.kind is ModelKind.TOKEN_CLS:
        n = t * nl
        forward = a * n + (4 * n if a != 4 else 0) + 4 * n
        backward = 12 * n + (a * n if keep_logits else 0)
        return LogitsMemory(forward_peak_bytes=forward, backward_peak_bytes=backward, logits_bytes=a * n)
    if spec.kind is ModelKind.SEQ_CLS:
        full = 0 if is_encoder(spec) else a * t * nl
        n = b * nl
        forward = full + a * n + lsm * n
        backward = 2 * lsm * n + a * n + full + (a * n if keep_logits else 0)
        return LogitsMemory(forward_peak_bytes=forward, backward_peak_bytes=backward, logits_bytes=a * n)
    # none: the model's output (last_hidden_state, the residual stream's width) is alive while the loss reduces it.
    out = strategy.tokens_per_micro_batch * spec.hidden_size * (residual_bits(strategy) // 8)
    return LogitsMemory(forward_peak_bytes=out, backward_peak_bytes=0, logits_bytes=0)

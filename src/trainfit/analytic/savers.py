"""Memory savers (``Strategy.savers``, ``--checkpointing selective``): closed forms, one per saver, applied to the
step's inputs and moments of :mod:`trainfit.analytic.model` without touching the arithmetic of a step that uses
none of them. With ``V = t·vocab`` logits elements, ``a`` the compute width and ``r`` the residual width:

* **Chunked cross-entropy** (torchtune ``torchtune/modules/loss/ce_chunked_output_loss.py``
  ``CEWithChunkedOutputLoss.forward``: the model returns its logits in N chunks of the sequence, each chunk is
  upcast with ``.float()`` and passed to ``cross_entropy`` on its own). Every chunk's log-softmax output is still
  saved for backward (4·V in all); only the fp32 *copy* is one chunk at a time: forward a·V + 4·V + 4·V/N (instead
  of a·V + 8·V); backward, inside the first chunk's log-softmax backward, 4·V + 8·V/N (instead of 12·V) — or
  later, once every chunk's loss backward has run (autograd visits nodes by decreasing sequence number, and every
  loss node is younger than every head matmul; the saved log-softmax outputs are gone, the a·V logits gradients
  wait): at the head's second per-chunk matmul backward, a·V·(N−2)/N + 3·a·vocab·h. The first chunk's weight
  gradient waits in autograd's buffer as a view (``mm_mat2_backward`` in torch/csrc/autograd/FunctionsManual.cpp
  returns ``grad.t().mm(mat1).t()`` for ``F.linear``'s ``weight.t()``, ``TBackward0`` transposes it back), so
  input_buffer.cpp ``accumulate`` cannot add the second in place: both and their sum are alive (the rule of
  :func:`trainfit.analytic.states.tied_gradient_sum`); later sums go in place into that fresh tensor. Under
  autocast the chunks' gradients meet the same way in the buffer of the cached 16-bit copy's ``ToCopyBackward0``.
* **Fused linear cross-entropy** (Liger-Kernel ``src/liger_kernel/ops/fused_linear_cross_entropy.py``
  ``fused_linear_cross_entropy_forward``): no logits tensor at all. The forward walks the tokens in chunks of
  c = next_pow2(⌈t / ⌈vocab/h⌉⌉) (so one chunk's logits, c·vocab, are about t·h), computes the loss and, already
  in the forward, the gradients: ``grad_input`` (t·h in the input's dtype, saved instead of the head's input) and
  ``grad_weight`` (the head's gradient, ``zeros_like(weight)``, present from the forward on). What remains: one
  chunk's a·c·vocab logits, its c·h input-gradient product, the fp32 per-token loss (4·t), ``grad_input`` and
  ``grad_weight``. Under autocast (fp32 weights) the head's 16-bit weight copy is saved by nothing: autocast's
  cached copy (``grad_logits @ weight``) lives only to the end of the forward, and each chunk's
  ``x @ weight.t()`` makes one more (a transposed view is not a leaf, so not cached): 2·a·vocab·h in the forward,
  none in the backward (found by the trace, trainfit.trace.savers ``FusedLinearCrossEntropy``).
* **Optimizer in backward** (torchtune ``torchtune/training/memory.py`` ``register_optim_in_bwd_hooks``: one
  optimizer per parameter, stepped by a ``register_post_accumulate_grad_hook`` that then drops the gradient):
  at most one parameter's gradient is alive at any time; the optimizer-step phase holds no gradients at all.
  Gradient accumulation is refused (torchtune refuses it: the gradients are gone before the next micro-step). The
  reserved memory's stream replays the hooks gradient by gradient (trainfit.analytic.events ``accumulated``; the
  first step makes each tensor's states inside the backward, as the traced hook does).
* **Activation offloading** (torchtune ``torchtune/training/_activation_offloading.py`` ``OffloadActivations``: a
  ``saved_tensors_hooks`` pair copies every saved tensor of ≥ 1024 bytes that is not an ``nn.Parameter`` instance
  to pinned host memory; with streams the forward keeps a tensor until a pack 5 ids later, the backward frees an
  unpacked copy after the next unpacking node). Host: one copy per *save* (``SavedTerm.saves``), matmul weights
  included — ``mm`` saves ``weight.t()``, a view, which the isinstance test lets through — with RoPE's tables per
  layer, the ids and the final norm. GPU without checkpointing: the stash at the forward's end is the final norm's
  saves, the layers keep nothing, autocast's layer copies die with the forward, a layer's backward holds two nodes'
  unpacked copies (bounded by the largest linear's input and weight and the MLP product's node, or two attention
  projections' nodes: :func:`offload_in_flight_bytes`). With checkpointing: two checkpoint
  inputs. torchtune keeps the output projection's tensors on the GPU (``NoOpManager``), so the head and the logits
  stay. Between backwards torchtune keeps the last unpacking node (``curr_autograd_node``) and what it reaches: over a
  frozen token table, checkpointed, the embeddings' leaf output with its gradient and the bottom layer's LLM.int8
  inputs (:func:`offload_retained_bytes`). Checked save by save against the trace (tests/trace/test_savers_trace.py).
  The reserved memory's stream replays it layer by layer without checkpointing (trainfit.analytic.events
  ``offloaded``) and segment input by segment input under whole-layer checkpointing (``ckpt_offload``; the trace
  of such a run is not stitched, trainfit.trace.events ``frees_units_later``).
* **Paged optimizers** (bitsandbytes ``bitsandbytes/optim/optimizer.py`` ``Optimizer8bit.get_state_buffer`` with
  ``is_paged``: ``F.get_paged`` → ``cudaMallocManaged``): the optimizer states live in CUDA unified memory,
  outside the caching allocator, so ``torch.cuda.max_memory_allocated`` never sees them and the driver pages
  them to host memory when the GPU runs out. They are reported apart (``host_components``), not in the device
  peak.
* **Selective recompute** (Korthikanti et al. 2022 §5; Megatron-Core ``recompute_granularity="selective"``,
  ``core_attn``; :func:`trainfit.analytic.activations.layer_terms`): the attention core's saved tensors are replaced
  by the checkpoint's inputs (q and k after RoPE in the residual dtype, k and v before ``repeat_kv``) and one
  layer's come back, with a fused kernel's output, while its backward runs
  (:func:`~trainfit.analytic.activations.selective_recompute_bytes`; checked against the trace, which checkpoints
  the transformers attention-interface call).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from trainfit.analytic.activations import SavedTerm, TermRole, Widths, layer_terms, model_terms, residual_bits
from trainfit.analytic.float8 import block_linears, converted_weight_names
from trainfit.arch.params import inventory
from trainfit.arch.spec import ModelKind, ModelSpec
from trainfit.errors import StrategyError
from trainfit.strategy import LossImpl, Strategy

if TYPE_CHECKING:
    from trainfit.analytic.logits import LogitsMemory

#: torchtune OffloadActivations ``min_offload_size``: smaller saved tensors stay on the GPU.
MIN_OFFLOAD_BYTES = 1024
#: Checkpoint inputs an offloading run holds on the GPU in backward: the unpacked copy of the segment being
#: recomputed and the previous one's, freed after the next unpacking node (OffloadActivations with ``use_streams``).
OFFLOAD_LAYERS_ON_GPU = 2
#: OffloadActivations ``max_fwd_stash_size``: the forward keeps a packed tensor's device copy until the pack this many
#: ids later (torchtune ``torchtune/training/_activation_offloading.py``).
OFFLOAD_FWD_STASH = 5


def check_savers(spec: ModelSpec, strategy: Strategy) -> None:
    """One-line refusals for savers that do not apply to this model."""
    sv = strategy.savers
    if sv.loss is not LossImpl.STANDARD and spec.kind is not ModelKind.CAUSAL_LM:
        raise StrategyError(
            f"--loss {sv.loss.value} replaces a causal-LM loss; {spec.name} has a {spec.kind.value} head"
        )
    if sv.loss is not LossImpl.STANDARD and spec.final_logit_softcapping:
        raise StrategyError(f"--loss {sv.loss.value}: the logit soft-cap of {spec.model_type} is not modelled with it")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def liger_chunk_tokens(tokens: int, vocab: int, hidden: int) -> int:
    """Liger's chunk: next_pow2(⌈t / ⌈vocab/h⌉⌉) tokens, at most t — ``fused_linear_cross_entropy_forward``."""
    inc = -(-vocab // hidden)
    return min(tokens, _next_pow2(-(-tokens // inc)))


def chunked_loss_memory(
    spec: ModelSpec, strategy: Strategy, *, keep_logits: bool, head_trainable: bool = True
) -> LogitsMemory:
    """torchtune chunked CE: forward a·V + 4·V + 4·⌈V/N⌉; backward the larger of 4·V + 8·⌈V/N⌉ (the first
    chunk's log-softmax backward) and a·V·(N−2)/N + 3·a·vocab·h (the first sum of two chunks' head gradients,
    out of place) — module docstring; checked against real CPU autograd (tests/analytic/test_savers.py) and the
    trace (tests/trace/test_heads.py)."""
    from trainfit.analytic.logits import LogitsMemory, logits_width

    n = strategy.tokens_per_micro_batch * spec.vocab_size
    # the head's output width: the compute dtype under autocast, else the head weight's — fp32 for QLoRA's
    # kbit-prepared head under a pure 16-bit recipe, whose ``.float()`` is then no copy (logits.logits_width)
    a = logits_width(strategy)
    chunks = strategy.savers.loss_chunks
    chunk = -(-n // chunks)
    upcast = 4 * chunk if a != 4 else 0
    forward = a * n + 4 * n + upcast
    # Autograd runs nodes by decreasing sequence number and every loss node was created after every head matmul,
    # so all N chunks' loss backwards run first (their logits gradients, a·V, all alive; the saved log-softmax
    # outputs freed), then the head's N matmul backwards. The first leaves its vocab×h weight gradient in the
    # weight's buffer (a view: mm_mat2_backward's ``.t()`` transposed back by TBackward0); the second one's
    # arrives and, the buffered one being a view, input_buffer.cpp ``accumulate`` adds them out of place: three
    # tables alive, beside the logits gradients of the N − 2 chunks not yet run (states.tied_gradient_sum).
    table = a * spec.vocab_size * spec.embed_dim
    # Without a head gradient to sum: after the loss backwards, before the head's, the logits gradients alone.
    second = a * (n - 2 * chunk) + 3 * table if head_trainable and chunks > 1 else a * (n - chunk)
    backward = max(4 * n + 8 * chunk, second) + (a * n if keep_logits else 0)
    return LogitsMemory(forward_peak_bytes=forward, backward_peak_bytes=backward, logits_bytes=a * n)


def chunked_head_copy_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """Under autocast, what a frozen head adds to chunked CE: each chunk's ``F.linear(chunk, weight)`` casts the
    weight to the compute dtype, and autocast caches a cast only for a leaf that requires grad
    (aten/src/ATen/autocast_mode.cpp ``cached_cast``: ``arg.requires_grad() && arg.is_leaf()``), so a frozen fp32
    head (LoRA's default base under amp, QLoRA's head after ``prepare_model_for_kbit_training``) is cast once per
    chunk, and each cast is saved by its chunk's matmul for the input's gradient until that chunk's backward: N
    copies where one call keeps one — (N − 1) × the copy, beside the one the step's copies count already. 0 for a
    trainable head (one cached copy), a head already in the compute dtype, or without chunked CE. Found by the trace
    of llama-3.2-1b QLoRA with ``--loss chunked`` (8 chunks: 3.94 GiB of copies, the closed form had 0.51)."""
    from trainfit.analytic.states import param_states
    from trainfit.cuda_facts import allocator_bytes

    chunks = strategy.savers.loss_chunks if strategy.savers.loss is LossImpl.CHUNKED else 1
    if chunks <= 1:
        return 0
    head = "embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
    copy = sum(
        allocator_bytes(x.tensor.numel * strategy.recipe.compute_bits // 8)
        for x in param_states(spec, strategy)
        if x.tensor.name == head and x.autocast_copy and not x.trainable
    )
    return (chunks - 1) * copy


def fused_linear_loss_memory(
    spec: ModelSpec, strategy: Strategy, *, head_grad_bytes: int, weight_cast_bytes: int = 0
) -> LogitsMemory:
    """Liger fused linear CE: forward grad_weight + a·c·vocab + a·c·h + 4·t (+ under autocast one uncached
    16-bit cast of the head's weight per chunk, ``weight_cast_bytes``); backward grad_weight (already there) —
    module docstring. ``grad_input`` is a saved head tensor (:func:`fused_linear_head_input_bytes`)."""
    from trainfit.analytic.logits import LogitsMemory

    t = strategy.tokens_per_micro_batch
    a = strategy.recipe.compute_bits // 8
    c = liger_chunk_tokens(t, spec.vocab_size, spec.hidden_size)
    forward = head_grad_bytes + a * c * spec.vocab_size + a * c * spec.hidden_size + 4 * t + weight_cast_bytes
    return LogitsMemory(forward_peak_bytes=forward, backward_peak_bytes=head_grad_bytes, logits_bytes=0)


def fused_linear_head_input_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """Liger saves ``grad_input = zeros_like(_input)`` (t·h, the final norm output's dtype) instead of the input."""
    from trainfit.analytic.activations import norm_out_width

    return norm_out_width(spec, Widths.of(strategy)) * strategy.tokens_per_micro_batch * spec.hidden_size


#: Families whose projections are transformers' ``Conv1D`` (transformers/pytorch_utils.py ``Conv1D.forward``:
#: ``torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)``): ``addmm`` saves the weight itself, an
#: ``nn.Parameter``, which OffloadActivations leaves on the GPU — where an ``nn.Linear`` saves ``weight.t()``.
CONV1D_MODEL_TYPES = frozenset({"gpt2"})


def checkpoint_inputs_on_gpu(kept_inputs: int, input_bytes: int, segments: int) -> int:
    """Checkpoint inputs on the GPU under offloading with checkpointing: two (the backward's unpacked copy of the
    segment being recomputed and the previous one's, freed after the next unpacking node) — module docstring."""
    return min(kept_inputs, min(segments, OFFLOAD_LAYERS_ON_GPU) * input_bytes)


def _offloaded(pieces: tuple[int, ...]) -> int:
    """The bytes of a term's tensors that torchtune offloads (``num_bytes >= min_offload_size``)."""
    return sum(p for p in pieces if p >= MIN_OFFLOAD_BYTES)


def _per_save(terms: list[SavedTerm]) -> int:
    """Offloaded bytes of ``terms`` once per save (``SavedTerm.saves``): torchtune's pack copies every save."""
    return sum(x.saves * _offloaded(x.tensors()) for x in terms)


def offload_model_host_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """Host bytes of the saves outside the layer stack: the embedding's (its int64 ids, 8·t, once t ≥ 128) and the
    final norm's, once per save (HF RMSNorm: the fp32 input and rsqrt twice each). The LM head's input stays on the
    GPU (``NoOpManager`` on the output layer); RoPE's tables are saved by the layers."""
    mt = [x for x in model_terms(spec, strategy) if x.name != "rope.cos_sin"]
    return _per_save([x for x in mt if x.role in (TermRole.EMBEDDING, TermRole.HEAD)])


def offload_layer_host_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """Host bytes of the layer stack without checkpointing, beyond each saved storage counted once
    (``all_layers_bytes``): the extra saves of one storage (a normed input read by q, k and v is copied three times,
    RMSNorm's fp32 input and rsqrt twice, SDPA's output again by o_proj); every matmul weight, whose transposed view
    ``weight.t()`` is what ``mm`` saves — a view is no ``nn.Parameter``, so torchtune's check lets it through (under
    autocast the 16-bit cast is saved; not GPT-2's ``Conv1D``, :data:`CONV1D_MODEL_TYPES`) — at the compute width;
    and RoPE's cos and sin, saved by the q and k products of every layer (two tables' worth per layer). Checked
    save by save against the trace for Llama, Qwen2, Gemma-2 and Mixtral; GPT-2 is not followed save by save
    (docs/accuracy.md)."""
    w = Widths.of(strategy)
    expert_width = strategy.recipe.weight_bits // 8
    extra = 0
    for g in inventory(spec).layers:
        terms = layer_terms(spec, strategy, moe=g.kind == "moe")
        repeats = sum((x.saves - 1) * _offloaded(x.tensors()) for x in terms)
        fp8 = converted_weight_names(spec, strategy)
        sizes = [t.numel * w.compute for t in g.tensors if t.matmul and t.name not in fp8]
        if spec.model_type in CONV1D_MODEL_TYPES and not w.amp:
            sizes = []  # addmm saves the Parameter itself: not offloaded (under autocast its cast is)
        # MoE experts (grouped_mm, no autocast kernel: the weight dtype) save views of the stacked weights.
        sizes += [t.numel * expert_width for t in g.tensors if ".experts." in t.name and len(t.shape) == 3]
        weights = sum(x for x in sizes if x >= MIN_OFFLOAD_BYTES)
        extra += g.count * (repeats + weights)
    rope = next((x.bytes for x in model_terms(spec, strategy) if x.name == "rope.cos_sin"), 0)
    return extra + spec.num_layers * 2 * rope


def offload_in_flight_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """Inside a layer's backward without checkpointing: the unpacked device copies of the autograd node running
    and of the previous one that unpacked (torchtune's ``bwd_tensor_stash``: a node's copies are freed in the
    post-hook of the next node that unpacks). A linear's node unpacks its input and its weight's view ``weight.t()``
    (a view, no ``nn.Parameter``: offloaded, frozen or not), a·k·(t + n) for a k→n linear at the compute width. Two
    such nodes run back to back only in the attention (backward order v, k, q: the two largest of its projections);
    the MLP's are always apart — autograd runs ``down``, the product's node (act and up, 2·a·t·i), ``up``, the
    activation's, ``gate`` (a dense MLP: ``fc2``, the activation's, ``fc1``) — so there the largest linear's node
    meets at most the product's. The larger of the two. It was twice the largest linear's node, which counted a
    second MLP weight that is never back (mistral-7b LoRA q,v in fp32 at 2 × 16: the backward 224 MiB over the
    trace, and offloading raised the peak the trace lowers)."""
    a = strategy.recipe.compute_bits // 8
    t = strategy.tokens_per_micro_batch
    nodes = {x.name: a * x.in_features * (t + x.out_features) for x in block_linears(spec)}
    if not nodes:
        return 0
    attention = sorted((v for k, v in nodes.items() if k.startswith("attn.")), reverse=True)
    mlp = max(nodes.values()) + 2 * a * t * spec.intermediate_size
    return max(mlp, sum(attention[:2]))


def offload_retained_bytes(spec: ModelSpec, strategy: Strategy) -> tuple[int, int]:
    """(activations, gradient) that torchtune's ``OffloadActivations`` keeps from one backward to the next:
    ``unpack_tensor_with_streams`` stores the autograd node that last unpacked an offloaded tensor in
    ``self.curr_autograd_node`` and replaces it only at the next backward's first such node (the final norm's; the
    head's saves are ``NoOpManager``'s), so that node, and every node below it, outlives the backward: through the
    optimizer step, the next forward and the next loss backward. Its released saved variables hold nothing, but
    under checkpointing over a frozen token table (an adapter, ``--freeze embeddings``) the embeddings' output is a
    leaf (``enable_input_require_grads``: ``output.requires_grad_(True)``) whose ``AccumulateGrad`` node holds it
    and its ``.grad`` (the residual gradient, stolen: the leaf's size again); and the last node is the bottom layer's
    first in backward (its saves trigger the recomputation that unpacks the checkpoint input), above every LLM.int8
    linear of the bottom segment but the top layer's down projection, whose ``MatMul8bitLt`` nodes keep their inputs on
    ``ctx.tensors`` (bitsandbytes/autograd/_functions.py; :func:`~trainfit.analytic.activations.int8_ctx_bytes`).
    (0, 0) otherwise: without checkpointing the bottom layer's last node reaches only parameters. Found by the
    trace (llama-3.2-1b LoRA all-linear over LLM.int8, 2 × 1024: 56 MiB and a 16 MiB gradient, the optimizer
    step −3.2%; under ``sqrt``, 6 × 456 in fp32, the bottom segment's four layers: 513 MiB, the backward −4.9%);
    dense layers checked, an MoE bottom layer counted alike."""
    from trainfit.analytic.activations import input_grads_enabled, int8_layer_inputs
    from trainfit.analytic.adapters import SiteInput, is_frozen
    from trainfit.strategy import Quantization

    if not strategy.savers.activation_offload or not input_grads_enabled(strategy):
        return 0, 0
    if strategy.adapter is None:
        patterns = strategy.base_weights.frozen
        embeds = [t for t in inventory(spec).model_tensors if t.name.startswith("embed")]
        if not patterns or not embeds or not all(is_frozen(t, patterns, None, layers=spec.num_layers) for t in embeds):
            return 0, 0
    leaf = checkpoint_input_bytes(spec, strategy)
    held = leaf
    if strategy.base_weights.quantization is Quantization.INT8:
        # The bottom segment's layers (``sqrt``: several) are all below its first node in backward, the top one's
        # MLP output projection excepted.
        sizes = strategy.checkpoint_layout(spec.num_layers).segment_sizes
        moe = spec.num_moe_layers == spec.num_layers > 0
        ins = int8_layer_inputs(spec, strategy, moe=moe)
        layer = sum(x.bytes for x in ins.values())
        held += (sizes[0] if sizes else 1) * layer - (ins[SiteInput.MLP_ACT].bytes if SiteInput.MLP_ACT in ins else 0)
    return held, leaf


def offload_embedding_kept_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """The embedding's saves that stay on the GPU: tensors under 1 KiB (int64 ids of fewer than 128 tokens)."""
    emb = [x for x in model_terms(spec, strategy) if x.role is TermRole.EMBEDDING and x.name != "rope.cos_sin"]
    return sum(p for x in emb for p in x.tensors() if p < MIN_OFFLOAD_BYTES)


def checkpoint_input_bytes(spec: ModelSpec, strategy: Strategy) -> int:
    """One checkpoint input (the residual stream entering a segment): r·t·h."""
    return residual_bits(strategy) // 8 * strategy.tokens_per_micro_batch * spec.hidden_size


def replace_logits(lg: LogitsMemory, forward: int, backward: int) -> LogitsMemory:
    return dataclasses.replace(lg, forward_peak_bytes=forward, backward_peak_bytes=backward)


def saver_notes(spec: ModelSpec, strategy: Strategy) -> tuple[str, ...]:
    """What each saver in use changes, in the report's notes (and what the head's loss is)."""
    from trainfit.strategy import Checkpointing

    sv = strategy.savers
    out: list[str] = []
    if spec.kind is ModelKind.BASE:
        out.append("--head none: the loss is assumed to be last_hidden_state.mean() (it saves nothing)")
    if sv.loss is LossImpl.CHUNKED:
        out.append(
            f"chunked cross-entropy (torchtune): the fp32 upcast one chunk of {sv.loss_chunks} at a time; every "
            "chunk's log-softmax output is still saved"
        )
    elif sv.loss is LossImpl.FUSED_LINEAR:
        c = liger_chunk_tokens(strategy.tokens_per_micro_batch, spec.vocab_size, spec.hidden_size)
        out.append(
            f"fused linear cross-entropy (Liger): no logits tensor; {c}-token chunks, the head's weight and input "
            "gradients computed in the forward (what remains: one chunk's logits, grad_input, grad_weight)"
        )
    if sv.optimizer_in_backward:
        out.append(
            "optimizer in backward (torchtune): one parameter's gradient alive at a time; no optimizer-step peak"
        )
    if sv.activation_offload:
        out.append(
            "activation offloading (torchtune OffloadActivations): saved tensors of >= 1 KiB (weight views too) "
            f"copied to pinned host memory once per save (host bytes per phase); {OFFLOAD_LAYERS_ON_GPU} checkpoint "
            "inputs, or the final norm's saves and two autograd nodes' copies, stay on the GPU"
        )
    if sv.paged_optimizer:
        out.append(
            "paged optimizer (bitsandbytes): states in CUDA unified memory, outside max_memory_allocated and "
            "not in the device peak; reported as host bytes (paged out when the GPU is full)"
        )
    if strategy.checkpointing is Checkpointing.SELECTIVE:
        out.append("selective recompute (Korthikanti et al. 2022 §5): only the attention core is recomputed")
    if sv.any:
        out.append(
            "reserved memory: the allocator simulation replays the loss savers, the optimizer in backward and "
            "activation offloading (not under selective recompute); its overhead above its own allocated "
            "peak is added to this peak"
        )
    return tuple(out)

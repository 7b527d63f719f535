"""Reserved memory without torch: the analytic model's tensors as an allocator event stream.

``max_memory_reserved`` depends on the order of allocations and frees, not just on the peak, so the
analytic method does what the trace does with its recorded events: it replays a stream through the caching
allocator simulation (:mod:`trainfit.allocator`). The stream is synthesised from the same quantities the
moments are built from, tensor by tensor, in the order a Hugging Face training step runs them:

* before the recorded steps: the weights (``model.to("cuda")``), parameter by parameter in module order
  (:func:`module_order`: embeddings, layer 0's tensors, layer 1's..., the final norm and head), as are AdamW's
  states (``_init_group``), on one GPU and under DDP;
* each step: the input ids and labels; per layer, the autocast weight copies and the saved tensors of
  :func:`~trainfit.analytic.activations.layer_terms` and the KV cache's own copies of k and v
  (:func:`~trainfit.analytic.activations.kv_cache_held_tensors`, held until the outputs are dropped); the head's
  saved tensors and the loss chain of
  :mod:`~trainfit.analytic.logits` (16-bit logits, the fp32 copy, the log-softmax output), the outputs
  dropped before backward; backward in reverse: the loss gradients, each layer's parameter gradients and
  its transient backward tensors (``backward_temp_bytes``, as the tensors they are: :class:`BackwardPieces`; one
  GPU: each weight gradient beside its node's transients, the MLP's first) while its saved tensors and copies are
  released; Llama-style layers' forward also makes RMSNorm's fp32 ``pow`` and ``x * rsqrt`` and the rotary
  embedding's ``mul``/``neg``/``cat`` transients (freed in the layer; the peaks stay the closed form's); a tied
  table's second dense gradient (the embedding's) and, out of place, their sum (``states.tied_gradient_sum``);
  the optimizer step: states created lazily in the first step (so they land in blocks the first step's
  activations left cached, as on a real GPU), its temporaries (``step_temp_bytes``); ``zero_grad`` frees the
  gradients;
* checkpointing: the forward keeps each segment's input, and the backward recomputes one segment's saved
  tensors before releasing them;
* plain LoRA over a float base (one GPU): each adapted linear as PEFT's ``lora.Linear.forward`` runs it, its
  transients and its backward's (:class:`LoraFlow`), the adapters' gradients in their layer's backward; over a
  bitsandbytes 4-bit base (:class:`Bnb4bitBase`) and DoRA over either (:class:`DoraCall`, over a 4-bit base its
  dequantising weight norm :class:`DoraBnbNorm`);
* the loss savers as the traced code runs them: torchtune's chunked cross-entropy chunk by chunk (each chunk's head
  matmul, fp32 copy and log-softmax output; every chunk's loss backward before the head's per-chunk matmul
  backwards; the head's chunk gradients summed, the first sum out of place) and Liger's fused linear cross-entropy
  chunk of tokens by chunk (no logits kept; ``grad_input`` and ``grad_weight`` made in the forward and handed to
  the backward as the input's gradient and the ``.grad``); torchtune's optimizer in backward: each trained tensor's
  ``.grad`` stepped and freed by its post-accumulate-grad hook as AccumulateGrad makes it (its states made there in
  the first step; a tied table's once autograd has summed it; the head's after its matmul's node), the optimizer step
  empty; torchtune's activation offloading without checkpointing, coarsely: a layer's saves of >= 1 KiB freed on the
  device at the layer's end (the trace frees each once out of its stash of 5 packs), autocast's cached copies held
  to the forward's end, and the whole layer's saves back as new device copies from its backward's start to its end
  (the trace holds two autograd nodes' copies at a time, weight views included); under whole-layer checkpointing each
  segment's input leaves the device when the forward stash of 5 packs drops it (the final norm's packs drop the
  rest), and each recompute unpacks a new copy, freed after the next one's (over a frozen token table the first
  input, a leaf, and its gradient held to the next backward); under selective recompute it is not in the stream
  (:func:`stream_strategy`);
* a checkpointed forward keeps no saves (non-reentrant ``torch.utils.checkpoint`` packs nothing): each tensor lives
  as long as the module's Python forward holds it. For Llama-style layers one path (``nograd`` in ``synthesise``),
  16-bit or under autocast over fp32 weights, with or without adapter flows (whose parts — each adapter's output to
  its reader, a 4-bit base's own chains — are hooks in it): the norms' outputs to their sub-block's return, each
  projection's input cast to its call's end, q/k/v to the rotary embedding and SDPA, SwiGLU's operands to their
  product, the residual adds and the MLP's output to the layer's output; for GPT-2 and BERT layers
  (:func:`nograd_ln_layer` inside ``synthesise``) LayerNorm, the residual dropouts, GELU and the post- or pre-norm
  adds likewise; there the weights' autocast copies are made as each module first runs (the same tensors as the
  trace's layer, tests/trace/test_events.py). Other layers keep their would-be saved tensors to the layer's end.

Three steps are replayed (the first allocates the optimizer states; the steady state is reached by the
second), two when the second leaves the allocator exactly as the first did (:func:`steady_state`: every later step
makes the same calls, so it would repeat the second). The stream has fewer transient tensors than a real step
(element-wise outputs freed at once are left out); they reuse blocks of their own size and matter little for the
peak of reserved memory. How close this is to the trace's own events and to the H200 is in docs/accuracy.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from trainfit._memo import Memo, spec_key
from trainfit.allocator import AllocatorConfig, AllocatorResult, Event, Op, Simulator, simulate
from trainfit.allocator.workspaces import Thread, Workspace, workspace_key
from trainfit.analytic.activations import (
    SavedTerm,
    TermRole,
    Widths,
    backward_temp_bytes,
    blind_layer_unsaved,
    dead_layer_cache_tensors,
    eager_backward_moment,
    eager_forward_moment,
    first_layer_cache_bytes,
    first_layer_terms,
    frozen_layer_terms,
    kv_cache_held_tensors,
    layer_terms,
    model_terms,
    sac_saved_terms,
    site_widths,
)
from trainfit.analytic.adapters import (
    AdapterSite,
    BlindLayer,
    SiteInput,
    adapter_sites,
    base_weight_width,
    frozen_forms_known,
    frozen_layers,
    is_frozen,
    site_tensors,
)
from trainfit.analytic.logits import logits_memory
from trainfit.analytic.savers import (
    MIN_OFFLOAD_BYTES,
    OFFLOAD_FWD_STASH,
    liger_chunk_tokens,
    offload_retained_bytes,
)
from trainfit.analytic.states import (
    ParamState,
    model_states,
    optimizer_state_tensors,
    param_states,
    tensor_step_temp_bytes,
    tied_gradient_sum,
    tied_sum_modelled,
    trained_widths,
)
from trainfit.arch.params import inventory
from trainfit.arch.spec import MlpKind, ModelKind, ModelSpec, NormKind, ParamTensor
from trainfit.cuda_facts import BNB_4BIT_BLOCK
from trainfit.strategy import AdapterKind, Checkpointing, LossImpl, MemorySavers, Quantization, Strategy

__all__ = [
    "STEPS",
    "RankHooks",
    "Stream",
    "early_model_grad",
    "forget_simulations",
    "memo_stoppable",
    "simulate_training",
    "simulation_memo",
    "steady_state",
    "stream_strategy",
    "synthesise",
    "training_events",
]

#: Steps replayed: the first creates the optimizer states, the second and third are the steady state.
STEPS = 3


#: The trained tensors a rank's hooks make states for (each with its count), and each one's state width where it is
#: its own (:meth:`RankHooks.optimizer_states`)
Trained = Sequence[tuple[ParamTensor, int]]
StateBits = Mapping[ParamTensor, int] | None


class Stream:
    """Where the synthesised events go: a list, or (``sim``) straight into a simulator, which is what the
    estimate needs and saves building and dispatching thousands of event tuples (the same calls, in the same
    order, with the same event indices as :meth:`Simulator.run` would make)."""

    def __init__(self, sim: Simulator | None = None) -> None:
        self.events: list[Event] = []
        self._next = 0
        self._sim = sim
        #: Each live-or-dead allocation's bytes by key, when a caller asks for them (``track_sizes``).
        self.sizes: dict[int, int] | None = None

    @property
    def simulator(self) -> Simulator | None:
        """The simulator the events go straight into (None: they are listed in :attr:`events`)."""
        return self._sim

    def track_sizes(self) -> None:
        """Record every later allocation's bytes in :attr:`sizes` (activation offloading reads its saves' sizes)."""
        if self.sizes is None:
            self.sizes = {}

    def alloc(self, nbytes: int, stream: int = 0) -> int:
        """A new allocation's key (0 for nothing); ``stream``: the CUDA stream it is made on (the caching
        allocator keeps each stream's freed blocks for that stream)."""
        key = self._next = self._next + 1
        if nbytes <= 0:
            return 0
        if self.sizes is not None:
            self.sizes[key] = nbytes
        sim = self._sim
        if sim is None:
            self.events.append(Event(Op.ALLOC, key, nbytes, stream))
        else:
            sim.event_index += 1
            sim.malloc(key, nbytes, stream)
        return key

    def workspace(self, nbytes: int, key: int, stream: int = 0) -> None:
        """A cuBLAS/cuBLASLt workspace: an allocation for the life of the process, under the negative ``key``
        the stream gives it (:func:`trainfit.allocator.process.simulate_process` keeps these between runs).
        A zero-byte workspace (``CUBLAS_WORKSPACE_CONFIG=:0:0``) allocates nothing."""
        self._next += 1
        if nbytes <= 0:
            return
        sim = self._sim
        if sim is None:
            self.events.append(Event(Op.ALLOC, key, nbytes, stream))
        else:
            sim.event_index += 1
            sim.malloc(key, nbytes, stream)

    def free(self, key: int) -> None:
        if key:
            sim = self._sim
            if sim is None:
                self.events.append(Event(Op.FREE, key))
            else:
                sim.event_index += 1
                sim.free_completed(key)

    def free_all(self, keys: Iterable[int]) -> None:
        """:meth:`free` of each key in turn (the simulator's, looked up once: a hot loop of the planner)."""
        sim = self._sim
        if sim is None:
            for k in keys:
                self.free(k)
            return
        done = sim.free_completed
        for k in keys:
            if k:
                sim.event_index += 1
                done(k)


def _bytes(numel: int, bits: int) -> int:
    return numel * bits // 8


def early_model_grad(spec: ModelSpec, x: ParamTensor) -> bool:
    """Whether a model-level tensor's gradient appears with the head's backward, not at the end of backward: every
    one but the embeddings' (the head's, a head transform's, the final norm's — made by the node after the head's,
    and its ``AccumulateGrad`` runs at once: torch/csrc/autograd/engine.cpp ``CompareNodeTaskTime`` puts it ahead of
    every other ready node; the traced runs, one GPU and DeepSpeed's engine) and a token table tied to the head (its
    head gradient; autograd adds the embedding's at the end, states.tied_gradient_sum). An untied table's, a position
    table's and an embedding norm's come at the end."""
    if x.name.startswith("embed"):
        return spec.kind.has_vocab_logits and spec.tie_word_embeddings and x.name == "embed_tokens.weight"
    return True


def module_order(spec: ModelSpec, states: Sequence[ParamState]) -> list[ParamState] | None:
    """``states`` one tensor each (``count`` 1) in the order the model's modules register their parameters, which is
    the order ``model.to("cuda")`` moves them and ``from_config`` builds them on the GPU (``nn.Module._apply`` walks
    ``children()`` depth first; each HF model's ``__init__`` makes the embeddings, then ``layers[0]``'s attention
    (q, k, v, o), MLP (gate, up, down) and norms, ``layers[1]``'s..., then the final norm and the head), and the order
    AdamW's ``_init_group`` (torch/optim/adamw.py) makes each parameter's ``exp_avg`` and ``exp_avg_sq`` in:
    ``for p in group["params"]`` over ``model.parameters()``. The embeddings' tensors first, each layer's
    (:func:`~trainfit.arch.params.inventory` lists a layer's in module order) layer by layer, the other model-level
    ones last. None where a state is not the inventory's (adapters: PEFT adds them after the base model is built) or
    a tensor's layers are held in several states (a frozen layer range)."""
    inv = inventory(spec)
    by = {ps.tensor: ps for ps in states}
    known = set(inv.model_tensors) | {x for g in inv.layers for x in g.tensors}
    if len(by) != len(states) or any(ps.tensor not in known for ps in states):
        return None  # a tensor in several states (--freeze of a layer range) or one the inventory does not list
    pre = [x for x in inv.model_tensors if x.name.startswith("embed") and x in by]
    post = [x for x in inv.model_tensors if not x.name.startswith("embed") and x in by]
    out = [replace(by[x], count=1) for x in pre for _ in range(by[x].count)]
    for g in inv.layers:
        own = [x for x in g.tensors if x in by]
        out += [replace(by[x], count=1) for _ in range(g.count) for x in own]
    out += [replace(by[x], count=1) for x in post for _ in range(by[x].count)]
    if len(out) != sum(ps.count for ps in states):  # a count the inventory does not explain: leave the order
        return None
    return out


def split_bytes(total: int, unit: int, first: int = 0) -> list[int]:
    """``total`` bytes as the tensors that make them up: ``first`` (when it fits), then as many ``unit``-sized ones as
    fit, then what remains (one tensor of ``total`` where ``unit`` is 0)."""
    out = [first] if 0 < first <= total else []
    rest = total - sum(out)
    if unit <= 0:
        return [*out, rest] if rest > 0 else out
    out += [unit] * (rest // unit)
    return [*out, rest % unit] if rest % unit else out


@dataclass(frozen=True, slots=True)
class BackwardPieces:
    """A layer's backward transients (:func:`~trainfit.analytic.activations.backward_temp_bytes`) as the tensors the
    closed form counts, each one its own allocation (a single block of their sum would need a hole of that size the
    real tensors never ask for). ``mlp``: the MLP's (the residual gradient, then ``a·t·i``-wide gradients of the
    intermediate tensors: ``mul``'s two and ``silu_backward``'s, derivatives.yaml); ``norm``: a norm's backward
    (HF ``LlamaRMSNorm`` in fp32: ``t·h`` fp32 tensors, the ``_to_copy``/``pow``/``mul``/``div`` outputs of its
    autograd graph; LayerNorm: residual-width ones), ``in_block_norm``: the same net of the MLP's released saved
    tensors (the block's own norms); the model's final norm takes ``norm``."""

    mlp: tuple[int, ...]
    in_block_norm: tuple[int, ...]
    norm: tuple[int, ...]

    @staticmethod
    def of(spec: ModelSpec, strategy: Strategy, block_bytes: int, norm_bytes: int) -> BackwardPieces:
        w = Widths.of(strategy)
        t, h = strategy.tokens_per_micro_batch, spec.hidden_size
        norm_unit = 4 * t * h if spec.norm is NormKind.RMSNORM else w.residual * t * h
        mlp_saved = sum(
            x.bytes for x in layer_terms(spec, strategy, moe=spec.num_moe_layers > 0) if x.role is TermRole.MLP
        )
        in_block = max(0, norm_bytes - mlp_saved)
        plain = spec.moe is None and spec.mlp is MlpKind.GATED
        unit = w.compute * t * spec.intermediate_size if plain else 0
        mlp = split_bytes(block_bytes, unit, first=w.residual * t * h if plain else 0)
        if block_bytes == in_block and not plain:
            mlp = split_bytes(block_bytes, norm_unit)
        return BackwardPieces(
            mlp=tuple(mlp),
            in_block_norm=tuple(split_bytes(min(in_block, block_bytes), norm_unit)),
            norm=tuple(split_bytes(norm_bytes, norm_unit)),
        )


def head_matmul_grad(spec: ModelSpec, x: ParamTensor) -> bool:
    """Whether a model-level tensor's gradient is made by the head's own backward, before the head's input gradient
    (the LM head's, a tied table's head gradient, a classification head's); the other early ones
    (:func:`early_model_grad`: the final norm's, a head transform's) come after it, from the nodes that follow."""
    if not spec.kind.has_vocab_logits:  # a classification head's own tensors (trainfit.arch.heads)
        return x.name.startswith(("score.", "classifier.", "pooler."))
    return x.name.startswith("lm_head") or (spec.tie_word_embeddings and x.name == "embed_tokens.weight")


@dataclass(frozen=True, slots=True)
class LoraFlow:
    """What one adapted linear allocates and frees around its saved tensors, in PEFT's order (widths in bytes per
    element): ``lora.Linear.forward`` (peft/tuners/lora/layer.py) runs ``result = self.base_layer(x)``, then
    ``x = self._cast_input_dtype(x, lora_A.weight.dtype)`` (a copy when the dtypes differ), ``result = result +
    lora_B(lora_A(dropout(x))) * scaling`` and ``result.to(torch_result_dtype)``: the base output (``c``), lora_B's
    output and its scaled copy (``mm``, lora_A/lora_B's matmul width), their sum with the base output in the promoted
    dtype (``p``: torch's type promotion, fp32 over a 16-bit base with fp32 adapters without autocast) and, when that
    differs from the base output's, the cast back. The saved tensors (``lora_in``, the dropout mask, ``lora_A_out``)
    are the layer's terms (:func:`~trainfit.analytic.adapters.adapter_saved`); ``forward_temps``: the input copies
    that are not saved (PEFT's cast when dropout or autocast copies it again, dropout's output under autocast)."""

    site: AdapterSite
    lora_a: ParamTensor
    lora_b: ParamTensor
    t: int  # tokens
    w_in: int  # x as the base layer receives it
    c: int  # the base output (torch_result_dtype)
    mm: int
    p: int
    ad: int  # the adapter dtype
    rank: int
    forward_temps: tuple[int, ...]  # widths, alive to the end of the call
    #: The input gradient's chain after lora_A's matmul (autocast's cast back, dropout's mask, PEFT's cast back):
    #: each step a new tensor from the previous one, which autograd then frees.
    grad_chain: tuple[int, ...]
    #: A bitsandbytes 4-bit base (:class:`Bnb4bitBase`); None: a float base.
    bnb: Bnb4bitBase | None = None
    #: DoRA's weight norm and rescaling (:class:`DoraCall`); None: plain LoRA.
    dora: DoraCall | None = None


@dataclass(frozen=True, slots=True)
class DoraCall:
    """DoRA over a float base (PEFT ``DoraLinearVariant.forward`` → ``DoraLinearLayer.forward``,
    peft/tuners/lora/dora.py). Without dropout the base output is kept (DoRA saves it: the ``dora_base_out`` term is
    the flow's base output); with dropout (``dropped``) the variant passes ``base_result=None`` and DoRA runs the base
    layer again on the dropped input, ``F.linear(x, weight.to(x.dtype))``: its output is the ``dora_base_out`` term,
    the weight it multiplied by the ``dora_weight`` term (the norm's cast copy, or autocast's cast made for this
    linear, :func:`~trainfit.analytic.adapters.dora_weight_copy_bytes`), autocast's cast of x (``x_cast``-wide, not
    cached: not a leaf) a transient, and the layer's own base output is freed once ``result + result_dora`` is made.
    The weight norm makes ``eye(d_in)`` and lora_A's product of it (``eye``-wide), ``lora_weight``, the base
    weight cast to x's dtype (when it differs) — locals alive to the call's end — and ``weight + scaling *
    lora_weight`` (the scaled copy and the sum, freed by the norm), the ``full`` widths over d_in × d_out as
    :func:`~trainfit.analytic.adapters.dora_norm_transient_bytes` counts them; then ``(mag_norm_scale - 1) *
    base_result``, ``mag_norm_scale * lora_result``, ``* scaling`` and their sum (``out``-wide: promoted by the
    adapter-dtype magnitude), and the layer's ``result + result_dora`` (the trace of real PEFT modules,
    tests/trace/test_dora.py)."""

    eye: int
    lora_weight: int
    weight_copy: int  # 0: the base weight already has x's dtype
    full: int  # the scaled copy's and the sum's width
    out: int
    dropped: bool = False
    x_cast: int = 0  # with dropout under autocast: the second base linear's cast of the dropped input
    weight_cast: int = 0  # with dropout under autocast: that linear's cast of the weight (saved), else the norm's
    #: Over a bitsandbytes 4-bit base (:class:`DoraBnbNorm`); None: a float base.
    bnb: DoraBnbNorm | None = None


@dataclass(frozen=True, slots=True)
class DoraBnbNorm:
    """DoRA's weight norm over a bitsandbytes 4-bit base, as the trace of real PEFT and bitsandbytes modules makes it
    (``DoraLinearLayer.forward``, peft/tuners/lora/dora.py, before ``lora_B(lora_A(x))``): ``get_lora_weight``'s
    ``torch.eye`` in lora_A's dtype (``eye``), autocast's cast of it for lora_A (``eye_cast``; 0 without autocast),
    lora_A's and lora_B's outputs (``mm``), ``.to(x.dtype)`` (``x``: a copy where the widths differ) — the cast eye,
    lora_A's output and ``lora_weight`` held to the call's end by ``lora_weight``'s graph, the eye freed once lora_B's
    output exists; ``dequantize_module_weight`` (peft/utils/integrations.py → ``bnb.functional.dequantize_4bit``:
    with double quantisation the fp32 absmax first, ``absmax`` bytes a weight element, then the weight in the
    quantisation's dtype, ``dequant``), its ``.to(x.dtype)`` (kept to the call's end), ``get_weight_norm``'s
    ``scaling * lora_weight`` and sum (``x``-wide, freed by the norm)."""

    eye: int
    eye_cast: int
    mm: int
    x: int
    dequant: int
    absmax_block: int  # elements per fp32 absmax (double quantisation); 0: none made


@dataclass(frozen=True, slots=True)
class Bnb4bitBase:
    """PEFT's LoRA over a bitsandbytes 4-bit base (peft/tuners/lora/bnb.py ``Linear4bit.forward``): the base layer
    (bitsandbytes/nn/modules.py ``Linear4bit.forward``) casts x to the compute dtype, multiplies (``matmul_4bit``,
    ``compute``-wide output) and casts the output back to x's dtype (``.to(inp_dtype)``); PEFT clones that result
    (the flow's base output, ``LoraFlow.c`` = x's width) and adds the branch to the clone — under autocast as it is
    (``requires_conversion`` False: no ``_cast_input_dtype``, the sum promoted), without autocast converted first to
    the result's dtype (``converts``). Backward (``MatMul4Bit.backward``, bitsandbytes/autograd/_functions.py): the
    incoming gradient cast to the compute dtype, the dequantised weight (``dequantize_4bit``, d_in × d_out), the
    input gradient in the compute dtype, then cast to x's dtype. Read off the trace of real bitsandbytes layers
    (trainfit.trace.peft)."""

    compute: int
    converts: bool


def lora_flows(spec: ModelSpec, strategy: Strategy) -> dict[str, LoraFlow]:
    """Each adapted linear's :class:`LoraFlow` by its name, on a dense stack: plain LoRA and DoRA (without dropout) over
    a float or bitsandbytes 4-bit base (empty otherwise: DoRA with dropout over a 4-bit base, LoRA over LLM.int8,
    MoE and MLA stacks keep their saved tensors only)."""
    adapter = strategy.adapter
    quant = strategy.base_weights.quantization
    dora = adapter is not None and adapter.kind is AdapterKind.DORA
    if (
        adapter is None
        or (dora and quant is not Quantization.NONE and adapter.dropout > 0)
        or quant not in (Quantization.NONE, Quantization.NF4, Quantization.FP4)
        or spec.moe is not None
        or spec.mla is not None
    ):
        return {}
    w = Widths.of(strategy)
    widths = site_widths(spec, strategy, w)
    t = strategy.tokens_per_micro_batch
    ad = adapter.dtype.bits // 8
    mm = w.compute if w.amp else ad
    dropped = adapter.dropout > 0
    bnb = Bnb4bitBase(compute=w.compute, converts=not w.amp) if quant is not Quantization.NONE else None
    out: dict[str, LoraFlow] = {}
    for site in adapter_sites(spec, adapter):
        w_in = widths[site.reads]
        c = w_in if bnb is not None or not w.amp else w.compute
        # PEFT's _cast_input_dtype copies (over a bitsandbytes base only without autocast: adapters.adapter_saved)
        cast = w_in != ad and not (bnb is not None and w.amp)
        autocast_cast = w.amp and (ad if (cast or dropped) else w_in) != w.compute
        temps: list[int] = []
        if cast and (dropped or autocast_cast):
            temps.append(ad)  # PEFT's copy, not the saved one: held by ``x`` to the end of the call
        if dropped and autocast_cast:
            temps.append(ad)  # dropout's output, cast again by autocast for lora_A
        # autocast's cast back (to the dropout's or PEFT's copy, else to x itself), dropout's mask, PEFT's cast back
        chain = [ad if (cast or dropped) else w_in] if autocast_cast else []
        chain += [ad] if dropped else []
        chain += [w_in] if cast else []
        a, b = site_tensors((site,), adapter)[:2]
        out[site.name] = LoraFlow(
            site=site,
            lora_a=a,
            lora_b=b,
            t=t,
            w_in=w_in,
            c=c,
            mm=mm,
            p=c if bnb is not None and bnb.converts else max(c, mm),
            ad=ad,
            rank=adapter.rank,
            forward_temps=tuple(temps),
            grad_chain=tuple(chain),
            bnb=bnb,
            dora=_dora_call(strategy, ad=ad, mm=mm, c=c, dropped=dropped, amp=w.amp, compute=w.compute, w_in=w_in)
            if dora
            else None,
        )
    return out


def _dora_call(
    strategy: Strategy, *, ad: int, mm: int, c: int, dropped: bool, amp: bool, compute: int, w_in: int
) -> DoraCall:
    if strategy.base_weights.quantization is not Quantization.NONE:  # a 4-bit base (lora_flows): DoraBnbNorm
        x = w_in if amp else ad  # PEFT's bnb layers cast x to the adapters' dtype only without autocast
        norm = DoraBnbNorm(
            eye=ad,
            eye_cast=mm if amp and mm != ad else 0,
            mm=mm,
            x=x,
            dequant=compute,
            absmax_block=BNB_4BIT_BLOCK if strategy.base_weights.double_quant else 0,
        )
        return DoraCall(eye=0, lora_weight=0, weight_copy=0, full=x, out=max(ad, mm, c), bnb=norm)
    copy = ad if base_weight_width(strategy) != ad else 0
    cast = compute if dropped and amp and ad != compute else 0  # x and the weight are in the adapter dtype there
    return DoraCall(
        eye=mm,
        lora_weight=ad,
        weight_copy=copy,
        full=ad,
        out=max(ad, mm, c),
        dropped=dropped,
        x_cast=cast,
        weight_cast=cast,
    )


#: The saved terms of a 16-bit pre-norm decoder layer whose lifetimes in a no-grad (checkpointed) forward the
#: stream models (``synthesise``: ``nograd``); a layer with adapter flows takes the same path.
NO_GRAD_TERMS = frozenset(
    {
        "norm1.rsqrt",
        "norm1.input_fp32",
        "norm1.normed",
        "attn_in.input",
        "attn.sdpa.qkv",
        "attn.sdpa.out",
        "attn.sdpa.lse",
        "norm2.rsqrt",
        "norm2.input_fp32",
        "norm2.normed",
        "mlp_in.input",
        "mlp.swiglu",
        # autocast over fp32 weights: each projection's cast of its input
        "attn_in.casts",
        "mlp_in.casts",
    }
)
#: The saved terms of a GPT-2 or BERT layer (LayerNorm, dense GELU MLP, SDPA's fused kernels) whose no-grad forward
#: the stream models (``synthesise``: ``nograd_ln``), and the model types it was checked for against the trace.
NO_GRAD_LAYERNORM_TERMS = frozenset(
    {
        "norm1.mean_rstd",
        "norm1.input",
        "attn_in.input",
        "attn_in.casts",
        "attn.sdpa.qkv",
        "attn.sdpa.out",
        "attn.sdpa.lse",
        "dropout_masks",
        "norm2.mean_rstd",
        "norm2.input",
        "mlp_in.input",
        "mlp_in.casts",
        "mlp.gelu_python",
        "mlp.act",
    }
)
NO_GRAD_LAYERNORM_TYPES = frozenset({"gpt2", "bert"})
#: Of those, a norm's cast and output (its reader's input) and autocast's casts of it for the projections: the
#: no-grad forward makes them where the modules do (``nograd_norm``, ``linear``).
NORM_OUTPUT_TERMS = frozenset(
    {"norm1.normed", "attn_in.input", "norm2.normed", "mlp_in.input", "attn_in.casts", "mlp_in.casts"}
)


def training_events(spec: ModelSpec, strategy: Strategy, workspaces: tuple[Workspace, ...] = ()) -> list[Event]:
    """The synthesised event stream of :data:`STEPS` training steps (see the module docstring); the main
    thread's ``workspaces`` appear at the first forward, the autograd thread's after the first backward matmul's
    output."""
    s = Stream()
    synthesise(s, spec, strategy, workspaces)
    return s.events


def built_on_device_sizes(spec: ModelSpec, strategy: Strategy) -> tuple[int, int]:
    """(the parameters' allocations, the tied head's own weight in bytes) for
    :func:`trainfit.allocator.process.built_on_device`: a model built by ``from_config`` on the GPU allocates its
    LM head before tying it to the token table (0 bytes where the head is not tied)."""
    states = param_states(spec, strategy)
    tied = spec.tie_word_embeddings and spec.kind.has_vocab_logits
    table = next((ps.weight_bytes for ps in states if ps.tensor.name == "embed_tokens.weight"), 0)
    return sum(ps.count for ps in states), table if tied else 0


class RankHooks:
    """Where a many-GPU rank's stream departs from one GPU's (:mod:`trainfit.analytic.rank_events`): the
    resident states it builds, what it all-gathers around each layer, how a layer's gradients are reduced,
    which activations it holds only a sequence shard of. This base class is one GPU: every hook does what the
    single-GPU stream does."""

    #: :meth:`weights` and :meth:`optimizer_states` receive the parameters one by one in module order
    #: (:func:`module_order`) rather than grouped by kind with their counts (hooks that build their own flat
    #: parameters or shards from the counts keep the grouped lists).
    module_order = True

    #: Adapted linears run as PEFT runs them, their adapters' gradients in their layer's backward (:class:`LoraFlow`):
    #: one GPU and the data-parallel ranks (DDP, FSDP2/HSDP, ZeRO-1/2/3: a rank's activations are one GPU's; against
    #: the traced ranks of tests/trace/test_rank_stream.py the fine-tuning cells' reserves moved −3.3/−2.4/−4.3% →
    #: −1.7/0.0/−2.1%, none the other way); DTensor TP's sharded linears keep the saved tensors only, the adapters'
    #: gradients with the head's.
    adapter_flow = True
    #: AccumulateGrad adds autograd's gradient into a ``.grad`` that is a view of a framework's buffer (DDP's
    #: ``gradient_as_bucket_view``): a tied table's out-of-place sum is a tensor of its own before that.
    adds_into_view = False
    #: Whether the stream replays gradient accumulation for this rank (:func:`synthesise`: two micro-steps, the
    #: second with every ``.grad`` resident); False: one micro-step (the framework hooks whose accumulation is not
    #: modelled yet: ZeRO).
    replays_accumulation = True
    #: The framework's hooks take every micro-step's gradients from autograd and reduce them (FSDP2's
    #: post-backward reduce-scatters each micro-step's unsharded gradients and adds the result into the sharded
    #: ``.grad``): autograd accumulates nothing, so each replayed micro-step's backward is the first's, and the
    #: hooks learn which micro-step it is from :meth:`micro_step_begin`.
    reduces_each_micro_step = False

    def micro_step_begin(self, s: Stream, micro: int) -> None:
        """Before micro-step ``micro``'s inputs (0: the first of the step)."""

    def micro_steps(self, grad_accum: int) -> int:
        """Micro-steps replayed per step: two where accumulation is replayed (the later ones repeat the second)."""
        return min(grad_accum, 2) if self.replays_accumulation else 1

    def weights(self, s: Stream, states: Sequence[ParamState]) -> None:
        """The resident parameters (and a framework's persistent buffers), before the first step."""
        for ps in states:
            for _ in range(ps.count):
                s.alloc(ps.weight_bytes)

    def grad_bytes(self, x: ParamTensor, bits: int) -> int:
        """Bytes of the gradient autograd makes for ``x`` (0: a view of a framework's buffer)."""
        return _bytes(x.numel, bits)

    def copy_bytes(self, x: ParamTensor, bits: int) -> int:
        """Bytes of autocast's ``bits``-wide copy of ``x`` (a rank's own shard of it)."""
        return _bytes(x.numel, bits)

    def saved_bytes(self, name: str, nbytes: int) -> int:
        """Bytes of a saved tensor of the activation term ``name`` on this rank (a sequence-sharded one's part)."""
        return nbytes

    def residual_bytes(self, nbytes: int) -> int:
        """Bytes of a residual-stream tensor (a hidden state, its gradient, a checkpointed segment's input, the
        final norm's backward temporaries) on this rank: a sequence-sharded rank's part."""
        return nbytes

    def logits_gather(self, s: Stream) -> list[int]:
        """Before the logits: what making them allocates besides them (a gather's inputs), freed after them."""
        return []

    def forward_begin(self, s: Stream) -> None:
        """Before the embedding (a root's unshard; DDP's bucket rebuild at the second one)."""

    def embedding_forward_end(self, s: Stream) -> None:
        """After the embedding's output (an embedding unit's reshard)."""

    def head_forward_begin(self, s: Stream) -> None:
        """After the last layer, before the final norm and the head (a [final norm, head] unit's unshard)."""

    def layer_forward_begin(self, s: Stream, i: int) -> None:
        """Before layer ``i``'s forward (its unshard)."""

    def layer_forward_end(self, s: Stream, i: int) -> None:
        """After layer ``i``'s forward (its reshard)."""

    def backward_begin(self, s: Stream) -> None:
        """After the loss, before its backward (the root's post-forward)."""

    def head_backward_begin(self, s: Stream) -> None:
        """The logits' gradient made, before the head's backward (hooks on the model's output: a pre-backward)."""

    def defers_tied_table(self) -> bool:
        """Whether this micro-step's hooks take a tied table's gradient when autograd has summed it, after the
        embedding's backward (:meth:`tied_table_grad`), rather than with the head's (:meth:`grad_bytes`)."""
        return False

    def tied_table_grad(self, s: Stream, x: ParamTensor, key: int) -> None:
        """A deferred tied table's gradient ``key``, autograd's sum, handed to the hooks (who free it or keep it)."""
        raise NotImplementedError  # only hooks that defer the table (defers_tied_table) are called

    def defers_head_grads(self) -> bool:
        """Whether this micro-step's hooks take the head's gradients once its backward has released the logits'
        gradient (:meth:`head_grads_taken`) rather than as autograd makes them (:meth:`grad_bytes`): gradient hooks on
        a parameter's ``AccumulateGrad`` run when that node does, after the head's ``MmBackward`` returned (DeepSpeed
        ZeRO-1/2: its offload clone of a head larger than the bucket then no longer meets the logits' gradient, as
        in the traced engine)."""
        return False

    def head_grads_taken(self, s: Stream, grads: list[tuple[ParamTensor, int]]) -> None:
        """The head's gradients (``(tensor, key)`` of autograd's, :meth:`defers_head_grads`) handed to the hooks, who
        free or keep them."""
        raise NotImplementedError  # only hooks that defer them are called

    def early_grad(self, spec: ModelSpec, x: ParamTensor) -> bool:
        """Whether the model-level tensor ``x``'s gradient is made with the head's backward (passed to
        :meth:`head_backward_end`) rather than at the end of backward (``late`` in :meth:`backward_end`)."""
        return early_model_grad(spec, x)

    def head_backward_end(self, s: Stream, grads: list[int]) -> list[int]:
        """After the final norm's backward: what replaces the early gradients (a [final norm, head] unit's
        post-backward reduces them)."""
        return grads

    def layer_backward_begin(self, s: Stream, i: int) -> None:
        """Before layer ``i``'s gradients (its unshard, the next one's prefetch)."""

    def layer_backward_end(self, s: Stream, i: int, grads: list[int]) -> list[int]:
        """After layer ``i``'s backward: the gradients that stay (a reduction may replace them)."""
        return grads

    def embedding_backward_begin(self, s: Stream) -> None:
        """After the layers' backward, before the late gradients (an embedding unit's unshard)."""

    def backward_end(self, s: Stream, head: list[int], late: list[int]) -> list[int] | None:
        """After the model-level gradients (``head``: those made with the head's backward, ``late``: at the end
        of backward): what replaces them (None: they stay)."""
        return None

    def master_weights(self, s: Stream, strategy: Strategy, trained: Sequence[tuple[ParamTensor, int]]) -> None:
        """A master-* recipe's fp32 copies of the trained parameters, made with the optimizer before the first step:
        mixed-precision optimizers copy the 16-bit parameters when they are built (Megatron-LM
        ``Float16OptimizerWithFloat16Params.__init__``: ``main_param = param.detach().clone().float()``; DeepSpeed's
        ``FP16_Optimizer``/``BF16_Optimizer`` build their fp32 groups in ``__init__``; the trace's
        ``trace.optim.MasterWeights``), not lazily in the step as AdamW's states are."""
        bits = strategy.recipe.master_bits
        if bits:
            for x, m in trained:
                for _ in range(m):
                    s.alloc(_bytes(x.numel, bits))

    def master_grads(
        self, s: Stream, strategy: Strategy, trained: Sequence[tuple[ParamTensor, int]]
    ) -> tuple[list[int], int]:
        """A master-* recipe's fp32 gradients, made before the optimizer steps (and before the first step makes its
        states): each 16-bit ``.grad`` upcast into its master parameter's ``.grad`` (Megatron-LM
        ``_copy_model_grads_to_main_grads``: ``main_param.grad = model_param.grad.float()``; the trace's
        ``MasterWeights.grads_to_master``), all alive through the step; their keys and bytes (part of
        :meth:`step_temp_bytes`'s default)."""
        bits = strategy.recipe.master_bits
        if not bits:
            return [], 0
        sizes = [_bytes(x.numel, bits) for x, m in trained for _ in range(m)]
        return [s.alloc(n) for n in sizes], sum(sizes)

    def optimizer_states(self, s: Stream, strategy: Strategy, trained: Trained, state_bits: StateBits = None) -> None:
        """The optimizer's states, made in the first step (the master copies are :meth:`master_weights`), each tensor's
        in ``state_bits`` where it has an entry (an adapter's own dtype: :func:`~trainfit.analytic.states.
        trained_widths`), else the recipe's."""
        r = strategy.recipe
        default = 32 if r.master_bits else r.state_bits
        for x, m in trained:
            bits = state_bits.get(x, default) if state_bits is not None else default
            pieces = optimizer_state_tensors(x, strategy.optimizer, bits, strategy.optimizer_impl)
            for _ in range(m):
                for n in pieces:
                    s.alloc(n)

    def step_temp_bytes(self, default: int) -> int:
        """The optimizer step's temporaries, in all."""
        return default


_ONE_GPU = RankHooks()


def synthesise(
    s: Stream,
    spec: ModelSpec,
    strategy: Strategy,
    workspaces: tuple[Workspace, ...],
    rank: RankHooks = _ONE_GPU,
    steps: int = STEPS,
    stop: Callable[[int], bool] | None = None,
) -> None:
    """Write the stream of ``steps`` training steps into ``s`` (see the module docstring); ``rank``: where
    a many-GPU rank departs from it; ``stop(step)``, asked after each step: True ends the stream there."""
    r = strategy.recipe
    w = Widths.of(strategy)
    st = model_states(spec, strategy)
    states = param_states(spec, strategy)
    inv = inventory(spec)
    t = strategy.tokens_per_micro_batch
    h = spec.hidden_size
    hidden = rank.residual_bytes(w.residual * t * h)  # one residual-stream tensor

    # Weights, in module order (one GPU: parameter by parameter, module_order).
    ordered = module_order(spec, states) if rank.module_order else None
    rank.weights(s, states if ordered is None else ordered)
    trained = [(ps.tensor, ps.count) for ps in states if ps.trainable]
    # AdamW's _init_group makes each trained parameter's states in module order too
    trained_ordered = trained if ordered is None else [(ps.tensor, 1) for ps in ordered if ps.trainable]
    # the optimizer states of a tensor held in its own dtype (fp32 adapters over a 16-bit base) are that dtype's
    own_state_bits = {ps.tensor: trained_widths(strategy, ps)[2] for ps in states if ps.trainable and ps.bits}
    trained_numel = sum(x.numel * m for x, m in trained) or 1
    rank.master_weights(s, strategy, trained_ordered)

    def per_tensor(total: int, x: ParamTensor) -> int:
        return total * x.numel // trained_numel

    # Tensors compare by value (name, shape): the inventory is rebuilt per call, so identities differ.
    layer_tensors = {x for g in inv.layers for x in g.tensors}
    trainable = {x for x, _ in trained}
    # Plain LoRA over a float base: each adapted linear's forward and backward as PEFT runs it (LoraFlow), its
    # adapters' gradients made in its layer's backward; other adapters keep the saved tensors only, their gradients
    # made with the head's
    flows = lora_flows(spec, strategy) if rank.adapter_flow else {}
    flow_tensors = {x for f in flows.values() for x in (f.lora_a, f.lora_b)}
    model_trained = [x for x, _ in trained if x not in layer_tensors and x not in flow_tensors]
    copy_model = [ps.tensor for ps in states if ps.autocast_copy and ps.tensor not in layer_tensors]
    copied = {ps.tensor for ps in states if ps.autocast_copy}  # autocast caches a 16-bit copy of these
    layout = strategy.checkpoint_layout(spec.num_layers)
    segment_of: list[int] = []
    for i, n in enumerate(layout.segment_sizes):
        segment_of += [i] * n
    kinds = [g for g in inv.layers for _ in range(g.count)]
    terms_of = {g.kind: layer_terms(spec, strategy, moe=g.kind == "moe") for g in inv.layers}
    # --freeze (adapters.FrozenLayers): each layer's own trainable tensors (a layer range freezes some layers
    # only); a dead layer saves nothing and runs no backward, a wholly frozen one saves the frozen forms (where
    # they are known, as the closed form: model.stack_activations), and the lowest layer whose input needs no
    # gradient makes no input gradient.
    patterns = strategy.base_weights.frozen if strategy.adapter is None else ()
    layer_trainable = [
        {x for x in g.tensors if x in trainable and not is_frozen(x, patterns, i, layers=spec.num_layers)}
        for i, g in enumerate(kinds)
    ]
    fz = frozen_layers(spec, strategy) if patterns else None
    forms = fz is not None and frozen_forms_known(spec) and len(inv.layers) == 1
    dead = fz.dead if fz is not None else 0
    frozen_terms = frozen_layer_terms(spec, strategy) if forms else []
    input_grad_from = fz.input_grad_from if fz is not None else 0
    blind_at, blind_unsaved = blind_layer_unsaved(spec, strategy)
    first_terms = first_layer_terms(spec, strategy)  # an input that needs no gradient: saves from its first adapter
    # The KV cache's own k/v copies (training with use_cache), each layer's held until the outputs are dropped.
    cache_tensors = kv_cache_held_tensors(spec, strategy)
    dead_cache = dead_layer_cache_tensors(spec, strategy) or cache_tensors  # a dead layer's cache: its own k and v
    first_cache = first_layer_cache_bytes(spec, strategy)
    mt = model_terms(spec, strategy)
    lg = logits_memory(spec, strategy)
    # Classification heads: num_labels-wide logits (their small row-pick tensors folded into the same shape).
    n_logits = t * spec.vocab_size if spec.kind.has_vocab_logits else lg.logits_bytes // (w.compute or 1)
    temps = backward_temp_bytes(spec, strategy)
    pieces = (
        BackwardPieces.of(spec, strategy, temps.block_bytes, temps.norm_bytes)
        if rank.module_order
        else BackwardPieces((temps.block_bytes,), (), (temps.norm_bytes,))
    )
    a = w.compute
    # the LM head's output width (logits.logits_width: fp32 logits over a kbit-prepared head without autocast)
    la = lg.logits_bytes // n_logits if spec.kind.has_vocab_logits and n_logits else a
    # Materialised attention scores (eager, SDPA's math kernel): their transients around the softmax.
    chain_forward = eager_forward_moment(spec, strategy)[1]
    chain_backward = eager_backward_moment(spec, strategy)[1]
    optimizer_created = False
    # torchtune's optimizer in backward (torchtune/training/memory.py ``register_optim_in_bwd_hooks``): a parameter's
    # post-accumulate-grad hook steps its own optimizer and drops the .grad as soon as AccumulateGrad has made it —
    # in the first step the optimizer's states for it are made there, inside the first backward
    in_bwd = strategy.savers.optimizer_in_backward
    # torchtune's activation offloading, replayed without checkpointing (not under selective recompute:
    # stream_strategy)
    offload = strategy.savers.activation_offload and strategy.checkpointing is Checkpointing.NONE
    if offload:
        s.track_sizes()
    # ... and under checkpointing: each segment's input is its one pack (non-reentrant checkpoint's
    # ``_NoopSaveInputs``); its device tensor goes once the forward stash drops it, OFFLOAD_FWD_STASH segments later
    # (the first one, the embedding's output, a local of the model's forward to its return), the final norm's packs
    # drop the rest; in backward each recompute unpacks a new device copy, freed after the next segment's recompute
    # (the next unpacking node's hook), the last at the backward's end
    ckpt_offload = strategy.savers.activation_offload and strategy.checkpointing.whole_layers
    # ... over a frozen token table the first input is a leaf (enable_input_require_grads): its AccumulateGrad holds
    # it, and keeps it and its .grad (the residual gradient, stolen) as the last unpacking node to the next backward's
    # first, with the forward's LLM.int8 inputs it reaches (savers.offload_retained_bytes)
    leaf_held = ckpt_offload and offload_retained_bytes(spec, strategy)[1] > 0
    retained: list[int] = []
    # The final norm's packs of >= 1 KiB (its saved terms, once per save) drop the stash's older entries; the newest
    # OFFLOAD_FWD_STASH less that many stay on the device to the first unpacking node's end, the final norm's backward
    # (a frozen norm weight saves the normed input for nothing: one pack fewer, the top segment's input kept)
    norm_packs = (
        sum(x.saves * sum(1 for n in x.tensors() if n >= MIN_OFFLOAD_BYTES) for x in mt if x.role is TermRole.HEAD)
        if ckpt_offload
        else OFFLOAD_FWD_STASH
    )
    stash_kept = max(0, OFFLOAD_FWD_STASH - norm_packs)
    state_bits = 32 if r.master_bits else r.state_bits

    # Optimizer in backward under autocast: the head matmul's 16-bit weight gradient (of autocast's copy) is cast into
    # the .grad by ToCopyBackward0 once the matmul's node has released the copy, and the hook steps that .grad (the
    # trace's order): (the 16-bit gradient's key, the .grad's bytes) until the head's node returns
    casts: list[tuple[int, int]] = []

    def accumulated(x: ParamTensor, key: int) -> int:
        """The .grad ``key`` of one ``x`` as AccumulateGrad leaves it: kept to ``zero_grad`` (returned), or under the
        optimizer in backward stepped by the hook — the tensor's states in the first step, its step's temporaries —
        and freed (0), as the traced hook (trace.savers ``OptimizerInBackward``) runs it."""
        if not in_bwd:
            return key
        if not optimizer_created and not strategy.savers.paged_optimizer:
            rank.optimizer_states(s, strategy, [(x, 1)])
        s.free(s.alloc(tensor_step_temp_bytes(strategy, x, state_bits)))
        s.free(key)
        return 0

    tied = tied_gradient_sum(spec, strategy)
    # The out-of-place sum on one GPU and under data parallelism (states.tied_sum_modelled).
    tied_sum = tied.out_of_place_bytes if tied is not None and tied_sum_modelled(strategy) else 0
    sac_sizes = [x.bytes for x in sac_saved_terms(spec, strategy)]
    sac_kept: dict[int, list[int]] = {}
    # torchtune's chunked cross-entropy: the tokens of each chunk (torch.chunk along the sequence), the head input's
    # saved cast per chunk, a frozen head's per-chunk weight cast (savers.chunked_head_copy_bytes)
    chunk_tokens: list[int] = []
    chunk_copied: set[ParamTensor] = set()
    chunk_copy_bytes = head_in_bytes = 0
    chunk_head_trained = head_in_cast = False
    # Liger's fused linear cross-entropy: its chunks of tokens, the head weight's casts (autocast)
    fused = strategy.savers.loss is LossImpl.FUSED_LINEAR and spec.kind is ModelKind.CAUSAL_LM
    fused_chunks: list[int] = []
    fused_cast = fused_grad = 0
    if fused:
        c = liger_chunk_tokens(t, spec.vocab_size, h)
        fused_chunks = [min(c, t - start) for start in range(0, t, c)]
        head_name = "embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
        head_states = [ps for ps in states if ps.tensor.name == head_name]
        fused_cast = sum(rank.copy_bytes(ps.tensor, r.compute_bits) for ps in head_states if ps.autocast_copy)
        fused_grad = sum(_bytes(ps.tensor.numel, r.grad_bits) for ps in head_states if ps.trainable)
    if strategy.savers.loss is LossImpl.CHUNKED and spec.kind is ModelKind.CAUSAL_LM:
        step_len = -(-strategy.seq_len // strategy.savers.loss_chunks)
        chunk_tokens = [
            strategy.micro_batch * min(step_len, strategy.seq_len - start)
            for start in range(0, strategy.seq_len, step_len)
        ]
        head_name = "embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
        chunk_copied = {
            ps.tensor for ps in states if ps.tensor.name == head_name and ps.autocast_copy and not ps.trainable
        }
        chunk_copy_bytes = sum(rank.copy_bytes(x, r.compute_bits) for x in chunk_copied)
        head_in_bytes = sum(rank.saved_bytes(x.name, x.bytes) for x in mt if x.role is TermRole.HEAD_INPUT)
        head_in_cast = any(x.name.endswith(".casts") for x in mt if x.role is TermRole.HEAD_INPUT)
        chunk_head_trained = any(head_matmul_grad(spec, x) for x in model_trained)

    # Autocast caches the cast of a leaf that requires grad, whatever the grad mode, until the outermost autocast
    # region exits (aten/src/ATen/autocast_mode.cpp ``cached_cast``; torch/amp/autocast_mode.py ``__exit__`` clears
    # the cache at nesting level 0): a checkpointed forward saves nothing, but its layers' cached copies of
    # trainable weights live on to the end of the loss. A frozen weight's cast (no grad) and a transposed view's
    # (FalconLinear: not a leaf) are per call and die with it. A recomputation runs in an autocast region of its
    # own (torch/utils/checkpoint.py), so its copies are held by the saves only.
    def cached_in_forward(x: ParamTensor, i: int) -> bool:
        return spec.autocast_weight_cache and x in layer_trainable[i]

    blind_live = (
        BlindLayer.of(spec, strategy.adapter).live if flows and first_terms is not None and strategy.adapter else None
    )
    # Each layer's adapted linears' own saved tensors (by term name), freed by their backward (lora_flow_backward)
    flow_saved: dict[int, dict[str, list[int]]] = {}
    # DoRA with dropout: the weight its second base linear saved, made before the ``dora_weight`` term comes
    dora_weights: dict[str, int] = {}
    # each term list's flow-closing indices (by which list: the first layer's, the frozen, the blind, a kind's)
    closing_of: dict[tuple[str, object], dict[str, int]] = {}

    flow_of_term: dict[str, LoraFlow | None] = {}

    def flow_site(term_name: str) -> LoraFlow | None:
        hit = flow_of_term.get(term_name, flows)  # ``flows``: not looked up yet
        if hit is flows:
            name = term_name.removeprefix("lora.").rpartition(".")[0] if term_name.startswith("lora.") else None
            hit = flow_of_term[term_name] = flows.get(name) if name is not None else None
        return hit  # type: ignore[return-value]

    def lora_flow_forward(f: LoraFlow) -> tuple[int, list[int]]:
        """Before the site's saved tensors: the base layer's output (a bitsandbytes base's chain, then PEFT's clone
        of its result: :class:`Bnb4bitBase`), PEFT's unsaved input copies."""
        d_in, d_out = f.site.d_in, f.site.d_out
        if f.bnb is None:
            base = s.alloc(f.c * f.t * d_out)
        else:
            x_cast = s.alloc(f.bnb.compute * f.t * d_in) if f.w_in != f.bnb.compute else 0
            product = s.alloc(f.bnb.compute * f.t * d_out)
            result = s.alloc(f.c * f.t * d_out) if f.c != f.bnb.compute else product
            if result != product:
                s.free(product)
            s.free(x_cast)
            base = s.alloc(f.c * f.t * d_out)  # result.clone()
            s.free(result)
        return base, [s.alloc(w_ * f.t * d_in) for w_ in f.forward_temps]

    def dora_weight_norm(f: LoraFlow, temps: list[int], graphless: bool = False) -> None:
        """DoRA's weight norm (:class:`DoraCall`, :class:`DoraBnbNorm`): its locals join ``temps``, alive to the
        call's end. ``graphless``: a checkpointed forward, whose autograd nodes keep nothing (``lora_weight``'s graph
        then holds neither the cast eye nor lora_A's output: each goes once its reader's output exists)."""
        assert f.dora is not None
        d = f.dora
        d_in, d_out = f.site.d_in, f.site.d_out
        if d.bnb is not None:
            b, n = d.bnb, d_in * d_out
            eye = s.alloc(b.eye * d_in * d_in)
            eye_cast = s.alloc(b.eye_cast * d_in * d_in)
            a_out = s.alloc(b.mm * d_in * f.rank)
            if graphless:
                s.free(eye_cast)
            lora_weight = s.alloc(b.mm * n)
            s.free(eye)
            if graphless:
                s.free(a_out)
            else:
                temps += [eye_cast, a_out]
            if b.x != b.mm:
                cast = s.alloc(b.x * n)
                s.free(lora_weight)
                lora_weight = cast
            temps.append(lora_weight)
            absmax = s.alloc(4 * -(-n // b.absmax_block)) if b.absmax_block else 0
            weight = s.alloc(b.dequant * n)
            s.free(absmax)
            if b.x != b.dequant:
                cast = s.alloc(b.x * n)
                s.free(weight)
                weight = cast
            temps.append(weight)
            scaled = s.alloc(d.full * n)
            total = s.alloc(d.full * n)
            s.free(scaled)
            s.free(total)
            return
        temps += [s.alloc(d.eye * d_in * d_in), s.alloc(d.eye * d_in * f.rank), s.alloc(d.lora_weight * d_in * d_out)]
        if d.weight_copy:
            copy = s.alloc(d.weight_copy * d_in * d_out)
            if d.dropped and not d.weight_cast:  # the weight the second base linear multiplies by, and saves
                dora_weights[f.site.name] = copy
            else:
                temps.append(copy)
        scaled = s.alloc(d.full * d_in * d_out)
        total = s.alloc(d.full * d_in * d_out)
        s.free(scaled)
        s.free(total)

    def dora_base_out(f: LoraFlow, base: int, nbytes: int) -> int:
        """The base output DoRA's rescaling saves: the flow's own without dropout; with dropout the second base
        linear's, ``F.linear(x, weight)`` on the dropped input (under autocast after its casts of the weight, saved,
        and of x, freed with the call)."""
        assert f.dora is not None
        d = f.dora
        if not d.dropped:
            return base
        if d.weight_cast:
            dora_weights[f.site.name] = s.alloc(d.weight_cast * f.site.d_in * f.site.d_out)
        x_cast = s.alloc(d.x_cast * f.t * f.site.d_in) if d.x_cast else 0
        out = s.alloc(nbytes)
        s.free(x_cast)
        return out

    def lora_flow_forward_end(
        f: LoraFlow, base: int, temps: list[int], keep: bool = False, read: Sequence[int] = ()
    ) -> int:
        """After lora_A's output: lora_B's, ``* scaling``, ``result + ...`` and ``.to(torch_result_dtype)``; the
        module's output then goes to its reader (kept only where a saved term says so). DoRA: after its saved
        tensors, the rescaling's products, their sum (DoRA's locals freed as ``DoraLinearLayer.forward`` returns) and
        the layer's sum with the base output (kept as a saved term without dropout, freed after it with dropout);
        PEFT's input copies go as ``lora.Linear.forward`` returns. ``keep``: the module's output is returned (its key)
        for the caller to free when its reader is done, else freed at once (0). ``read``: DoRA's lora_B output when
        nothing saves it (a checkpointed forward), freed with DoRA's locals as its forward returns."""
        n = f.t * f.site.d_out
        if f.dora is not None:
            w = f.dora.out
            peft_temps = len(f.forward_temps)
            by_base = s.alloc(w * n)  # (mag_norm_scale - 1) * base_result
            by_lora = s.alloc(w * n)  # mag_norm_scale * lora_result
            scaled_lora = s.alloc(w * n)  # * scaling
            s.free(by_lora)
            result_dora = s.alloc(w * n)
            s.free(by_base)
            s.free(scaled_lora)
            s.free_all(temps[peft_temps:])
            s.free_all(read)  # lora_result, a local of DoraLinearLayer.forward
            # with dropout, a weight copy no ``dora_weight`` term took: its linear saved nothing (the lowest adapted
            # layer's input needs no gradient), so it is one of the call's locals
            s.free(dora_weights.pop(f.site.name, 0))
            total = s.alloc(w * n)  # result + result_dora
            s.free(result_dora)
            if f.dora.dropped:
                s.free(base)
            out = total
            # lora.Linear.forward casts back to the base output's dtype; PEFT's bnb layers only without autocast
            # (peft/tuners/lora/bnb.py ``requires_conversion``): under autocast a 4-bit base's DoRA output stays wide
            if w != f.c and (f.bnb is None or f.bnb.converts):
                out = s.alloc(f.c * n)
                s.free(total)
            s.free_all(temps[:peft_temps])
            if keep:
                return out
            s.free(out)
            return 0
        b = s.alloc(f.mm * n)
        scaled = s.alloc(f.mm * n)
        s.free(b)
        if f.bnb is not None and f.bnb.converts and f.mm != f.c:  # output.to(expected_dtype), before the sum
            converted = s.alloc(f.c * n)
            s.free(scaled)
            scaled = converted
        total = s.alloc(f.p * n)
        s.free(scaled)
        s.free(base)
        out = total
        if f.p != f.c:
            out = s.alloc(f.c * n)
            s.free(total)
        s.free_all(temps)
        if keep:
            return out
        s.free(out)
        return 0

    # Dense Llama-style layers: the forward's own fp32 RMSNorm transients and the rotary embedding's, which the
    # saved terms leave out; they are freed within the layer, so the peaks stay the closed form's, but they make and
    # reuse the 64 and 32 MiB blocks a real forward does (the H200 trace, llama-3.2-1b). With adapter flows too: a
    # q,v-only LoRA without the norm's transients left no free 14 MiB block for the final norm's fp32 input, which
    # then split the block the autograd workspace needed, and that workspace pinned a logits segment (+16.8% reserved
    # against the trace, −0.4% with them; benchmarks/reserve_agreement.py --finetune). An adapted q or v projection's
    # output is the flow's, freed at its end; rotary_qkv then makes the raw q, k, v it embeds. One GPU and DDP
    # (rank.module_order); the other ranks' streams were checked against traced ranks as they are.
    rotary = rank.module_order and any(x.name == "rope.cos_sin" for x in mt)

    def rope_tables() -> list[int]:
        """The model's rotary tables (the ``rope.cos_sin`` term) as ``LlamaRotaryEmbedding.forward`` makes them
        after the embedding's output (transformers 5.25 models/llama/modeling_llama.py, the same in the models
        generated from it): ``freqs = position_ids[..., None].float() * inv_freq`` (fp32, 1 × s × rotary_dim/2;
        position_ids is ``cache_position.unsqueeze(0)``), ``emb = torch.cat((freqs, freqs), dim=-1)``, ``cos =
        emb.cos() * self.attention_scaling`` and ``sin`` likewise (each product a new tensor, the ``cos()``/``sin()``
        freed once it exists), returned ``.to(x.dtype)`` (a copy only where the residual stream is not fp32); its
        locals die as it returns. Two fp32 tables with a freed one's hole between them, where one block of the
        term's bytes fragments a 20 MiB segment otherwise (llama-3.2-3b amp-bf16 1 × 4096, full checkpointing:
        the first layer's 24 MiB block then fitted where the trace's needs a segment of its own)."""
        n = 4 * strategy.seq_len * spec.rotary_dim
        ids = s.alloc(strategy.seq_len * 4)  # position_ids[..., None].float()
        freqs = s.alloc(n // 2)
        s.free(ids)
        emb = s.alloc(n)
        tables = []
        for _ in range(2):
            raw = s.alloc(n)
            tables.append(s.alloc(n))
            s.free(raw)
        out = tables if w.residual == 4 else [s.alloc(n * w.residual // 4) for _ in tables]
        s.free(freqs)
        s.free(emb)
        if out is not tables:
            s.free_all(tables)
        return out

    rms_transients = rank.module_order and spec.norm is NormKind.RMSNORM
    pending: list[list[int]] = []  # [key, allocations to wait]: freed once that many more saved tensors exist
    # A checkpointed forward runs under no_grad: torch.utils.checkpoint's non-reentrant forward runs under
    # ``saved_tensors_hooks`` whose pack hook keeps an empty ``_Holder`` (torch/utils/checkpoint.py
    # ``_checkpoint_hook``: the recomputation fills it), so nothing is saved and each tensor lives as long as the
    # module's Python forward holds it, not to the layer's end. For a Llama-style layer (RMSNorm, rotary; a 16-bit
    # one's saved terms NO_GRAD_TERMS, or any with adapter flows) the stream frees them where transformers' modules
    # drop them (models/llama/modeling_llama.py), one path (``nograd`` in ``layer_forward``): :func:`nograd_norm`
    # (the fp32 input once ``x * rsqrt`` is made, the cast and the locals as it returns its output),
    # :func:`nograd_attention` (q, k, v to SDPA; they, SDPA's output and the norm's output go when the attention
    # returns o_proj's), SwiGLU's gate once activated, the activation and up once multiplied, the product once
    # down_proj's output exists; the residual adds as tensors of their own, the post-attention one and the MLP's output
    # held to the layer's output (``after_layer``, freed by the caller). The adapter flows are the hooks: an adapted
    # linear's output is its flow's (``kept``, to its reader; the flow's would-be saves are PEFT's locals, gone as it
    # returns), an unadapted linear of a bitsandbytes 4-bit base runs its own chain (:func:`bnb4_linear`). Checked
    # against the trace's layer (tests/trace/test_events.py); the 16-bit layers took l1b on the H200 −13.2% → +0.00%,
    # llama-3.2-1b QLoRA +2.29% → +1.21% against the trace (benchmarks/reserve_agreement.py --finetune). Under autocast
    # over fp32 weights (``attn_in.casts``, ``mlp_in.casts``) each projection casts the fp32 norm output for its call
    # (:func:`linear`), RoPE promotes q and k to fp32 and SDPA casts them back, and the weights' cached copies are made
    # as each module first runs (:func:`weight_copy`): against the trace, amp with full checkpointing, six of nine
    # cells within 0.1% (were up to +3.4% off), one llama-3.2-3b cell +0.21% → +3.65% (a logits-segment placement;
    # docs/accuracy.md). GPT-2 and BERT layers: ``nograd_ln_layer`` below. Other layers keep their would-be saved
    # tensors to the layer's end.
    nograd_layers = rms_transients and rotary
    dropout_on = strategy.adapter is not None and strategy.adapter.dropout > 0
    after_layer: list[int] = []  # nograd: freed by the caller once the layer's output exists

    def rotary_embed(n: int, wide: int = 0) -> int:
        """``apply_rotary_pos_emb`` on one of q, k (``n`` bytes): ``x * cos``, ``rotate_half(x)`` (``neg`` of a half,
        ``cat``), ``* sin``, their sum, the embedded tensor kept (transformers models/llama/modeling_llama.py).
        ``wide``: the products' and the sum's bytes where cos and sin are wider than x (they are made in the residual
        stream's dtype, ``cos.to(x.dtype)`` in LlamaRotaryEmbedding.forward: fp32 under autocast over fp32 weights, so
        ``q * cos`` is promoted to fp32 while ``rotate_half(q)`` stays in q's dtype)."""
        wide = wide or n
        m1 = s.alloc(wide)
        neg = s.alloc(n // 2)
        cat = s.alloc(n)
        s.free(neg)
        m2 = s.alloc(wide)
        s.free(cat)
        out = s.alloc(wide)
        s.free(m1)
        s.free(m2)
        return out

    def nograd_norm(n: int, locals_: list[int]) -> int:
        """LlamaRMSNorm.forward in a checkpointed forward: ``hidden_states.to(torch.float32)`` (a copy of ``n``
        bytes unless the residual stream is fp32 already: the residual itself), ``pow(2)`` (freed by ``mean``),
        ``hidden_states * torch.rsqrt(...)`` (the fp32 copy then dropped), ``.to(input_dtype)`` when the residual is
        narrower, ``self.weight * ...``: the norm's output, which is returned (the key); ``locals_`` (rsqrt's
        small tensors) go as it returns."""
        copy = s.alloc(n) if n != hidden else 0
        s.free(s.alloc(n))
        normed = s.alloc(n)
        s.free(copy)
        cast = s.alloc(hidden) if n != hidden else 0
        out = s.alloc(hidden)
        s.free(cast)
        s.free(normed)
        s.free_all(locals_)
        locals_.clear()
        return out

    # An unadapted linear of a bitsandbytes 4-bit base in a no-grad forward runs its own chain
    # (bitsandbytes/nn/modules.py ``Linear4bit.forward``: x cast to the compute dtype, ``matmul_4bit``'s output,
    # ``.to(inp_dtype)``), as the trace shows it; a float base's is its output alone.
    unadapted_4bit = strategy.base_weights.quantization in (Quantization.NF4, Quantization.FP4)
    compute_w = w.compute

    def bnb4_linear(cast_bytes: int, product_bytes: int, out_bytes: int) -> int:
        """An unadapted 4-bit linear: its input's cast (0: none), the product, its cast back (when the widths differ);
        the output's key."""
        cast = s.alloc(cast_bytes)
        product = s.alloc(product_bytes)
        out = product
        if out_bytes != product_bytes:
            out = s.alloc(out_bytes)
            s.free(product)
        s.free(cast)
        return out

    # Autocast casts each fp32 weight as its module first runs (``cached_cast``), interleaved with the input casts: the
    # stream allocates a layer's copies at its start, except in the no-grad forward of a layer without adapter flows,
    # where the layer's other tensors are the module's own too (tests/trace/test_events.py: then the layer's
    # allocations and their high-water mark are the trace's). ``uncast``: a layer's weights by module, not cast yet;
    # ``made_casts``: their copies, by tensor.
    uncast: dict[str, list[ParamTensor]] = {}
    made_casts: dict[ParamTensor, int] = {}

    def lazy_copies(i: int, discard: bool) -> bool:
        return discard and (nograd_layers or nograd_ln) and not flows and i >= dead and spec.autocast_weight_cache

    def weight_copy(module: str) -> None:
        """The cached casts of ``module``'s weights (``attn.q_proj``: its weight and bias) before its first call."""
        for x in uncast.pop(module, []):
            made_casts[x] = s.alloc(rank.copy_bytes(x, r.compute_bits))

    def linear(cast_bytes: int, out_bytes: int) -> int:
        """A float linear under autocast (``F.linear`` is on its lower-precision list): its input's cast (0: none, the
        input already in the compute dtype), the output, the cast freed as the call returns; the output's key."""
        cast = s.alloc(cast_bytes) if cast_bytes else 0
        out = s.alloc(out_bytes)
        s.free(cast)
        return out

    def nograd_attention(saved_sizes: list[int], kept: dict[str, int]) -> tuple[list[int], list[int]]:
        """LlamaAttention.forward in a checkpointed forward, to SDPA: q, k and v as the projections returned them (an
        adapted one's output kept by its flow, ``kept``; an unadapted one's made here) in the projections' output
        dtype, the rotary embedding on q and k (:func:`rotary_qkv`'s ops) there, q's and k's projections dropped, then
        SDPA's casts of q, k and v to the saved tensors' dtype where it differs (autocast: the fp32 projections of a
        kbit-prepared model). Returns (what is held to the attention's return: the embedded q and k, v; SDPA's casts,
        freed once its output exists). Without adapters the projections return the compute dtype (the saved tensors'
        own), each after its cast of the input under autocast over fp32 weights (:func:`linear`), and the rotary
        embedding promotes q and k to the residual stream's dtype where it is wider (:func:`rotary_embed`), which SDPA
        casts back."""
        names = ("q_proj", "k_proj", "v_proj")
        adapted = [flows[x] for x in names if x in flows]
        if not adapted:
            x_cast = compute_w * strategy.tokens_per_micro_batch * h if w.residual != compute_w else 0
            raw = []
            for name, n in zip(names, saved_sizes, strict=True):
                weight_copy(f"attn.{name}")
                raw.append(linear(x_cast, n))
            rope = max(compute_w, w.residual)
            out = [rotary_embed(n, n * rope // compute_w) for n in saved_sizes[:2]]
            s.free(raw[0])
            s.free(raw[1])
            return [*out, raw[2]], [s.alloc(n) for n in saved_sizes[:2]] if rope != compute_w else []
        f0 = adapted[0]
        d_out = {x: flows[x].site.d_out for x in names if x in flows}
        saved_width = max(1, saved_sizes[names.index(f0.site.name)] // max(1, f0.t * d_out[f0.site.name]))
        wide = [n * f0.c // saved_width for n in saved_sizes]
        cast = compute_w * f0.t * f0.site.d_in if f0.w_in != compute_w else 0

        def projection(j: int) -> int:
            if unadapted_4bit:
                return bnb4_linear(cast, wide[j] * compute_w // f0.c, wide[j])
            return s.alloc(wide[j])

        raw = [kept.pop(x, 0) or projection(j) for j, x in enumerate(names)]
        out = [rotary_embed(wide[0]), rotary_embed(wide[1])]
        s.free(raw[0])
        s.free(raw[1])
        casts = [s.alloc(n) for n in saved_sizes] if f0.c != saved_width else []
        return [*out, raw[2]], casts

    def release_pending() -> None:
        for p in list(pending):
            p[1] -= 1
            if p[1] <= 0:
                s.free(p[0])
                pending.remove(p)

    # LLM.int8 (bitsandbytes/autograd/_functions.py ``MatMul8bitLt.forward``, a frozen weight's fast path): each
    # linear's input ``A.to(torch.float16)`` (a copy unless A is fp16), ``int8_vectorwise_quant``'s int8 ``CA`` and
    # fp32 row scales ``SCA``, the copy freed, then ``int8_scaled_mm``'s output in A's dtype, ``CA`` and ``SCA`` freed
    # once it exists — the trace's chain of every ``Linear8bitLt`` (trainfit.trace.peft). The grad-mode stream of an
    # int8 base without adapter flows runs it around each linear's output (:func:`int8_quant`).
    int8_chains = strategy.base_weights.quantization is Quantization.INT8 and not flows and rotary and rms_transients
    fp16_compute = strategy.recipe.compute_dtype == "fp16"

    def int8_quant(elements: int, width: int) -> list[int]:
        """``MatMul8bitLt``'s quantisation of an input of ``elements`` values ``width`` bytes wide (``tokens`` rows):
        the keys of ``CA`` and ``SCA``, to free once the output exists (none without an int8 base)."""
        if not int8_chains:
            return []
        cast = s.alloc(2 * elements) if not (width == 2 and fp16_compute) else 0
        held = [s.alloc(elements), s.alloc(4 * strategy.tokens_per_micro_batch)]
        s.free(cast)
        return held

    def int8_linear(elements: int, width: int, out_bytes: int) -> None:
        """An int8 linear whose output the stream does not hold (its reader's sum): its chain, the output, freed."""
        held = int8_quant(elements, width)
        out = s.alloc(out_bytes)
        s.free_all(held)
        s.free(out)

    def rotary_qkv(sizes: list[int]) -> list[int]:
        """q, k and v as LlamaAttention.forward makes them: the three projections' outputs, then
        ``apply_rotary_pos_emb`` (``q * cos + rotate_half(q) * sin``; ``rotate_half`` is ``cat(-x2, x1)``: ``neg``
        of a half, ``cat``) on q, then k, each projection's output freed once both are embedded; the saved
        q_embed, k_embed and v (transformers models/llama/modeling_llama.py)."""
        q_n, k_n, v_n = sizes
        t_h = strategy.tokens_per_micro_batch * h
        raw = []
        for n in (q_n, k_n, v_n):
            held = int8_quant(t_h, w.residual)
            raw.append(s.alloc(n))
            s.free_all(held)
        v = raw.pop()
        out = [rotary_embed(q_n), rotary_embed(k_n)]
        s.free_all(raw)
        return [*out, v]

    # LLM.int8: MatMul8bitLt.forward keeps its input on ``ctx.tensors`` (bitsandbytes/autograd/_functions.py), outside
    # save_for_backward, so neither checkpointing's saved-tensor hooks nor the engine's release of a node's saves
    # after it runs frees it: each layer's ``int8.*`` terms live until the graph goes after the whole backward, a
    # checkpointed forward's too; a recomputation's own go with the recomputed graph when it stops
    # (activations.int8_ctx_bytes / int8_layer_bytes, the closed form's ``int8_held``). The stream freed them with
    # each layer's saves (in a checkpointed forward at the layer's end): LoRA over LLM.int8 with full
    # checkpointing then reserved no more than the closed form's allocated peak, −9.7% against the trace.
    int8_ctx: list[int] = []  # the step's ctx-held inputs, freed after its backward
    int8_recomputed: list[int] = []  # a recomputation's, freed when it stops
    int8_site: dict[int, tuple[int, str]] = {}  # the step's: each one's layer and term (offloading's retained node)

    # The no-grad (checkpointed) forward of a GPT-2 or BERT layer (LayerNorm, a dense GELU MLP, SDPA's fused kernels;
    # no adapter flows), as transformers' modules run it (models/gpt2/modeling_gpt2.py GPT2Block / GPT2Attention /
    # GPT2MLP; models/bert/modeling_bert.py BertLayer / BertSelfAttention / BertSelfOutput / BertIntermediate /
    # BertOutput), each tensor freed with its last Python reference: LayerNorm's output (and its mean and rstd, dropped
    # at once), each linear's output after autocast's casts of its input and weights (:func:`linear`,
    # :func:`weight_copy`), q/k/v to the attention's return (GPT-2: views of c_attn's output; BERT: three outputs,
    # gone when BertSelfAttention returns, SDPA's output kept to BertAttention's), the residual dropout's mask and
    # output (``native_dropout`` under ``p > 0``), GELU (one op, or gelu_new's Python chain: ``0.5 * x``, ``pow``
    # — fp32 under autocast —, four element-wise steps and ``tanh``, each freeing the last, the product), the residual
    # adds; a pre-norm block's norm output, attention output and residual lives to the block's output (GPT2Block keeps
    # ``attn_output``), a post-norm layer's last LayerNorm is the layer's output (the caller's ``nxt``). Checked
    # against the trace's layer (tests/trace/test_events.py).
    nograd_ln = (
        rank.module_order
        and spec.model_type in NO_GRAD_LAYERNORM_TYPES
        and spec.norm is NormKind.LAYERNORM
        and spec.mlp is MlpKind.DENSE
        and not spec.rotary_dim
        and not spec.parallel_attn
        and not flows
    )
    post_norm = spec.embedding_norm and not spec.final_norm

    def nograd_ln_layer(terms: Sequence[SavedTerm]) -> None:
        """One GPT-2 / BERT layer's no-grad forward (above); what outlives it goes to ``after_layer``."""
        by = {x.name: x for x in terms}
        t_ = strategy.tokens_per_micro_batch
        i_ = spec.intermediate_size
        a_ = compute_w
        ln_w = 4 if w.amp else w.residual  # LayerNorm runs in fp32 under autocast
        x_cast = a_ * t_ * h if ln_w != a_ else 0
        dropout = spec.hidden_dropout > 0

        def layer_norm(out_bytes: int) -> int:
            out = s.alloc(out_bytes)
            s.free_all([s.alloc(4 * t_), s.alloc(4 * t_)])  # mean, rstd
            return out

        def residual_dropout(x: int) -> int:
            """``nn.Dropout`` over a linear's output ``x`` (compute dtype): the bool mask and the output, the mask
            and ``x`` dropped; without dropout the module returns ``x`` itself."""
            if not dropout:
                return x
            mask = s.alloc(t_ * h)
            out = s.alloc(a_ * t_ * h)
            s.free(mask)
            s.free(x)
            return out

        qkv = by["attn.sdpa.qkv"]
        qkv_sizes = [rank.saved_bytes(qkv.name, n) for n in qkv.tensors()]
        # the attention, from its input ``x_in`` (held by the caller)
        x_in = 0 if post_norm else layer_norm(hidden)  # GPT-2's ln_1; BERT's input is the caller's
        if spec.fused_qkv:
            weight_copy("attn.qkv_proj")
            projections = [linear(x_cast, sum(qkv_sizes))]
        else:
            projections = []
            for name, n in zip(("q_proj", "k_proj", "v_proj"), qkv_sizes, strict=True):
                weight_copy(f"attn.{name}")
                projections.append(linear(x_cast, n))
        sdpa_out = s.alloc(rank.saved_bytes("attn.sdpa.out", by["attn.sdpa.out"].bytes))
        s.free_all([s.alloc(rank.saved_bytes("attn.sdpa.lse", n)) for n in by["attn.sdpa.lse"].tensors()])
        if post_norm:
            s.free_all(projections)  # BertSelfAttention returns its context
        weight_copy("attn.o_proj")
        o_out = linear(0, a_ * t_ * h)
        if not post_norm:
            s.free(sdpa_out)
        attn_out = residual_dropout(o_out)
        if post_norm:  # BertSelfOutput: LayerNorm(dropout(dense(x)) + input)
            added = s.alloc(hidden)
            mid = layer_norm(hidden)
            s.free(added)
            s.free(attn_out)
            s.free(sdpa_out)  # BertAttention returns
        else:  # GPT2Block: attention returns (c_attn's output goes), ``attn_output + residual``, ln_1's output goes
            s.free_all(projections)
            mid = s.alloc(hidden)
            s.free(x_in)
            x_in = layer_norm(hidden)  # ln_2
        # the MLP, from ``x_in`` (GPT-2) or ``mid`` (BERT)
        weight_copy("mlp.fc1")
        fc = linear(x_cast, a_ * t_ * i_)
        n = a_ * t_ * i_
        if spec.activation == "gelu_new":
            f = 4 * t_ * i_ if w.amp else n  # pow's fp32 result, and what it promotes
            half = s.alloc(n)  # 0.5 * x
            cast = s.alloc(f) if f != n else 0
            cur = s.alloc(f)  # pow
            s.free(cast)
            for _ in range(5):  # * 0.044715, x + , * sqrt(2/pi), tanh, 1.0 +
                nxt = s.alloc(f)
                s.free(cur)
                cur = nxt
            act = s.alloc(f)
            s.free(half)
            s.free(cur)
        else:
            f = n
            act = s.alloc(n)
        s.free(fc)
        weight_copy("mlp.fc2")
        down = linear(n if f != n else 0, a_ * t_ * h)
        if not post_norm:  # GPT2MLP: c_proj's output replaces the activation
            s.free(act)
        ff = residual_dropout(down)
        if post_norm:  # BertOutput: LayerNorm(dropout(dense(x)) + input): the LayerNorm is the caller's output
            after_layer.extend([s.alloc(hidden), ff, act, mid])
        else:
            after_layer.extend([x_in, mid, attn_out, ff])

    def layer_forward(i: int, discard: bool = False, recompute: bool = False) -> tuple[list[int], list[int]]:
        g = kinds[i]
        cast_tensors = [x for x in g.tensors if x in copied]
        copies = [] if lazy_copies(i, discard) else [s.alloc(rank.copy_bytes(x, r.compute_bits)) for x in cast_tensors]
        if i < dead:  # nothing records a node: every cast dies with its call
            s.free_all(copies)
            return [], []
        saved: list[int] = []
        own: dict[str, list[int]] = {}
        flow_saved[i] = own
        open_flow: tuple[LoraFlow, int, list[int]] | None = None
        product = 0  # a frozen SwiGLU's product, the down projection's input: saved by nothing, held through it
        terms_key: tuple[str, object]
        if i == 0 and first_terms is not None:
            terms, terms_key = first_terms, ("first", None)
        elif forms and fz is not None and fz.frozen_at[i]:
            terms, terms_key = frozen_terms, ("frozen", None)
        elif blind_unsaved and i == blind_at:
            terms, terms_key = [x for x in terms_of[g.kind] if x not in blind_unsaved], ("blind", g.kind)
        else:
            terms, terms_key = terms_of[g.kind], ("kind", g.kind)
        # each flow closes after its site's last saved term (lora_A_out; DoRA's scales, or with dropout its weight)
        closing = closing_of.get(terms_key)
        if closing is None:
            closing = closing_of[terms_key] = {
                f.site.name: k for k, f in enumerate(map(flow_site, (t.name for t in terms))) if f is not None
            }
        # A checkpointed forward of a Llama-style layer: its tensors' lifetimes in a no-grad forward (see
        # ``nograd_layers`` above); the adapter flows' parts are the flows' own (``kept``, ``lora_flow_forward_end``).
        nograd = discard and nograd_layers and (bool(flows) or all(t.name in NO_GRAD_TERMS for t in terms))
        names = {x.name for x in terms}
        ln_layer = (
            discard
            and nograd_ln
            and names <= NO_GRAD_LAYERNORM_TERMS
            and "attn.sdpa.lse" in names
            and ("mlp.act" in names or ("mlp.gelu_python" in names and spec.activation == "gelu_new"))
        )
        if lazy_copies(i, discard):  # each weight's cast as its module runs (weight_copy), in a no-grad forward
            if nograd or ln_layer:
                for x in cast_tensors:
                    uncast.setdefault(x.name.rpartition(".")[0], []).append(x)
            else:
                copies = [s.alloc(rank.copy_bytes(x, r.compute_bits)) for x in cast_tensors]
        if ln_layer:
            nograd_ln_layer(terms)
            if uncast or made_casts:
                copies = [made_casts.pop(x, 0) or s.alloc(rank.copy_bytes(x, r.compute_bits)) for x in cast_tensors]
                uncast.clear()
            return copies, saved
        norm_locals: list[int] = []  # nograd: a norm's rsqrt, to its return
        attention: list[int] = []  # nograd: the attention's input (the norm's output) and locals, to its return
        block_input = 0  # nograd: the MLP's input (the post-attention norm's output), to the layer's end
        kept: dict[str, int] = {}  # nograd: adapted linears' outputs by site, to their readers
        sdpa_casts: list[int] = []  # nograd: SDPA's input casts, to its output
        for k, term in enumerate(terms):
            f = flow_site(term.name)
            if f is not None and (open_flow is None or open_flow[0] is not f):
                open_flow = (f, *lora_flow_forward(f))
                if f.dora is not None and f.dora.bnb is not None:  # DoRA's norm before lora_A(x) over a 4-bit base
                    dora_weight_norm(f, open_flow[2], graphless=discard)
            if nograd and f is None and term.name in NORM_OUTPUT_TERMS:
                continue  # the norm's cast and output: nograd_norm made them
            if nograd and f is None and term.name.startswith("norm"):
                if term.name.endswith(".rsqrt"):
                    norm_locals += [s.alloc(rank.saved_bytes(term.name, n)) for n in term.tensors()]
                    continue
                if term.name.endswith(".input_fp32") and len(term.tensors()) == 1:
                    if attention:  # the post-attention norm: the attention has returned, its output is added
                        o_out = 0
                        if "o_proj" not in flows:  # unadapted: o_proj over SDPA's output (in the compute dtype)
                            t_h = strategy.tokens_per_micro_batch * h
                            weight_copy("attn.o_proj")
                            o_out = bnb4_linear(0, compute_w * t_h, 0) if unadapted_4bit else s.alloc(compute_w * t_h)
                        s.free_all(attention[:0:-1])  # SDPA's output, v, k and q, then the attention's input
                        s.free(attention[0])
                        attention.clear()
                        after_layer.append(s.alloc(hidden))  # residual + hidden_states
                        s.free(kept.pop("o_proj", 0))
                        s.free(o_out)
                        out = nograd_norm(rank.saved_bytes(term.name, term.bytes), norm_locals)
                        s.free(block_input)
                        block_input = out
                    else:
                        attention.append(nograd_norm(rank.saved_bytes(term.name, term.bytes), norm_locals))
                    continue
            if int8_chains and not nograd and term.name == "attn.sdpa.lse":  # o_proj after SDPA, into the residual sum
                saved += [s.alloc(rank.saved_bytes(term.name, n)) for n in term.tensors()]
                release_pending()
                t_o = strategy.tokens_per_micro_batch * (spec.num_heads * spec.head_dim)
                int8_linear(t_o, compute_w, compute_w * strategy.tokens_per_micro_batch * h)
                continue
            if int8_chains and not nograd and term.name == "mlp.swiglu" and len(term.pieces) == 3:
                t_h = strategy.tokens_per_micro_batch * h
                for j, n in enumerate(term.pieces):  # gate, act, up: the projections after their chains
                    held = int8_quant(t_h, w.residual) if j != 1 else []
                    saved.append(s.alloc(rank.saved_bytes(term.name, n)))
                    s.free_all(held)
                release_pending()
                continue
            if int8_chains and not nograd and term.name == "int8.mlp_act":
                keys = [s.alloc(rank.saved_bytes(term.name, n)) for n in term.tensors()]
                (int8_recomputed if recompute else int8_ctx).extend(keys)
                if not recompute:
                    int8_site.update(dict.fromkeys(keys, (i, term.name)))
                t_i = strategy.tokens_per_micro_batch * spec.intermediate_size
                width = max(1, rank.saved_bytes(term.name, term.bytes) // t_i)
                int8_linear(t_i, width, width * strategy.tokens_per_micro_batch * h)  # down_proj into the residual sum
                release_pending()
                continue
            if nograd and term.name == "attn.sdpa.lse":
                s.free_all([s.alloc(rank.saved_bytes(term.name, n)) for n in term.tensors()])
                s.free_all(sdpa_casts)
                sdpa_casts.clear()
                continue
            if nograd and term.name in ("attn.sdpa.qkv", "attn.sdpa.out") and attention:
                if term.name == "attn.sdpa.qkv" and len(term.pieces) == 3:
                    held, sdpa_casts = nograd_attention([rank.saved_bytes(term.name, n) for n in term.pieces], kept)
                    attention += held
                else:
                    attention += [s.alloc(rank.saved_bytes(term.name, n)) for n in term.tensors()]
                continue
            if nograd and term.name == "mlp.swiglu" and len(term.pieces) in (3, 4):
                # ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: the gate's output goes once the activation is
                # made, the activation and the up projection's output once their product is, the product once
                # down_proj's output exists (LlamaMLP.forward); the pieces: gate, act, up (and the product, which a
                # trained down projection would save)
                gate, act_n, up = (rank.saved_bytes(term.name, n) for n in term.pieces[:3])
                prod_n = rank.saved_bytes(term.name, term.pieces[3]) if len(term.pieces) == 4 else gate
                t_i = strategy.tokens_per_micro_batch * spec.intermediate_size
                w_mlp = max(1, gate // t_i)  # the projections' output width
                x_cast = compute_w * strategy.tokens_per_micro_batch * h if w.residual != compute_w else 0

                def mlp_in(n: int, module: str, x_cast: int = x_cast, w_mlp: int = w_mlp) -> int:
                    weight_copy(f"mlp.{module}")
                    return bnb4_linear(x_cast, n * compute_w // w_mlp, n) if unadapted_4bit else linear(x_cast, n)

                a_key = kept.pop("act", 0)  # an adapted gate's activation, made as its flow returned
                if not a_key:
                    g_key = mlp_in(gate, "gate_proj")
                    a_key = s.alloc(act_n)
                    s.free(g_key)
                u_key = kept.pop("up_proj", 0) or mlp_in(up, "up_proj")
                product = s.alloc(prod_n)
                s.free(a_key)
                s.free(u_key)
                if not any(x.site.reads is SiteInput.MLP_ACT for x in flows.values()):
                    # down_proj over the product (a 4-bit base: its chain), its output to the layer's sum
                    t_h = strategy.tokens_per_micro_batch * h
                    weight_copy("mlp.down_proj")
                    if unadapted_4bit:
                        out = bnb4_linear(
                            gate * compute_w // w_mlp if w_mlp != compute_w else 0, compute_w * t_h, w_mlp * t_h
                        )
                    else:
                        out = s.alloc(w_mlp * t_h)
                    s.free(product)
                    after_layer.append(out)
                    product = 0
                continue
            if term.role is TermRole.SOFTMAX_OUTPUT and chain_forward:
                transient = s.alloc(chain_forward)  # the score chain's input and copies around the softmax
                saved += [s.alloc(rank.saved_bytes(term.name, n)) for n in term.tensors()]
                s.free(transient)
                continue
            if rotary and term.name == "attn.sdpa.qkv" and len(term.pieces) == 3:
                saved += rotary_qkv([rank.saved_bytes(term.name, n) for n in term.pieces])
                release_pending()
                continue
            if f is not None and f.dora is not None and open_flow is not None and term.name.endswith(".dora_base_out"):
                keys = [dora_base_out(f, open_flow[1], rank.saved_bytes(term.name, term.bytes))]
            elif f is not None and term.name.endswith(".dora_weight") and f.site.name in dora_weights:
                keys = [dora_weights.pop(f.site.name)]
            else:
                keys = [s.alloc(rank.saved_bytes(term.name, n)) for n in term.tensors()]
            if term.name.startswith("int8.") and f is None:
                (int8_recomputed if recompute else int8_ctx).extend(keys)
                if not recompute:
                    int8_site.update(dict.fromkeys(keys, (i, term.name)))
                keys = []
            saved += keys
            release_pending()
            if rms_transients and term.name.endswith(".input_fp32") and len(keys) == 1:
                # LlamaRMSNorm.forward: ``hidden_states.to(torch.float32)`` (the saved input), ``.pow(2)`` (freed
                # by ``mean``), ``hidden_states * torch.rsqrt(variance + eps)`` (fp32, held until the weight's
                # product of its 16-bit cast, the next two tensors, is made)
                n = rank.saved_bytes(term.name, term.bytes)
                s.free(s.alloc(n))
                pending.append([s.alloc(n), 2])
            if f is not None:
                own[term.name] = keys
                plain = f.dora is None or f.dora.bnb is not None  # DoRA over a 4-bit base: its x is the caller's
                if nograd and plain and term.name.endswith(".lora_A_out") and (w.amp or dropout_on):
                    # lora_A's input under autocast (its cast) or after dropout (the dropped copy) is a temporary of
                    # ``lora_A(dropout(x))``, gone once lora_A's output exists; PEFT's own cast is ``x``, to the
                    # call's end
                    for key in own.pop(f"lora.{f.site.name}.lora_in", []):
                        saved.remove(key)
                        s.free(key)
                if f.dora is not None and f.dora.bnb is None and term.name.endswith(".lora_A_out") and open_flow:
                    dora_weight_norm(f, open_flow[2])
                if closing[f.site.name] == k and open_flow is not None:
                    read: list[int] = []
                    if nograd and f.dora is not None and f.dora.bnb is not None:
                        read = own.pop(f"lora.{f.site.name}.dora_lora_out", [])
                        for key in read:
                            saved.remove(key)
                    result = lora_flow_forward_end(*open_flow, keep=nograd, read=read)
                    open_flow = None
                    if f.site.name == "down_proj":  # the MLP's output: to the layer's ``residual + hidden_states``
                        after_layer.append(result)
                    elif f.site.name == "gate_proj" and spec.mlp is MlpKind.GATED and result:
                        kept["act"] = s.alloc(f.c * f.t * f.site.d_out)  # act_fn(gate_proj(x)), then the gate's goes
                        s.free(result)
                    elif result:
                        kept[f.site.name] = result
                    if discard:
                        # a checkpointed forward saves nothing: what the flow would save are locals of PEFT's
                        # forward (its input copy, the dropout's output and mask, lora_A's, DoRA's), gone when
                        # it returns, not at the layer's end (the module's result is the flow's own output)
                        prefix = f"lora.{f.site.name}."
                        for name in [x for x in own if x.startswith(prefix)]:
                            for key in own.pop(name):
                                saved.remove(key)
                                s.free(key)
                    if f.site.reads is SiteInput.MLP_ACT:
                        s.free(product)
                        product = 0
            elif flows and term.name == "mlp.swiglu" and term.pieces:
                # act(gate) * up: a frozen down projection keeps no input (LlamaMLP.forward
                # ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``); an unadapted one's output is the residual
                # stream's next input, a tensor the stream does not hold
                product = s.alloc(rank.saved_bytes(term.name, term.pieces[0]))
                if not any(x.site.reads is SiteInput.MLP_ACT for x in flows.values()):
                    out = s.alloc(hidden)
                    s.free(product)
                    s.free(out)
                    product = 0
        s.free(product)
        s.free_all(attention)
        s.free_all(norm_locals)
        s.free_all(sdpa_casts)
        s.free_all(kept.values())
        s.free(block_input)
        for k, _ in pending:
            s.free(k)
        pending.clear()
        if uncast or made_casts:  # the casts made by the modules, in the layer's tensor order (the caller's)
            copies = [made_casts.pop(x, 0) or s.alloc(rank.copy_bytes(x, r.compute_bits)) for x in cast_tensors]
            uncast.clear()
        return copies, saved

    def lora_flow_backward(f: LoraFlow, i: int, saved: list[int], layer_grads: list[int], micro: int) -> None:
        """One adapted linear's backward, the reverse of :func:`lora_flow_forward`'s ops (derivatives.yaml: ``_to_copy``
        casts the gradient back, ``add`` hands it to both branches in each one's dtype, ``mul`` by the scaling makes a
        new one, ``mm`` its weight's and input's gradients): lora_B's weight gradient and lora_A's output gradient, then
        lora_A's, its input gradient back through the casts, the base layer's input gradient and their sum. The
        incoming gradient of a linear whose output joins the residual stream (o_proj, down_proj) is the residual
        gradient, held by the stream; of the others it is made by the reader's backward and freed once consumed."""
        n_out, n_in = f.t * f.site.d_out, f.t * f.site.d_in
        own = flow_saved.get(i, {})

        def release(suffix: str) -> None:
            for k in own.pop(f"lora.{f.site.name}.{suffix}", []):
                if k in saved:
                    saved.remove(k)
                    s.free(k)

        def grad(x: ParamTensor) -> None:
            key = s.alloc(rank.grad_bytes(x, 8 * f.ad))
            if micro:  # accumulating: added into the resident .grad, dropped
                s.free(key)
            else:
                layer_grads.append(accumulated(x, key))

        needs_input = blind_live is None or i > 0 or f.site.reads in blind_live
        g_in = 0 if f.site.reads in (SiteInput.ATTN_OUT, SiteInput.MLP_ACT) else s.alloc(f.c * n_out)
        g_base = 0
        g = s.alloc(f.p * n_out) if f.p != f.c else 0  # the cast back's gradient
        if g:
            s.free(g_in)
            g_in = 0
            g_base = s.alloc(f.c * n_out)  # the base branch's, in the base output's dtype
        if f.bnb is not None:
            # the branch's gradient in its own dtype (the sum's backward, or the conversion's), then ``* scaling``
            cast = s.alloc(f.mm * n_out) if f.mm != f.c else 0
            scaled = s.alloc(f.mm * n_out)
            s.free(cast)
            s.free(g)
        else:
            scaled = s.alloc(f.p * n_out)
            s.free(g)
            if f.mm != f.p:
                narrowed = s.alloc(f.mm * n_out)
                s.free(scaled)
                scaled = narrowed
        grad(f.lora_b)
        g_a_out = s.alloc(f.mm * f.t * f.rank)
        s.free(scaled)
        release("lora_A_out")
        grad(f.lora_a)
        g_x = s.alloc(f.mm * n_in) if needs_input else 0
        s.free(g_a_out)
        release("lora_in")
        release("dropout_mask")
        if needs_input:
            for width in f.grad_chain:
                nxt = s.alloc(width * n_in)
                s.free(g_x)
                g_x = nxt
            if f.bnb is None:
                g_x_base = s.alloc(f.w_in * n_in)
            else:  # MatMul4Bit.backward: the gradient cast, the dequantised weight, the input's gradient, its cast
                wide = f.bnb.compute
                g_cast = s.alloc(wide * n_out) if f.c != wide else 0
                weight = s.alloc(wide * f.site.d_in * f.site.d_out)
                g_a = s.alloc(wide * n_in)
                s.free(weight)
                s.free(g_cast)
                g_x_base = s.alloc(f.w_in * n_in) if f.w_in != wide else g_a
                if g_x_base != g_a:
                    s.free(g_a)
            s.free(g_base)
            s.free(g_in)
            total = s.alloc(f.w_in * n_in)
            s.free_all((g_x, g_x_base, total))
        else:
            s.free(g_base)
            s.free(g_in)

    # Gradient accumulation (one GPU, a DDP or DTensor TP rank): the first micro-step makes each .grad, the next
    # ones add into them (resident through their forward and backward); the micro-steps after the second repeat
    # it, and are not replayed. An FSDP2 rank's hooks take each micro-step's gradients as the first's
    # (RankHooks.reduces_each_micro_step), as do ZeRO-2's and ZeRO-1's; ZeRO-3's model one (its persistent
    # gradient partition makes a later micro-step the first's: RankHooks.replays_accumulation).
    micro_steps = rank.micro_steps(strategy.grad_accum)
    # The autograd thread's workspaces come with its first cuBLAS call, the head's first matmul in the first
    # backward: right after that matmul's output (the H200 trace; trainfit.allocator.process on why it matters).
    autograd_ws = [(k, ws) for k, ws in enumerate(workspaces) if ws.thread is Thread.AUTOGRAD]

    def first_matmul_done() -> None:
        while autograd_ws:
            k, ws = autograd_ws.pop(0)
            s.workspace(ws.size_bytes, workspace_key(k), ws.stream)

    def loss(forward_cache: list[int], kv_cache: list[int]) -> tuple[int, list[int], int]:
        """The standard loss, forward and backward, to the head's backward: the logits' gradient (its key)."""
        # The loss: 16-bit logits, their fp32 copy, the log-softmax output kept for backward.
        gather = rank.logits_gather(s)
        logits = s.alloc(la * n_logits)
        s.free_all(gather)
        upcast = s.alloc(4 * n_logits) if la != 4 and spec.kind in (ModelKind.CAUSAL_LM, ModelKind.TOKEN_CLS) else 0
        rest = max(0, lg.forward_peak_bytes - la * n_logits - (4 * n_logits if upcast else 0))
        log_softmax = s.alloc(rest)
        s.free(upcast)
        s.free_all(forward_cache)  # the autocast region exits
        s.free(logits)  # the HF Trainer drops the outputs before backward
        s.free_all(kv_cache)  # with them the cache
        rank.backward_begin(s)

        # Backward: the loss gradients, then the head (the autograd thread's workspaces after its first matmul).
        # nll_loss's dense gradient, then log_softmax's (fp32; a masked-LM's autocast log_softmax returns the
        # 16-bit input's dtype), then the fp32 copy's backward casts it back to the logits' dtype.
        # Without the upcast or autocast (a masked LM's cross-entropy over 16-bit logits: BertForMaskedLM calls
        # CrossEntropyLoss on them as they are) log_softmax and both gradients are in the logits' dtype
        # (derivatives.yaml: ``nll_loss_backward``'s and ``_log_softmax_backward_data``'s outputs take their input's).
        lp = 4 if upcast or w.amp else la
        g_nll = s.alloc(lp * n_logits)
        mlm_amp = spec.kind is ModelKind.MASKED_LM and w.amp
        g_lsm = s.alloc((a if mlm_amp else lp) * n_logits)
        s.free(g_nll)
        s.free(log_softmax)
        g_logits = g_lsm
        if upcast:
            g_logits = s.alloc(la * n_logits)
            s.free(g_lsm)
        rank.head_backward_begin(s)
        return g_logits, [], 0

    def fused_loss(forward_cache: list[int], kv_cache: list[int]) -> tuple[int, list[int], int]:
        """Liger's fused linear cross-entropy (liger_kernel/ops/fused_linear_cross_entropy.py
        ``fused_linear_cross_entropy_forward``) as the trace runs it (trace.savers ``FusedLinearCrossEntropy``): in the
        head's forward ``grad_input = zeros_like(x)``, ``grad_weight = zeros_like(weight)`` (a trainable head) and the
        fp32 per-token loss; per chunk of tokens (savers.liger_chunk_tokens) ``x_c @ weight.t()`` — under autocast a
        cast of the weight (a transposed view: not cached) and of ``x_c`` — into the chunk's logits, overwritten in
        place by their gradient; ``logits @ weight`` (under autocast the weight's cast, cached for a trainable leaf to
        the end of the forward, else made per call) copied into ``grad_input``'s rows; ``x_c``'s cast for the in-place
        ``addmm`` into ``grad_weight``. No logits are kept and the backward makes nothing: ``grad_input`` (saved) is the
        head input's gradient, ``grad_weight`` the head's. Returns no logits gradient, ``grad_input`` as the one piece
        of the input's gradient and ``grad_weight``."""
        gather = rank.logits_gather(s)
        s.free_all(gather)
        vocab = spec.vocab_size
        g_in = s.alloc(hidden)
        g_w = s.alloc(fused_grad)
        loss_1d = s.alloc(4 * t)
        cached = 0
        for c in fused_chunks:
            w_cast = s.alloc(fused_cast)
            x_cast = s.alloc(a * c * h) if fused_cast else 0
            logits = s.alloc(la * c * vocab)
            s.free(x_cast)
            s.free(w_cast)
            if fused_cast and not cached:
                cached = s.alloc(fused_cast)  # ``logits @ weight``: autocast's cast (per call when frozen)
            rows = s.alloc(a * c * h)
            s.free(rows)  # copied into grad_input
            if not fused_grad:
                s.free(cached)
                cached = 0
            else:
                s.free(s.alloc(a * c * h if fused_cast else 0))  # x_c's cast for the addmm into grad_weight
            s.free(logits)
        s.free(loss_1d)
        s.free(cached)  # the autocast region exits
        s.free_all(forward_cache)
        s.free_all(kv_cache)
        rank.backward_begin(s)
        rank.head_backward_begin(s)
        return 0, [g_in], g_w

    def chunked_loss(
        forward_cache: list[int], kv_cache: list[int], head_copies: list[int]
    ) -> tuple[int, list[int], int]:
        """torchtune's chunked cross-entropy (``TransformerDecoder`` with ``num_output_chunks``: ``[self.output(c) for
        c in h.chunk(N, dim=1)]``; ``CEWithChunkedOutputLoss``: each chunk ``.float()`` and ``cross_entropy`` on its
        own, torchtune/modules/loss/ce_chunked_output_loss.py) as the trace runs it, to the head's per-chunk matmul
        backwards: per chunk the head input's cast (autocast; a frozen head's weight cast too, not cached) and its
        logits; per chunk the fp32 copy, freed, and the log-softmax output, kept; the logits dropped. Backward:
        every chunk's loss backward first, last chunk first (each loss node is younger than every head matmul), its
        logits gradient kept; then each chunk's head matmul backward, last chunk first: the weight's gradient (the
        first two summed out of place, the first being a view, input_buffer.cpp ``accumulate``; the later ones in
        place), the input's gradient (cast to the residual dtype), the chunk's saved casts and logits gradient
        freed. Returns no logits gradient, the input gradient's pieces (SplitBackward cats them) and the summed
        16-bit weight gradient (under autocast, ``ToCopyBackward0`` casts it into the .grad)."""
        gather = rank.logits_gather(s)
        s.free_all(gather)
        vocab = spec.vocab_size
        ins, casts, chunk_logits, saved = [], [], [], []
        # The head's input: under autocast a cast per chunk; else the final norm's output, whose sequence chunks are
        # views, copied by ``F.linear``'s reshape when not contiguous (micro-batch > 1), the copies saved.
        whole = s.alloc(head_in_bytes) if head_in_bytes and not head_in_cast else 0
        per_chunk = head_in_cast or strategy.micro_batch > 1
        for ct in chunk_tokens:
            casts.append(s.alloc(chunk_copy_bytes) if chunk_copy_bytes else 0)
            ins.append(s.alloc(head_in_bytes * ct // t) if head_in_bytes and per_chunk else 0)
            chunk_logits.append(s.alloc(la * ct * vocab))
        if per_chunk:
            s.free(whole)
            whole = 0
        for ct in chunk_tokens:
            upcast = s.alloc(4 * ct * vocab) if la != 4 else 0
            saved.append(s.alloc(4 * ct * vocab))
            s.free(upcast)
        s.free_all(forward_cache)  # the autocast region exits
        s.free_all(reversed(chunk_logits))  # the outputs are dropped before backward
        s.free_all(kv_cache)
        rank.backward_begin(s)
        g_chunks = [0] * len(chunk_tokens)
        for k in reversed(range(len(chunk_tokens))):
            ct = chunk_tokens[k]
            g_nll = s.alloc(4 * ct * vocab)
            g_lsm = s.alloc(4 * ct * vocab)
            s.free(g_nll)
            s.free(saved[k])
            g_chunks[k] = g_lsm
            if la != 4:
                g_chunks[k] = s.alloc(la * ct * vocab)
                s.free(g_lsm)
        rank.head_backward_begin(s)
        table = a * vocab * h
        wsum = 0
        pieces_: list[int] = []
        for j, k in enumerate(reversed(range(len(chunk_tokens)))):
            ct = chunk_tokens[k]
            wg = s.alloc(table) if chunk_head_trained else 0
            first_matmul_done()
            g_in = s.alloc(a * ct * h)
            s.free(g_chunks[k])
            s.free(casts[k])
            s.free(ins[k])
            if k == 0:
                s.free(whole)  # the last chunk's backward releases the saved views' storage
                s.free_all(head_copies)  # and autocast's cached head copy, saved by every chunk's matmul
                head_copies.clear()
            if j == 0:
                wsum = wg
            elif j == 1 and wg:
                total = s.alloc(table)
                s.free(wsum)
                s.free(wg)
                wsum = total
            else:
                s.free(wg)
            if w.residual != a:
                piece = s.alloc(rank.residual_bytes(w.residual * ct * h))
                s.free(g_in)
                g_in = piece
            pieces_.append(g_in)
        return 0, pieces_, wsum

    for step in range(steps):
        grads: list[int] = []  # each trained tensor's .grad: made in the first micro-step, kept to the step
        for micro_step in range(micro_steps):
            rank.micro_step_begin(s, micro_step)
            micro = 0 if rank.reduces_each_micro_step else micro_step  # autograd adds into a resident .grad
            inputs = [s.alloc(8 * t), s.alloc(8 * t)]  # input ids, labels
            if step == 0 and micro_step == 0:
                for k, ws in enumerate(workspaces):
                    if ws.thread is Thread.MAIN:
                        s.workspace(ws.size_bytes, workspace_key(k), ws.stream)
            rank.forward_begin(s)
            embedding = [
                s.alloc(x.bytes)
                for x in mt
                if x.role is TermRole.EMBEDDING and not (rotary and x.name == "rope.cos_sin")
            ]
            rank.embedding_forward_end(s)
            layers: list[tuple[list[int], list[int]]] = []
            kept: list[int] = []
            stash: list[int] = []  # offloading under checkpointing: the packed segment inputs still on the device
            stash_first = 0  # ... the first of them, the embedding's output
            unpacked_prev = 0  # ... in backward, the copy unpacked for the segment recomputed before
            forward_cache: list[int] = []  # checkpointed layers' cached autocast copies, freed after the loss
            kv_cache: list[int] = []
            residual = s.alloc(hidden)
            if rotary:
                embedding += rope_tables()
            offloaded: dict[int, list[int]] = {}  # activation offloading: each layer's offloaded saves' bytes
            for i in range(spec.num_layers):
                kept_input = bool(segment_of) and (i == 0 or segment_of[i] != segment_of[i - 1])
                if kept_input and ckpt_offload:  # packed: to the host, its device tensor to the stash
                    stash.append(residual)
                    if len(stash) > OFFLOAD_FWD_STASH:
                        gone = stash.pop(0)
                        if gone != stash_first:
                            s.free(gone)
                    if i == 0:
                        stash_first = residual
                elif kept_input:  # the segment's input, kept for its recompute: the residual tensor itself
                    kept.append(residual)
                rank.layer_forward_begin(s, i)
                copies, saved = layer_forward(i, discard=bool(segment_of))
                cached = dead_cache if i < dead else cache_tensors
                kv_cache += [s.alloc(rank.saved_bytes("attn.kv_cache", n)) for n in cached]
                if i == 0 and first_cache:
                    kv_cache.append(s.alloc(rank.saved_bytes("attn.kv_cache", first_cache)))
                if segment_of:  # a checkpointed call saves nothing; only autocast's cache holds copies
                    s.free_all(saved)
                    cast = [x for x in kinds[i].tensors if x in copied] if copies else []
                    forward_cache += [c for c, x in zip(copies, cast, strict=True) if cached_in_forward(x, i)]
                    s.free_all(c for c, x in zip(copies, cast, strict=True) if not cached_in_forward(x, i))
                    copies, saved = [], []
                    sac_kept[i] = [s.alloc(n) for n in sac_sizes]  # sac: the save list's outputs, cached
                if offload:
                    # torchtune's OffloadActivations: the layer's saves of >= 1 KiB go to pinned host memory, their
                    # device tensors freed once out of the forward stash (here at the layer's end); autocast's cached
                    # copies live to the autocast region's exit, a frozen weight's per-call cast dies with its call
                    sizes = s.sizes if s.sizes is not None else {}
                    big = [k for k in saved if sizes.get(k, 0) >= MIN_OFFLOAD_BYTES]
                    offloaded[i] = [sizes[k] for k in big]
                    s.free_all(big)
                    saved = [k for k in saved if sizes.get(k, 0) < MIN_OFFLOAD_BYTES]
                    cast = [x for x in kinds[i].tensors if x in copied] if copies else []
                    forward_cache += [c for c, x in zip(copies, cast, strict=True) if cached_in_forward(x, i)]
                    s.free_all(c for c, x in zip(copies, cast, strict=True) if not cached_in_forward(x, i))
                    copies = []
                layers.append((copies, saved))
                nxt = s.alloc(hidden)
                s.free_all(after_layer)  # a no-grad forward's post-attention residual and MLP output
                after_layer.clear()
                if not kept_input:
                    s.free(residual)
                residual = nxt
                rank.layer_forward_end(s, i)
            rank.head_forward_begin(s)
            head_copies = [
                s.alloc(rank.copy_bytes(x, r.compute_bits)) for x in copy_model if x not in chunk_copied and not fused
            ]
            head = [
                s.alloc(rank.saved_bytes(x.name, x.bytes))
                for x in mt
                if x.role is TermRole.HEAD or (x.role is TermRole.HEAD_INPUT and not (chunk_tokens or fused))
            ]
            if ckpt_offload:  # the final norm's packs drop the stash; the model's forward returns
                tail = stash[len(stash) - stash_kept :] if stash_kept else []
                s.free_all(k for k in stash if k != stash_first and k not in tail)
                if not leaf_held and stash_first not in tail:
                    s.free(stash_first)
                retained += [k for k in tail if not (leaf_held and k == stash_first)]
                stash.clear()
            s.free(residual)
            if chunk_tokens:
                g_logits, g_chunks, wsum = chunked_loss(forward_cache, kv_cache, head_copies)
            elif fused:
                g_logits, g_chunks, wsum = fused_loss(forward_cache, kv_cache)
            else:
                g_logits, g_chunks, wsum = loss(forward_cache, kv_cache)
            model_grads: list[int] = []
            table_grad = 0  # the tied table's gradient, allocated with the head's backward
            waiting = 0  # the head's gradient of a tied table, in autograd's input buffer, when the hooks hold none
            deferred: ParamTensor | None = None  # a tied table the hooks take after autograd's sum
            head_grads: list[tuple[ParamTensor, int]] = []  # the head's, for hooks that take them after its backward
            # optimizer in backward: the head matmul's gradients, stepped once its node has returned
            in_node: list[tuple[ParamTensor, int]] = []
            # The head's own gradients first (its matmul's weight gradient, then its input gradient, ``None`` here);
            # the final norm's, a head transform's, after it, from the nodes that follow (head_matmul_grad), each
            # hook at once
            after_head = [
                x
                for x in model_trained
                if rank.early_grad(spec, x) and not head_matmul_grad(spec, x) and not x.name.startswith("embed")
            ]
            g_res = 0
            # Liger's grad_weight, and a chunked loss's summed head gradient in the gradient's dtype, *are* the .grad
            # (AccumulateGrad steals a gradient it can; under autocast a chunked sum is cast into it, then freed)
            carried = wsum if fused or r.grad_bits // 8 == a else 0

            def head_grad(x: ParamTensor, nbytes: int, cast: bool = False) -> int:
                nonlocal carried, wsum
                if carried and head_matmul_grad(spec, x):
                    key, carried, wsum = carried, 0, 0
                    return key
                if (in_bwd or cast) and head_matmul_grad(spec, x) and x in copied and a != r.grad_bits // 8:
                    casts.append((s.alloc(rank.copy_bytes(x, r.compute_bits)), nbytes))
                    return casts[-1][0]
                return s.alloc(nbytes)

            for x in [*(x for x in model_trained if x not in after_head), None, *after_head]:
                if x is None:
                    s.free(wsum)  # chunked: the summed 16-bit head gradient, cast into the .grad
                    # Liger's grad_input is the head input's gradient; a chunked loss's pieces are concatenated
                    g_res = g_chunks.pop() if fused else s.alloc(hidden)
                    first_matmul_done()
                    s.free(g_logits)
                    s.free_all(g_chunks)  # chunked: the input gradient's pieces, now concatenated
                    if casts:
                        s.free_all(head_copies)  # the matmul's saved copy goes with its node
                        head_copies.clear()
                    for g16, nbytes in casts:
                        key = s.alloc(nbytes)
                        s.free(g16)
                        model_grads = [key if k == g16 else k for k in model_grads]
                        in_node = [(y, key if k == g16 else k) for y, k in in_node]
                        table_grad = key if table_grad == g16 else table_grad
                    casts.clear()
                    if head_grads:
                        rank.head_grads_taken(s, head_grads)
                        head_grads.clear()
                    for y, key in in_node:  # their AccumulateGrad nodes run next
                        accumulated(y, key)
                    in_node.clear()
                elif x.name == "embed_tokens.weight" and tied is not None and rank.defers_tied_table():
                    # The hooks fire on the table's AccumulateGrad, after the embedding's gradient is added to the
                    # head's, which waits in autograd's input buffer until then
                    waiting = s.alloc(tied.embedding_grad_bytes)
                    first_matmul_done()
                    deferred = x
                elif rank.early_grad(spec, x) and micro:
                    # Accumulating: each new gradient is added into the resident .grad and dropped
                    # (AccumulateGrad, torch/csrc/autograd/functions/accumulate_grad.h: ``variable_grad +=
                    # new_grad`` with grad mode off); a tied table's waits for the embedding's, summed first.
                    new = head_grad(x, rank.grad_bytes(x, r.grad_bits))
                    first_matmul_done()
                    if x.name == "embed_tokens.weight" and tied is not None:
                        waiting = new
                    else:
                        s.free(new)
                elif rank.early_grad(spec, x) and rank.defers_head_grads():
                    head_grads.append((x, head_grad(x, x.numel * r.grad_bits // 8)))
                    first_matmul_done()
                elif rank.early_grad(spec, x) and in_bwd and x.name != "embed_tokens.weight":
                    # optimizer in backward (a tied table's waits for the embedding's gradient, below)
                    key = head_grad(x, rank.grad_bytes(x, r.grad_bits))
                    first_matmul_done()
                    if head_matmul_grad(spec, x):
                        in_node.append((x, key))
                    else:
                        accumulated(x, key)
                elif rank.early_grad(spec, x):
                    model_grads.append(head_grad(x, rank.grad_bytes(x, r.grad_bits), cast=True))
                    first_matmul_done()
                    if x.name == "embed_tokens.weight":
                        table_grad = model_grads[-1]
                        if not table_grad and tied is not None and tied_sum_modelled(strategy):
                            waiting = s.alloc(tied.embedding_grad_bytes)
            if head_grads:
                rank.head_grads_taken(s, head_grads)
            s.free_all(head_copies)
            s.free_all([s.alloc(rank.residual_bytes(n)) for n in pieces.norm])  # the final norm's backward
            s.free_all(retained)  # its node replaces the last backward's last unpacking node
            retained.clear()
            s.free_all(head)
            if not micro:
                model_grads = rank.head_backward_end(s, model_grads)
            grads += model_grads
            for i in reversed(range(dead, spec.num_layers)):  # a dead layer has no backward
                g = kinds[i]
                copies, saved = layers[i]
                if i in offloaded:  # unpacked: a new device copy of each offloaded save, to the layer's end
                    saved = saved + [s.alloc(n) for n in offloaded.pop(i)]
                if segment_of and (i == spec.num_layers - 1 or segment_of[i] != segment_of[i + 1]):
                    # Recompute the segment that ends here: every layer of it saves again.
                    seg = segment_of[i]
                    unpacked = s.alloc(hidden) if ckpt_offload else 0  # offloaded: the input back as a new copy
                    for j in [k for k in range(spec.num_layers) if segment_of[k] == seg]:
                        s.free_all(sac_kept.pop(j, []))  # the recomputation takes them over (no new allocation)
                        layers[j] = layer_forward(j, recompute=True)
                    s.free_all(int8_recomputed)  # the recomputation stops: its graph's ctx-held inputs go
                    int8_recomputed.clear()
                    s.free(unpacked_prev)
                    unpacked_prev = unpacked
                    copies, saved = layers[i]
                rank.layer_backward_begin(s, i)
                own = layer_trainable[i]
                # Each weight's gradient as its node runs (one GPU, DDP: rank.module_order; no adapter flows, not
                # accumulating): the MLP's in reverse (down, up, gate: their MmBackward nodes, each weight gradient
                # made beside the MLP's transients), then the rest of the layer's in reverse module order (the
                # post-attention norm's, o, v, k, q, the input norm's); the others at the layer's start.
                staged = rank.module_order and not micro and not flows and bool(pieces.mlp)
                mlp_own = [x for x in g.tensors if x in own and x.name.startswith("mlp.")] if staged else []
                grad_key: dict[ParamTensor, int] = {}
                for x in reversed(mlp_own[-1:]):
                    grad_key[x] = accumulated(x, s.alloc(rank.grad_bytes(x, r.grad_bits)))
                layer_grads = (
                    []
                    if micro or staged
                    else [accumulated(x, s.alloc(rank.grad_bytes(x, r.grad_bits))) for x in g.tensors if x in own]
                )
                for x in g.tensors if micro else ():
                    if x in own:  # accumulating: added into the resident .grad, dropped
                        s.free(s.alloc(rank.grad_bytes(x, r.grad_bits)))
                layer_flows = list(flows.values()) if i >= dead else []
                for f in reversed([f for f in layer_flows if f.site.in_mlp]):
                    lora_flow_backward(f, i, saved, layer_grads, micro)
                mlp_temps = [s.alloc(n) for n in pieces.mlp]  # the MLP's backward
                for x in reversed(mlp_own[:-1]):
                    grad_key[x] = accumulated(x, s.alloc(rank.grad_bytes(x, r.grad_bits)))
                s.free_all(mlp_temps)
                if staged:
                    for x in reversed([x for x in g.tensors if x in own and x not in grad_key]):
                        grad_key[x] = accumulated(x, s.alloc(rank.grad_bytes(x, r.grad_bits)))
                    layer_grads = [grad_key[x] for x in g.tensors if x in own]
                s.free_all([s.alloc(n) for n in pieces.in_block_norm])  # the norm after it (pre-norm: its input's)
                for f in reversed([f for f in layer_flows if not f.site.in_mlp]):
                    lora_flow_backward(f, i, saved, layer_grads, micro)
                chain = s.alloc(chain_backward)
                g_next = s.alloc(hidden) if i >= input_grad_from else 0
                s.free(chain)
                s.free_all(saved)
                s.free_all(copies)
                s.free(g_res)
                g_res = g_next
                if not micro:
                    grads += [k for k in rank.layer_backward_end(s, i, layer_grads) if k]
                if segment_of and (i == 0 or segment_of[i] != segment_of[i - 1]) and not ckpt_offload:
                    s.free(kept.pop())
            if tied is not None:
                # A tied table: the embedding's dense gradient meets the head's (states.tied_gradient_sum); out of
                # place, the sum takes the head's gradient's place and both inputs are released. ZeRO-1/2's hooks
                # (RankHooks.defers_tied_table) take the sum then, into their bucket, as the traced engine shows (the
                # stream took it with the head's: +22% allocated under ZeRO-Offload, where the table's fp64 norm copy
                # then met the top layers' activations). Other hooks that copy each gradient at once (ZeRO-3's IPG
                # bucket, DDP's bucket view) stand their copy for the sum; the head's gradient waited for the
                # embedding's beside it (the closed form's BACKWARD_EMBEDDING moment).
                emb_grad = s.alloc(tied.embedding_grad_bytes)
                table_now = table_grad  # the table's .grad after the sum
                if deferred is not None:
                    # autograd's sum (out of place: a third table, then both inputs go; in place: into the head's)
                    summed = s.alloc(tied_sum) if tied_sum else waiting
                    if tied_sum:
                        s.free(waiting)
                    s.free(emb_grad)
                    rank.tied_table_grad(s, deferred, summed)
                elif micro:  # accumulating: the out-of-place sum is transient too, added into the .grad
                    total = s.alloc(tied_sum)
                    s.free_all((waiting, emb_grad, total))
                elif tied_sum and table_grad:
                    total = s.alloc(tied_sum)
                    s.free(table_grad)
                    model_grads[model_grads.index(table_grad)] = total
                    grads[grads.index(table_grad)] = total
                    table_now = total
                if not micro and deferred is None:
                    total = s.alloc(tied_sum) if waiting and rank.adds_into_view else 0
                    s.free(waiting)
                    s.free(emb_grad)
                    s.free(total)
                if in_bwd and table_now:  # optimizer in backward: the table's one AccumulateGrad, on autograd's sum
                    model_grads.remove(table_now)
                    grads.remove(table_now)
                    accumulated(next(x for x in model_trained if x.name == "embed_tokens.weight"), table_now)
            rank.embedding_backward_begin(s)
            late_tensors = [x for x in model_trained if not rank.early_grad(spec, x)]
            if micro:
                for x in late_tensors:
                    s.free(s.alloc(rank.grad_bytes(x, r.grad_bits)))
            else:
                late = [accumulated(x, s.alloc(rank.grad_bytes(x, r.grad_bits))) for x in late_tensors]
                late = [k for k in late if k]
                grads += late
                kept_grads = rank.backward_end(s, model_grads, late)
                if kept_grads is not None:
                    dropped = set(model_grads + late)
                    grads = [k for k in grads if k not in dropped] + kept_grads
            if leaf_held:
                retained += [stash_first, g_res]
            else:
                s.free(g_res)
            s.free(unpacked_prev)  # OffloadActivations' backward-end callback clears its stash
            if leaf_held and int8_ctx:
                # offloading's last unpacking node, the bottom layer's first, reaches the forward's MatMul8bitLt nodes
                # of the bottom segment but its top layer's down projection: their ctx inputs stay with it
                top = layout.segment_sizes[0] - 1  # the bottom segment's top layer
                held = [k for k in int8_ctx if int8_site[k][0] <= top and int8_site[k] != (top, "int8.mlp_act")]
                retained += held
                int8_ctx[:] = [k for k in int8_ctx if k not in held]
            s.free_all(int8_ctx)  # the graph goes with the backward's end
            int8_ctx.clear()
            int8_site.clear()
            s.free_all(embedding)
            s.free_all(inputs)

        # The optimizer step: a master-* recipe's fp32 gradients first, then the states created in the first step,
        # then the rest of its temporaries.
        # (optimizer in backward: the states were made by the hooks, nothing is left to step)
        masters, master_bytes = ([], 0) if in_bwd else rank.master_grads(s, strategy, trained_ordered)
        if not optimizer_created and not strategy.savers.paged_optimizer and not in_bwd:  # paged: cudaMallocManaged
            rank.optimizer_states(s, strategy, trained_ordered, own_state_bits)
        optimizer_created = True
        step_temp = 0 if in_bwd else max(0, rank.step_temp_bytes(st.step_temp_bytes) - master_bytes)
        step_temps = [s.alloc(per_tensor(step_temp, x)) for x, m in trained for _ in range(m)] if step_temp else []
        s.free_all(step_temps)
        s.free_all(grads)  # zero_grad(set_to_none=True)
        s.free_all(masters)  # the master copies' gradients, after the model's (trace.optim.MasterWeights.zero_grad)
        if stop is not None and stop(step):
            break


#: Results of recent simulations by their inputs (the stream is a pure function of them): the planner, the
#: micro-batch search and a web page re-ask the same setups. Bounded; oldest entries leave first.
_MEMO: Memo[AllocatorResult] = Memo(256)


def simulation_memo() -> Memo[AllocatorResult]:
    """The memo of allocator simulations (also :mod:`trainfit.analytic.rank_events`'s, under its own keys),
    emptied by :func:`forget_simulations`."""
    return _MEMO


def forget_simulations() -> None:
    """Empty the memo of :func:`simulate_training` (tests, benchmarks that time cold runs)."""
    _MEMO.clear()


def memo_stoppable(
    key: tuple[object, ...], stop_above_bytes: int | None, run: Callable[[int | None], AllocatorResult]
) -> AllocatorResult:
    """``run(stop_above_bytes)`` through the simulation memo. A run that may stop early
    (``Simulator(stop_above_bytes=...)``) is answered by the whole run when one is kept; when it did not stop it
    *is* the whole run, and is kept as that."""
    if stop_above_bytes is None:
        return _MEMO.get(key, lambda: run(None))
    whole = _MEMO.peek(key)
    if whole is not None:
        return whole
    result = _MEMO.get((*key, "stop above", stop_above_bytes), lambda: run(stop_above_bytes))
    if not result.stopped:
        _MEMO.put(key, result)
    return result


def stream_strategy(spec: ModelSpec, strategy: Strategy) -> Strategy:
    """``strategy`` less the memory savers its synthesised stream does not read, so that setups with the same stream
    share one simulation (the planner estimates each candidate with and without ``--loss fused-linear``, and the
    analytic estimate takes a saver's reserve above the stream's own peak, ``estimate_analytic``). :func:`synthesise`
    reads: ``paged_optimizer`` (no optimizer states in the stream), a causal LM's chunked loss and its chunk count
    and the fused linear loss (replayed chunk by chunk, ``chunked_loss`` and ``fused_loss`` in :func:`synthesise`;
    the chunk count only under the chunked loss), ``optimizer_in_backward`` (each gradient stepped and freed by its
    hook), ``activation_offload`` without checkpointing (the layers' saves off the device between their forward and
    backward) and under whole-layer checkpointing (the segments' inputs off the device), and for a token table tied
    to another head the loss too (:func:`~trainfit.analytic.states.tied_gradient_sum`); offloading under selective
    recompute not at all."""
    sv = strategy.savers
    if not sv.any:
        return strategy
    tied = spec.tie_word_embeddings and spec.kind.has_vocab_logits
    replayed = sv.loss is not LossImpl.STANDARD and spec.kind is ModelKind.CAUSAL_LM
    chunks = sv.loss_chunks if sv.loss is LossImpl.CHUNKED else MemorySavers().loss_chunks
    offload = sv.activation_offload and strategy.checkpointing is not Checkpointing.SELECTIVE
    read = MemorySavers(
        paged_optimizer=sv.paged_optimizer, optimizer_in_backward=sv.optimizer_in_backward, activation_offload=offload
    )
    kept = replace(read, loss=sv.loss, loss_chunks=chunks) if tied or replayed else read
    return strategy if kept == sv else replace(strategy, savers=kept)


def simulate_training(
    spec: ModelSpec,
    strategy: Strategy,
    config: AllocatorConfig | None = None,
    workspaces: tuple[Workspace, ...] = (),
    *,
    layout: bool = False,
    capacity_bytes: int | None = None,
    stop_above_bytes: int | None = None,
) -> AllocatorResult:
    """The caching allocator's peaks over the synthesised stream of a training step (``layout``: with the
    segments at the reserved peak; ``capacity_bytes``: under that device capacity, flushing its cache and
    retrying where a segment does not fit, :class:`~trainfit.allocator.Simulator`; ``stop_above_bytes``: stop
    once reserved passes it, ``AllocatorResult.stopped``). Memoised on the inputs (``ModelSpec`` holds a dict,
    so it is keyed by its ``repr``, which shows every field)."""
    strategy = stream_strategy(spec, strategy)
    key = (spec_key(spec), strategy, config, workspaces, layout)
    if layout or capacity_bytes is not None:
        stop_above_bytes = None
    return memo_stoppable(
        key if capacity_bytes is None else (*key, capacity_bytes),
        stop_above_bytes,
        lambda stop: _simulate_training(
            spec, strategy, config, workspaces, layout=layout, capacity_bytes=capacity_bytes, stop_above_bytes=stop
        ),
    )


def steady_state(sim: Simulator, capacity_bytes: int | None) -> Callable[[int], bool]:
    """A stream's ``stop``: True after a step (≥ 1: the optimizer's states exist) that left ``sim`` in the state the
    step before it did (:meth:`~trainfit.allocator.Simulator.state_key`). The steps after the first repeat the same
    calls, so the next would repeat this one exactly and add nothing. Never under a capacity (each repeated cache flush
    counts in ``num_alloc_retries``) nor where the simulator has no key."""
    before: list[tuple[object, ...] | None] = [None]

    def ended(step: int) -> bool:
        if capacity_bytes is not None:
            return False
        now = sim.state_key()
        same = step >= 1 and sim.repeats_after(before[0], now)
        before[0] = now
        return same

    return ended


def _simulate_training(
    spec: ModelSpec,
    strategy: Strategy,
    config: AllocatorConfig | None,
    workspaces: tuple[Workspace, ...],
    *,
    layout: bool,
    capacity_bytes: int | None = None,
    stop_above_bytes: int | None = None,
) -> AllocatorResult:
    if layout:  # replayed twice (the second time up to the peak): needs the events
        return simulate(training_events(spec, strategy, workspaces), config, layout=True, capacity_bytes=capacity_bytes)
    sim = Simulator(config, capacity_bytes=capacity_bytes, stop_above_bytes=stop_above_bytes)
    stop = steady_state(sim, capacity_bytes)
    return sim.result(oom=sim.drive(lambda x: synthesise(Stream(x), spec, strategy, workspaces, stop=stop)))

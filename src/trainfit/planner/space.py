"""The planner's search space: which layouts, recipes and fine-tuning methods are worth estimating.

A :class:`Candidate` is everything about a run except the micro-batch (which :mod:`trainfit.planner.rank`
bisects, since memory grows with it). What the space contains, and why:

- **Precision**: recipes the GPU runs natively (``bf16`` only with native bf16 — compute capability ≥ 8.0,
  DESIGN §4; fp16 with loss scaling otherwise; fp32 when neither has a tensor-core peak in the catalog).
  With ``--allow fp8`` on a GPU with fp8 tensor cores (compute capability ≥ 8.9), every full-training bf16
  candidate on one GPU or torch DDP/FSDP2/HSDP (no offload, TP or PP) also comes with torchao fp8 linears
  (``--fp8 tensorwise``: :func:`float8_candidates`); the estimate refuses the models it does not model (MoE,
  MLA, …), which drops those.
- **Optimizer**: AdamW (fused, the HF Trainer default) and bitsandbytes 8-bit AdamW (adapters: AdamW only —
  their states are a few hundred MB, and the speed model cannot tell the two apart).
- **Checkpointing**: none, selective (Megatron: the attention core recomputed), sac (torchtitan's per-op
  selective AC), sqrt, full (:func:`trainfit.strategy.checkpoint_layout`); the estimate refuses sac where it is
  not modelled (MoE, MLA, eager attention, adapters, tensor/pipeline parallelism, Megatron-LM, fp8) and such
  candidates drop out.
- **Layouts**: one GPU; DDP, ZeRO-2/3 (DeepSpeed), FSDP2, HSDP (more than one node); ZeRO-2/3 and FSDP2 with
  CPU offload; Megatron-LM with its distributed optimizer (ZeRO-1) at tensor parallelism (with sequence
  parallelism) of degree 1, 2, 4, 8 that divides the heads, k/v heads and MLP width and stays within a node, and
  pipeline degree 1, 2, 4, 8 up to the depth — 1 × 1 being its pure data parallelism (``--sharding zero1 --engine
  megatron``: the fp32 main-gradient buffer in the memory model, fused kernels in the speed model, which make it a
  different plan from DeepSpeed's ZeRO-1/2 rather than one they dominate), in one recipe per compute dtype
  (:data:`_MEGATRON_RECIPES`); 2-D FSDP2 × DTensor tensor parallelism (``--engine torch --tp N
  --sharding fsdp`` with sequence parallelism, torchtitan's ``parallelize_llama``) of the same degrees where the
  estimate's DTensor check accepts the model (:func:`_fsdp_tp_degrees`: dense, untied, Llama-style blocks), data
  degree world / t. Per-op SAC is not generated with TP, PP or Megatron (the estimate refuses it). Left out because
  another layout dominates them — the same
  communication volume (the speed model cannot tell them apart) and no more memory: ZeRO-1 without tensor or
  pipeline parallelism under DeepSpeed (ZeRO-2 reduce-scatters what ZeRO-1 all-reduces; Rajbhandari et al. 2020
  §5) and Megatron without the distributed optimizer.
  Whether a framework supports a combination is the estimate's call: it raises ``StrategyError`` for what
  no framework runs, and such candidates are dropped.
- **FSDP2's ``reshard_after_forward``** (:data:`RESHARD_AFTER_FORWARD`): every FSDP2/HSDP candidate — offloaded,
  2-D, fp8 and adapter ones too — with torch's default (True) and without (``--no-reshard-after-forward``: each layer
  stays unsharded from its forward to its post-backward; one all-gather per layer and micro-step instead of two,
  more memory). The search treats it as a variant within a layout, like the recipe (:mod:`trainfit.planner.rank`).
  Not pruned to the candidates whose resharding twin fits, although False never needed less *allocated* memory in
  the model (checked on 904 random FSDP2/HSDP setups, two samples over six models, micro-batches 1 and 2): its
  *requirement* — the allocator simulation's reserve plus what sits outside it, which the plan compares — was
  lower in 9 of them, by up to 116 MiB (all GPT-2 on 2 T4s, checkpointed, micro-batch 1: the layers True gathers
  again in backward fragment the cache), so such a pruning would not be exact. The best-first order keeps the cost
  small: a kept candidate is estimated only when its bound comes up, is skipped where its layout already has a plan
  as fast, and is ruled out by its twin's closed-form lower bound, never above its own (``rank._Search.evaluate``;
  docs/plan.md).
- **World sizes** (:func:`world_sizes`): every world up to the GPUs given that some layout can fill while hitting
  the global batch — data degree d dividing the global batch, times the tensor and pipeline degrees the space
  considers (using fewer GPUs is a plan too). The condition does not depend on the GPUs given, so the sets are
  nested: more GPUs never make the best plan slower or infeasible.
- **Memory savers** (one GPU, :func:`saver_candidates`): Liger's fused linear cross-entropy alone; torchtune's
  chunked loss, activation offloading (full checkpointing only) and optimizer-in-backward (accumulation 1), alone
  and combined, on the recipes torchtune runs. A saver's plan is kept only where no candidate with fewer of its
  savers fits at the same micro-batch (:mod:`trainfit.planner.rank`).
- **Fine-tuning**: full, and LoRA / QLoRA (PEFT defaults, rank 16 on all linears, or the command's own adapter
  when it fine-tunes: :attr:`Candidate.adapter`) when ``--allow`` has them, on
  one GPU or data parallel (DDP, FSDP2/HSDP, ZeRO; what the estimate refuses — QLoRA with ZeRO — drops out),
  not with tensor/pipeline parallelism or offload. Their exports are the Trainer's (with PEFT), not the
  torchrun FSDP2 script.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from itertools import product

from trainfit.arch.spec import ModelSpec
from trainfit.errors import StrategyError
from trainfit.fsdp_units import gathered_once_fraction
from trainfit.hardware import GPUSpec
from trainfit.planner.speed import SpeedInputs, engine_widths, offloaded_activation_bytes
from trainfit.strategy import (
    FLOAT8_RECIPES,
    Adapter,
    BaseWeights,
    Checkpointing,
    Engine,
    EngineOptions,
    Float8,
    FsdpWrap,
    LossImpl,
    MemorySavers,
    Offload,
    Optimizer,
    Parallelism,
    PipelineSchedule,
    Precision,
    Sharding,
    Strategy,
    finetune_setup,
)
from trainfit.strategy.recipe import RECIPES

__all__ = [
    "CHECKPOINTING",
    "PP_DEGREES",
    "RESHARD_AFTER_FORWARD",
    "TP_DEGREES",
    "Candidate",
    "Finetune",
    "Objective",
    "allows_float8",
    "baseline_allows",
    "baseline_method",
    "candidates",
    "check_allow_float8",
    "float8_candidates",
    "gpu_has_float8",
    "native_precisions",
    "parse_allow",
    "saver_candidates",
    "world_sizes",
]


class Objective(StrEnum):
    FASTEST = "fastest"  # least time per optimizer step (the global batch is fixed)
    FEWEST_GPUS = "fewest-gpus"  # the smallest world that fits, fastest among those
    CHEAPEST = "cheapest"  # GPU-hours per step × price per GPU-hour


class Finetune(StrEnum):
    FULL = "full"
    LORA = "lora"
    QLORA = "qlora"


_ALLOWABLE = ("lora", "qlora", "fp8")


def parse_allow(text: str | None) -> tuple[Finetune, ...]:
    """``--allow lora,qlora``: the fine-tuning methods the search may use beyond full fine-tuning."""
    out: list[Finetune] = []
    for item in (x.strip() for x in (text or "").split(",") if x.strip()):
        if item not in _ALLOWABLE:
            raise StrategyError(f"unknown --allow '{item}'; choose from: {', '.join(_ALLOWABLE)}")
        if item == "fp8":
            continue  # not a fine-tuning method: allows_float8
        out.append(Finetune(item))
    return tuple(out)


def allows_float8(text: str | None) -> bool:
    """``--allow ...,fp8``: the search may swap the block linears for torchao fp8 ones."""
    return "fp8" in {x.strip() for x in (text or "").split(",")}


def baseline_method(baseline: Strategy) -> Finetune:
    """The search's fine-tuning method a run uses: QLoRA (an adapter on a k-bit-prepared base, ``--finetune
    qlora``), LoRA (any other adapter: ``--finetune lora``, whatever its ``--base-dtype``), else full (``--finetune
    freeze`` too: the search has no frozen-layer method, its full plans train every weight)."""
    if baseline.adapter is None:
        return Finetune.FULL
    return Finetune.QLORA if baseline.base_weights.kbit_prepared else Finetune.LORA


def baseline_allows(baseline: Strategy) -> tuple[tuple[Finetune, ...], bool]:
    """What a baseline run opens the search to, as ``--allow`` would: (LoRA and QLoRA when it already fine-tunes
    with an adapter, fp8 linears when it trains them). The issue searches adapters and fp8 only when the user permits
    them (``--allow``), since they change what is trained or its numerics; a user whose run already has them has
    permitted them. The rule ``trainfit estimate --fixes`` applies to its own command, for ``trainfit plan``'s
    baseline too. Nothing is taken away: full fine-tuning and the bf16/fp16 recipes stay in the space."""
    adapters = (Finetune.LORA, Finetune.QLORA) if baseline.adapter is not None else ()
    return adapters, baseline.float8 is not Float8.NONE


def gpu_has_float8(gpu: GPUSpec) -> bool:
    """fp8 tensor cores: compute capability >= 8.9 (``precision.advice.fp8_from_cc``), else the catalog's flag."""
    from trainfit.precision.advice import fp8_from_cc

    return fp8_from_cc(gpu.compute_capability) if gpu.compute_capability else gpu.fp8


def check_allow_float8(gpu: GPUSpec, allow: str | None) -> None:
    """``--allow fp8`` on a GPU without fp8 tensor cores is a one-line error, not a silently empty addition."""
    if allows_float8(allow) and not gpu_has_float8(gpu):
        raise StrategyError(
            f"--allow fp8: {gpu.id} has no fp8 tensor cores (compute capability "
            f"{gpu.compute_capability or 'unknown'}; fp8 needs 8.9 or newer)"
        )


def float8_candidates(gpu: GPUSpec, base: list[Candidate]) -> list[Candidate]:
    """The fp8 variants of ``base``: where ``gpu`` has fp8 tensor cores, one GPU or torch DDP / FSDP2 / HSDP
    without offload, tensor or pipeline parallelism, full training, a bf16 recipe, not per-op SAC — what
    ``Strategy`` models with ``--fp8`` (torchtitan's 1-D runs)."""
    if not gpu_has_float8(gpu):
        return []
    layouts = (Sharding.NONE, Sharding.DDP, Sharding.FSDP, Sharding.HSDP)
    return [
        replace(c, float8=Float8.TENSORWISE)
        for c in base
        if c.sharding in layouts
        and c.engine in (Engine.AUTO, Engine.TORCH)
        and c.tensor == c.pipeline == 1
        and c.offload == "none"
        and c.finetune is Finetune.FULL
        and c.precision.value in FLOAT8_RECIPES
        and c.checkpointing is not Checkpointing.SAC  # the estimate refuses --fp8 with sac
        and c.savers.loss is not LossImpl.CHUNKED  # torchtune's savers: their export is torchtune's recipe
        and not (c.activation_offload or c.optimizer_in_backward)
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """A run without its micro-batch: world, layout, recipe, fine-tuning method."""

    world: int
    tensor: int = 1
    pipeline: int = 1
    sharding: Sharding = Sharding.NONE
    offload: str = "none"
    engine: Engine = Engine.AUTO
    precision: Precision = Precision.AMP_BF16
    optimizer: Optimizer = Optimizer.ADAMW
    checkpointing: Checkpointing = Checkpointing.NONE
    finetune: Finetune = Finetune.FULL
    float8: Float8 = Float8.NONE
    loss: LossImpl = LossImpl.STANDARD  # --loss fused-linear | chunked (:func:`saver_candidates`)
    activation_offload: bool = False  # --activation-offload (torchtune)
    optimizer_in_backward: bool = False  # --optimizer-in-backward (torchtune; accumulation 1 only)
    #: FSDP2/HSDP only: False is ``--no-reshard-after-forward`` (:data:`RESHARD_AFTER_FORWARD`).
    reshard_after_forward: bool = True
    #: The adapter a LoRA/QLoRA candidate trains (None: PEFT's defaults, :data:`_FINETUNE`): the baseline's, when the
    #: command already fine-tunes — its rank, targets and DoRA are not the search's to choose.
    adapter: Adapter | None = None
    #: The frozen base a LoRA/QLoRA candidate runs on (None: the method's default, :data:`_FINETUNE`): the baseline's
    #: for the candidates of the baseline's own method (its ``--base-dtype``, ``--no-double-quant``).
    base_weights: BaseWeights | None = None

    def __post_init__(self) -> None:
        if not self.reshard_after_forward and self.sharding not in (Sharding.FSDP, Sharding.HSDP):
            raise StrategyError(f"reshard_after_forward=False is an FSDP2 setting, not {self.sharding.value}'s")

    @property
    def data(self) -> int:
        return self.world // (self.tensor * self.pipeline)

    @property
    def savers(self) -> MemorySavers:
        return MemorySavers(
            loss=self.loss,
            activation_offload=self.activation_offload,
            optimizer_in_backward=self.optimizer_in_backward,
        )

    def twin(self) -> Candidate:
        """The same candidate without memory savers (what a saver must beat: :func:`saver_candidates`)."""
        return replace(self, loss=LossImpl.STANDARD, activation_offload=False, optimizer_in_backward=False)

    def fewer_savers(self) -> tuple[Candidate, ...]:
        """The same candidate with each proper subset of its savers, the :meth:`twin` first (what a combination
        must beat: :func:`saver_candidates`); () without savers."""
        drops = [
            drop
            for drop, on in (
                ({"loss": LossImpl.STANDARD}, self.loss is not LossImpl.STANDARD),
                ({"activation_offload": False}, self.activation_offload),
                ({"optimizer_in_backward": False}, self.optimizer_in_backward),
            )
            if on
        ]
        out = []
        for keep in product((False, True), repeat=len(drops)):  # (False, …): all dropped, the twin, first
            if not all(keep):
                fields = {k: v for drop, kept in zip(drops, keep, strict=True) if not kept for k, v in drop.items()}
                out.append(replace(self, **fields))  # type: ignore[arg-type]
        return tuple(out)

    def speed_inputs(
        self, *, micro_batch: int, grad_accum: int, seq_len: int, gpus_per_node: int, spec: ModelSpec | None = None
    ) -> SpeedInputs:
        """What :func:`trainfit.planner.speed.step_time_of` reads — equal to ``SpeedInputs.of(self.strategy(...),
        spec)`` (a test holds them together) without building and validating a Strategy, except under activation
        offload, whose bytes are the memory model's (``spec`` is needed then, and for 2-D FSDP2 × TP)."""
        r = RECIPES[self.precision]
        adapter, base = self._finetune()
        dtensor = self.tensor > 1 and self.engine is Engine.TORCH
        megatron = self.engine is Engine.MEGATRON  # speed.fused_elementwise_engine
        widths = engine_widths(r, megatron=megatron, sharding=self.sharding)
        if spec is None and (dtensor or self.activation_offload):
            raise ValueError("Candidate.speed_inputs needs the model for activation offload or DTensor TP")
        offloaded = 0
        if self.activation_offload and spec is not None:
            kw = {"micro_batch": micro_batch, "grad_accum": grad_accum, "seq_len": seq_len}
            offloaded = offloaded_activation_bytes(spec, self.strategy(**kw, gpus_per_node=gpus_per_node))
        return SpeedInputs(
            data=self.data,
            tensor=self.tensor,
            pipeline=self.pipeline,
            gpus_per_node=gpus_per_node,
            seq_len=seq_len,
            micro_batch=micro_batch,
            grad_accum=grad_accum,
            adapter=adapter,
            base_quantization=base.quantization,
            double_quant=base.double_quant,
            compute_dtype=r.compute_dtype,
            compute_bits=r.compute_bits,
            grad_bits=widths.grad_bits,
            weight_bits=widths.weight_bits,
            checkpointing=self.checkpointing,
            sharding=self.sharding,
            offload_optimizer=self.offload != "none",
            offload_parameters=self.offload == "optimizer+params",
            float8=self.float8 is not Float8.NONE,
            dtensor_tp=dtensor,
            mixed=widths.mixed,
            vocab_size=spec.vocab_size if dtensor and spec is not None else 0,
            offload_activation_bytes=offloaded,
            fsdp_gathered_once=gathered_once_fraction(
                spec, FsdpWrap.AUTO, self.tensor, reshard_after_forward=self.reshard_after_forward
            )
            if spec is not None and self.sharding in (Sharding.FSDP, Sharding.HSDP)
            else 0.0,
            autocast=widths.autocast,
            loss=self.loss,
            fused_elementwise=megatron,
        )

    def _finetune(self) -> tuple[Adapter | None, BaseWeights]:
        """The adapter and base weights of the fine-tuning method (PEFT defaults, or :attr:`adapter`; the Strategy's
        own default base under full fine-tuning)."""
        adapter, base = _FINETUNE[self.finetune]
        if adapter is not None and self.base_weights is not None:
            base = self.base_weights
        return (self.adapter if adapter is not None and self.adapter is not None else adapter), base

    def strategy(self, *, micro_batch: int, grad_accum: int, seq_len: int, gpus_per_node: int) -> Strategy:
        """The Strategy this candidate runs at ``micro_batch`` × ``grad_accum`` (the pipeline's micro-batches
        per step are the accumulation steps)."""
        adapter, base = self._finetune()
        fields: dict[str, object] = {}
        if self.finetune is not Finetune.FULL:
            fields["base_weights"] = base
        return Strategy(
            precision=self.precision,
            optimizer=self.optimizer,
            checkpointing=self.checkpointing,
            micro_batch=micro_batch,
            grad_accum=1 if self.pipeline > 1 else grad_accum,  # a pipeline's accumulation is its micro-batches
            seq_len=seq_len,
            parallelism=Parallelism.for_gpus(
                self.world,
                tensor=self.tensor,
                pipeline=self.pipeline,
                sequence_parallel=self.tensor > 1,
                gpus_per_node=gpus_per_node,
                microbatches=grad_accum if self.pipeline > 1 else 1,
                pipeline_schedule=PipelineSchedule.ONE_F_ONE_B,
            ),
            sharding=self.sharding,
            offload=Offload.parse(self.offload),
            engine=EngineOptions(engine=self.engine, reshard_after_forward=self.reshard_after_forward),
            adapter=adapter,
            float8=self.float8,
            savers=self.savers,
            **fields,  # type: ignore[arg-type]
        )


_FINETUNE: dict[Finetune, tuple[Adapter | None, BaseWeights]] = {
    Finetune.FULL: (None, BaseWeights()),
    Finetune.LORA: finetune_setup("lora"),
    Finetune.QLORA: finetune_setup("qlora"),
}


#: Checkpointing modes searched. ``sac`` is modelled (memory and speed) for dense layers with SDPA's fused
#: attention, full fine-tuning and no tensor/pipeline parallelism; elsewhere the estimate refuses it
#: (``trainfit.analytic.activations.check_sac``, ``trainfit.analytic.parallel.plan``) and the search drops it.
CHECKPOINTING = (
    Checkpointing.NONE,
    Checkpointing.SELECTIVE,
    Checkpointing.SAC,
    Checkpointing.SQRT,
    Checkpointing.FULL,
)


#: FSDP2's ``reshard_after_forward`` settings searched for FSDP2/HSDP candidates (``--reshard-after-forward`` /
#: ``--no-reshard-after-forward``; torch/distributed/fsdp/_fully_shard/_fully_shard.py ``fully_shard``). True (torch's
#: default) frees each layer's unsharded parameters after its forward
#: and all-gathers them again for its backward; False keeps them to the layer's post-backward: one all-gather per
#: layer and micro-step instead of two (the speed model, ``fsdp_units.gathered_once_fraction``) for up to the whole
#: model unsharded (the memory model, ``analytic.parallel._fsdp``).
RESHARD_AFTER_FORWARD = (True, False)


def _optimizers(ft: Finetune, offload: str, engine: Engine) -> tuple[Optimizer, ...]:
    """AdamW and 8-bit AdamW; adapters only AdamW: the optimizer holds the adapters' states alone (rank 16 on all
    linears: 42M of Mistral 7B's 7.2B parameters), so 8-bit states save 0.25 GB there and the speed model cannot
    tell the two apart — a second candidate per layout that can only tie. With the optimizer offloaded, AdamW only
    too: its states are host memory, so the device's stream is the same for both (and the speed model the same);
    DeepSpeed refuses a client optimizer under ZeRO-Offload besides (deepspeed/runtime/engine.py
    ``_configure_optimizer``: ``ZeRORuntimeException`` unless ``zero_force_ds_cpu_optimizer`` is false, its
    default true, runtime/constants.py). Megatron: its own Adam (``--optimizer adam``; the estimate models no other
    there, :func:`trainfit.analytic.parallel.megatron_inputs`)."""
    if ft is not Finetune.FULL or offload != "none" or engine is Engine.MEGATRON:
        return (Optimizer.ADAMW,)
    return (Optimizer.ADAMW, Optimizer.ADAMW_8BIT)


def native_precisions(gpu: GPUSpec) -> tuple[Precision, ...]:
    """Recipes ``gpu`` runs natively: bf16 ones where bf16 is native, else fp16 with loss scaling, else fp32."""
    if gpu.bf16 and gpu.peak_tflops.get("bf16"):
        return (Precision.AMP_BF16, Precision.MASTER_BF16, Precision.PURE_BF16)
    if gpu.peak_tflops.get("fp16"):
        return (Precision.AMP_FP16, Precision.MASTER_FP16)
    return (Precision.FP32,)


#: The one recipe per compute dtype that says what Megatron-LM runs: ``--bf16`` / ``--fp16`` cast the model to 16-bit
#: parameters (``args.params_dtype``), keep fp32 main gradients and an fp32 copy of the parameters in its optimizer
#: (megatron/training/arguments.py ``validate_args``; ``Float16OptimizerWithFloat16Params``) — trainfit's master-*;
#: neither flag is fp32. The memory model counts the same bytes for every 16-bit recipe there
#: (:func:`trainfit.analytic.parallel.megatron_inputs`: ``param_bytes`` 2, an fp32 gradient buffer and master) and
#: the export writes the same ``--bf16`` for each, so amp-*/pure-* candidates would only repeat master-*.
_MEGATRON_RECIPES = {
    Precision.AMP_BF16: Precision.MASTER_BF16,
    Precision.PURE_BF16: Precision.MASTER_BF16,
    Precision.AMP_FP16: Precision.MASTER_FP16,
}


def _precisions(gpu: GPUSpec, engine: Engine) -> tuple[Precision, ...]:
    """:func:`native_precisions`, for Megatron-LM one per compute dtype (:data:`_MEGATRON_RECIPES`)."""
    native = native_precisions(gpu)
    if engine is not Engine.MEGATRON:
        return native
    return tuple(dict.fromkeys(_MEGATRON_RECIPES.get(p, p) for p in native))


#: Tensor and pipeline degrees the space considers (:func:`_tp_degrees`, :func:`_layouts`): 1, 2, 4, 8 — tensor degrees
#: within a node and dividing the heads, k/v heads and MLP width; pipeline degrees up to the depth.
TP_DEGREES = (1, 2, 4, 8)
PP_DEGREES = (1, 2, 4, 8)


def _model_tp_degrees(spec: ModelSpec, gpus_per_node: int) -> list[int]:
    """The tensor degrees of :data:`TP_DEGREES` that fit a node and divide the heads, k/v heads and MLP width (dense
    models only), whatever the world."""
    return [
        t
        for t in TP_DEGREES
        if t == 1
        or (
            t <= gpus_per_node
            and spec.num_heads % t == 0
            and spec.num_kv_heads % t == 0
            and spec.intermediate_size % t == 0
            and spec.moe is None
        )
    ]


def _pp_degrees(spec: ModelSpec) -> list[int]:
    """The pipeline degrees of :data:`PP_DEGREES` up to the depth."""
    return [p for p in PP_DEGREES if p <= spec.num_layers]


def world_sizes(gpus: int, gpus_per_node: int, *, global_batch: int, spec: ModelSpec) -> tuple[int, ...]:
    """Every world d·t·p ≤ ``gpus`` (ascending) where the data degree d divides ``global_batch`` (micro × accumulation
    × d must be the global batch) and t, p are tensor and pipeline degrees the space considers for ``spec``
    (:func:`_model_tp_degrees`, :func:`_pp_degrees`) — exactly the worlds :func:`_layouts` can fill with a candidate
    that hits the global batch. The condition does not depend on ``gpus``, so the set for N + 1 GPUs contains the set
    for N, and so does the space (a world's layouts do not depend on ``gpus`` either): more GPUs never make the
    best plan slower or infeasible (the search is exact: ``planner.rank``). Before, the powers of two, the whole
    nodes and ``gpus`` itself were offered: 7 GPUs did not offer 6 (Llama 3.2 1B, global batch 12: 0.30 s/step on 7
    GPUs, 0.20 on 6). No blow-up: with ``gpus`` a power of two and a global batch of one, this is the powers of two;
    a world no data degree fits (24 GPUs for a global batch of 512) is no longer offered."""
    tp = set(_model_tp_degrees(spec, gpus_per_node))
    model = sorted({t * p for t in tp for p in _pp_degrees(spec)})
    out = {1}
    for d in range(1, min(gpus, global_batch) + 1):
        if global_batch % d == 0:
            out.update(d * m for m in model if d * m <= gpus)
    return tuple(sorted(out))


def _tp_degrees(spec: ModelSpec, world: int, gpus_per_node: int) -> list[int]:
    """:func:`_model_tp_degrees` that fit ``world`` (at most it, dividing it)."""
    return [t for t in _model_tp_degrees(spec, gpus_per_node) if t <= world and world % t == 0]


def _fsdp_tp_degrees(spec: ModelSpec, world: int, gpus_per_node: int) -> list[int]:
    """Tensor degrees of 2-D FSDP2 × DTensor TP on ``world`` GPUs: the Megatron degrees (within a node, dividing
    the heads, k/v heads and MLP width) that the estimate's own check of the DTensor plan accepts
    (:func:`trainfit.analytic.parallel.plan`: a dense untied Llama-style causal LM), data degree world / t."""
    from trainfit.analytic.parallel import plan

    out = []
    for t in _tp_degrees(spec, world, gpus_per_node)[1:]:
        probe = Strategy(
            parallelism=Parallelism.for_gpus(world, tensor=t, sequence_parallel=True, gpus_per_node=gpus_per_node),
            sharding=Sharding.FSDP,
            engine=EngineOptions(engine=Engine.TORCH),
        )
        try:
            plan(spec, probe)
        except StrategyError:
            continue
        out.append(t)
    return out


def _layouts(spec: ModelSpec, world: int, gpus_per_node: int) -> list[tuple[int, int, Sharding, str, Engine]]:
    if world == 1:
        return [
            (1, 1, Sharding.NONE, "none", Engine.AUTO),
            (1, 1, Sharding.ZERO2, "optimizer", Engine.DEEPSPEED),
            (1, 1, Sharding.ZERO3, "optimizer+params", Engine.DEEPSPEED),
        ]
    out: list[tuple[int, int, Sharding, str, Engine]] = [
        (1, 1, Sharding.DDP, "none", Engine.AUTO),
        (1, 1, Sharding.ZERO2, "none", Engine.AUTO),
        (1, 1, Sharding.ZERO3, "none", Engine.AUTO),
        (1, 1, Sharding.FSDP, "none", Engine.AUTO),
        (1, 1, Sharding.ZERO2, "optimizer", Engine.AUTO),
        (1, 1, Sharding.ZERO3, "optimizer+params", Engine.AUTO),
        (1, 1, Sharding.FSDP, "optimizer+params", Engine.AUTO),
    ]
    if world > gpus_per_node and world % gpus_per_node == 0:
        out.append((1, 1, Sharding.HSDP, "none", Engine.AUTO))
    out += [(t, 1, Sharding.FSDP, "none", Engine.TORCH) for t in _fsdp_tp_degrees(spec, world, gpus_per_node)]
    for t in _tp_degrees(spec, world, gpus_per_node):
        for p in _pp_degrees(spec):
            if world % (t * p):
                continue
            # (1, 1): pure data parallelism with Megatron's distributed optimizer (module docstring)
            out.append((t, p, Sharding.ZERO1, "none", Engine.MEGATRON))
    return out


def candidates(
    spec: ModelSpec,
    gpu: GPUSpec,
    *,
    gpus: int,
    gpus_per_node: int,
    global_batch: int,
    allow: tuple[Finetune, ...] = (),
    fp8: bool = False,
    adapter: Adapter | None = None,
    adapter_base: BaseWeights | None = None,
) -> list[Candidate]:
    """Every candidate whose data degree divides the global batch (so micro × accumulation × data hits it);
    with ``fp8``, their :func:`float8_candidates` too. ``adapter``: what the LoRA/QLoRA candidates train (None:
    PEFT's defaults); ``adapter_base``: the baseline's frozen base, for the candidates of its method (QLoRA when
    it is k-bit prepared, else LoRA; None: each method's default)."""
    base_method = None if adapter_base is None else Finetune.QLORA if adapter_base.kbit_prepared else Finetune.LORA
    out: list[Candidate] = []
    methods = (Finetune.FULL, *allow)
    for world in world_sizes(gpus, gpus_per_node, global_batch=global_batch, spec=spec):
        for t, p, sh, off, engine in _layouts(spec, world, gpus_per_node):
            if global_batch % (world // (t * p)):
                continue
            for ft in methods:
                if ft is not Finetune.FULL and (t > 1 or p > 1 or off != "none"):
                    continue  # adapters: data parallel only (Megatron with adapters is refused; so is offload here)
                for prec in _precisions(gpu, engine):
                    for opt in _optimizers(ft, off, engine):
                        for ck in CHECKPOINTING:
                            if ck is Checkpointing.SAC and (t > 1 or p > 1 or engine is Engine.MEGATRON):
                                continue  # the estimate refuses sac with TP/PP or Megatron (analytic.parallel.plan)
                            out += [
                                Candidate(
                                    world=world,
                                    tensor=t,
                                    pipeline=p,
                                    sharding=sh,
                                    offload=off,
                                    engine=engine,
                                    precision=prec,
                                    optimizer=opt,
                                    checkpointing=ck,
                                    finetune=ft,
                                    reshard_after_forward=raf,
                                    adapter=adapter if ft is not Finetune.FULL else None,
                                    base_weights=adapter_base if ft is base_method else None,
                                )
                                # FSDP2/HSDP both ways, unpruned (module docstring); the rest do not read it
                                for raf in (RESHARD_AFTER_FORWARD if sh in (Sharding.FSDP, Sharding.HSDP) else (True,))
                            ]
    out += saver_candidates(out)
    return out + (float8_candidates(gpu, out) if fp8 else [])


#: The recipes and checkpointing modes torchtune's ``full_finetune_single_device`` runs: ``dtype: bf16`` (weights,
#: gradients and AdamW states in bf16: trainfit's pure-bf16) or fp32, no autocast; ``enable_activation_checkpointing``
#: checkpoints every layer (full) or none.
TORCHTUNE_PRECISIONS = (Precision.PURE_BF16, Precision.FP32)
TORCHTUNE_CHECKPOINTING = (Checkpointing.NONE, Checkpointing.FULL)


def saver_candidates(base: list[Candidate]) -> list[Candidate]:
    """The memory savers' variants of ``base``, on one GPU without DeepSpeed — where the estimate models the savers
    (many-GPU setups refuse them):

    - Liger's fused linear cross-entropy (``--loss fused-linear``: no full logits; exported as
      ``TrainingArguments(use_liger_kernel=True)``), alone. Same FLOPs as the standard loss (Liger computes the
      head's gradients chunk by chunk inside its forward: the same three matmuls).
    - torchtune's savers, under full fine-tuning on the recipes and checkpointing modes its single-device recipe runs
      (:data:`TORCHTUNE_PRECISIONS`, :data:`TORCHTUNE_CHECKPOINTING`; exported as torchtune recipe overrides —
      the HF Trainer has no switch for any of them), each alone and every combination of them (the recipe's
      switches are independent): the chunked cross-entropy (``--loss chunked``, ``CEWithChunkedOutputLoss``: the
      same FLOPs), activation offloading (``--activation-offload``, ``enable_activation_offloading``: priced by its
      PCIe traffic not hidden behind compute; only with full checkpointing — the recipe's ``__init__`` raises
      without ``enable_activation_checkpointing``) and optimizer-in-backward (``--optimizer-in-backward``,
      ``optimizer_in_bwd``: the same optimizer work; only with accumulation 1, which torchtune requires —
      :meth:`trainfit.planner.rank._Search.micro_options`). At most 7 variants per base candidate (4 of them
      combinations), on the few one-GPU bases torchtune runs.

    A saver never makes a step faster at the same micro-batch, so neither does adding one to others: the search
    keeps a saver's plan only where no candidate with fewer of its savers (:meth:`Candidate.fewer_savers`: the
    twin, and for a combination each subset) fits at that micro-batch (``search_plans``)."""
    singles: list[Candidate] = []
    combos: list[Candidate] = []
    for c in base:
        if c.world != 1 or c.sharding is not Sharding.NONE or c.twin() != c:
            continue
        singles.append(replace(c, loss=LossImpl.FUSED_LINEAR))
        if not (
            c.finetune is Finetune.FULL
            and c.precision in TORCHTUNE_PRECISIONS
            and c.checkpointing in TORCHTUNE_CHECKPOINTING
        ):
            continue
        offload = (False, True) if c.checkpointing is Checkpointing.FULL else (False,)
        for chunked, off, in_bwd in product((False, True), offload, (False, True)):
            n = chunked + off + in_bwd
            if n:
                v = replace(
                    c,
                    loss=LossImpl.CHUNKED if chunked else LossImpl.STANDARD,
                    activation_offload=off,
                    optimizer_in_backward=in_bwd,
                )
                (singles if n == 1 else combos).append(v)
    return singles + combos

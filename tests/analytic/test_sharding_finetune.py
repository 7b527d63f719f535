"""Many GPUs with adapters (trainfit.analytic.parallel under --finetune lora|qlora|freeze), held to closed forms
written from the frameworks' rules rather than to the code's own output — ZeRO keeps 16-bit copies of every
parameter but partitions gradients, fp32 masters and Adam only for the trainable ones (stage_1_and_2.py,
stage3.py ``is_optimized_parameter``); FSDP2 shards every parameter but gives only trainable ones gradients and
optimizer states; DDP's reducer holds only trainable gradients — and to invariants: more ranks never add
per-rank memory, an adapter never adds gradient or optimizer memory over full fine-tuning at the same layout."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfit import estimate
from trainfit.arch import load_model
from trainfit.arch.params import inventory
from trainfit.errors import StrategyError
from trainfit.result import Component, Phase
from trainfit.strategy import EngineOptions, Offload, Parallelism, Strategy, finetune_setup

SLUG = "llama-3.1-8b"
#: DeepSpeed ``stage3_param_persistence_threshold`` (zero/config.py default 1e5).
PERSISTENCE = 100_000


def _lora_params(rank: int) -> int:
    """LoRA on every linear of Llama-3.1-8B's 32 layers: r·(d_in + d_out) per linear (Hu et al. 2021)."""
    h, kv, inter = 4096, 8 * 128, 14336
    linears = [(h, h), (h, kv), (h, kv), (h, h), (h, inter), (h, inter), (inter, h)]
    return 32 * sum(rank * (a + b) for a, b in linears)


def _ft(how: str, w: int, sharding: str, **kw: object) -> Strategy:
    freeze = kw.pop("freeze", ())
    adapter, base = finetune_setup(how, rank=16, freeze=freeze, base_dtype=kw.pop("base_dtype", None))  # type: ignore[arg-type]
    return Strategy(
        adapter=adapter,
        base_weights=base,
        parallelism=Parallelism(data=w),
        sharding=sharding,
        **kw,  # type: ignore[arg-type]
    )


def _step(strategy: Strategy, slug: str = SLUG) -> dict[Component, int]:
    step = estimate(slug, strategy).phase(Phase.OPTIMIZER_STEP)
    return {c: step.get(c) for c in Component}


@pytest.mark.parametrize("w", [8, 64])
def test_zero_with_lora_partitions_only_the_adapters_states(w: int) -> None:
    psi = inventory(load_model(SLUG)).total
    t = _lora_params(16)
    for stage in ("zero1", "zero2", "zero3"):
        c = _step(_ft("lora", w, stage))
        assert c[Component.MASTER_WEIGHTS] == pytest.approx(4 * t / w, rel=0.01), stage
        assert c[Component.OPTIMIZER_STATES] == pytest.approx(8 * t / w, rel=0.01), stage
        # at the step every stage holds only its partition's 16-bit gradients: stage 1 too copies its partition
        # out at the end of backward (stage_1_and_2.py ``reduce_gradients``; seen in the DeepSpeed trace); stages
        # 1–2 hold rank 0's whole, the gradient of every trainable tensor its slice of the flat buffer meets
        # (``copy_grads_in_partition``), the adapters flattened in module order (the traced engine with PEFT)
        h, kv, inter = 4096, 1024, 14336
        linears = [(h, h), (h, kv), (h, kv), (h, h), (h, inter), (h, inter), (inter, h)]
        flat = [n for _ in range(32) for d_in, d_out in linears for n in (16 * d_in, 16 * d_out)]
        met = offset = 0
        for n in flat:
            if offset >= t // w:
                break
            met, offset = met + n, offset + n
        grads = 2 * (t / w if stage == "zero3" else met)
        assert c[Component.GRADIENTS] == pytest.approx(grads, rel=0.01), stage
        if stage == "zero3":
            # every parameter partitioned (⌈n/W⌉ each, in one flat buffer); those under the persistence
            # threshold (the norms and most rank-16 A/B matrices, 16·4096 = 65536 elements) are also kept whole
            # on every rank, except in the step, which partitions them and gathers them again after it
            # (stage3.py ``step``: ``_partition_all_parameters`` ... ``_post_step``; seen in the ZeRO-3 trace).
            # The step's peak is the larger of its start (the persistent ones whole, no temporaries yet) and its
            # flattened fp32 gradient partition after they are partitioned: under LoRA the start (the traced engine)
            spec = load_model(SLUG)
            sizes = [x.numel for x, m in inventory(spec).all_tensors() for _ in range(m)] + flat
            part = sum(-(-n // w) for n in sizes)
            whole = sum(n for n in sizes if n <= PERSISTENCE)
            after = 2 * part + (2 + 4) * t / w  # the partition, its flattened gradient and the fp32 cast
            start = 2 * part + 2 * whole
            assert start > after
            assert c[Component.WEIGHTS] == pytest.approx(2 * part + 2 * whole, rel=0.001)
            assert c[Component.TEMPORARIES] == 0
            fwd = estimate(spec, _ft("lora", w, stage)).phase(Phase.FORWARD)
            assert fwd.get(Component.WEIGHTS) == pytest.approx(2 * part + 2 * whole, rel=0.001)
        else:
            assert c[Component.WEIGHTS] == pytest.approx(2 * (psi + t), rel=0.001), stage  # all in bf16


@pytest.mark.parametrize(("base_dtype", "base_bytes"), [(None, 4), ("bf16", 2)])
def test_fsdp_with_lora_shards_every_parameter_and_trains_the_adapters(base_dtype: str | None, base_bytes: int) -> None:
    psi = inventory(load_model(SLUG)).total
    t = _lora_params(16)
    w = 8
    c = _step(_ft("lora", w, "fsdp", base_dtype=base_dtype))
    # fp32 adapter shards (the policy's master weights) + fp32 sharded gradients + fp32 Adam
    assert c[Component.WEIGHTS] == pytest.approx(base_bytes * psi / w, rel=0.002)
    assert c[Component.ADAPTER_WEIGHTS] == pytest.approx(4 * t / w, rel=0.01)
    assert c[Component.GRADIENTS] == pytest.approx(4 * t / w, rel=0.01)
    # Adam's two fp32 states, plus the fused kernel's one 512-byte step counter per adapter tensor
    n_tensors = 32 * 7 * 2
    assert c[Component.OPTIMIZER_STATES] == pytest.approx(8 * t / w + 512 * n_tensors, rel=0.01)


def test_fsdp_qlora_shards_the_packed_storage_and_keeps_the_quant_state_whole() -> None:
    spec = load_model(SLUG)
    inv = inventory(spec)
    linears = sum(x.numel * g.count for g in inv.layers for x in g.tensors if x.matmul)
    rest = inv.total - linears
    w = 8
    c = _step(_ft("qlora", w, "fsdp"))
    # nf4 with double quant: n/2 packed bytes (sharded) + n/64 uint8 absmax and 4 bytes per 256 of them
    # (bitsandbytes quantize_4bit, compress_statistics) kept whole; the rest fp32 (prepare_model_for_kbit_training)
    expected = linears / 2 / w + linears / 64 + 4 * linears / 64 / 256 + 4 * rest / w
    assert c[Component.WEIGHTS] == pytest.approx(expected, rel=0.01)


def test_ddp_with_lora_adds_buckets_of_the_adapter_gradients_only() -> None:
    t = _lora_params(16)
    adapter, base = finetune_setup("lora", rank=16)
    single = estimate(SLUG, Strategy(adapter=adapter, base_weights=base))
    ddp = estimate(SLUG, _ft("lora", 4, "ddp"))
    for p1, p2 in zip(single.phases, ddp.phases, strict=True):
        # fp32 gradient buckets of the adapters (c10d reducer: requires_grad parameters only); the forward also holds
        # the first iteration's bucket of them, on NCCL's stash (parallel.ddp_stashed_first_bucket), and the backward
        # until its first reduction
        extra = p2.total_bytes - (p1.total_bytes - p1.get(Component.ALLOCATOR_ROUNDING))  # (a DDP rank: no rounding)
        if p1.phase is Phase.FORWARD:
            assert extra == pytest.approx(8 * t, abs=512 * 65), p1.phase
        elif p1.phase is Phase.BACKWARD:
            assert 4 * t - 512 * 64 <= extra <= 8 * t + 512 * 65, p1.phase
        else:
            assert extra == pytest.approx(4 * t, abs=512 * 64), p1.phase


def test_fsdp_freeze_gives_frozen_layers_no_gradients() -> None:
    spec = load_model(SLUG)
    inv = inventory(spec)
    per_layer = sum(g.params_per_layer for g in inv.layers)
    head_norm = inv.total - sum(x.numel for x in inv.model_tensors if x.name.startswith("embed")) - 32 * per_layer
    trainable = 16 * per_layer + head_norm  # layers 16-31, the final norm and the head
    w = 8
    full = _step(_ft("full", w, "fsdp"))
    frozen = _step(_ft("freeze", w, "fsdp", freeze="embeddings,layers:0-15"))
    assert frozen[Component.WEIGHTS] == full[Component.WEIGHTS]  # frozen tensors shard like any other
    assert frozen[Component.GRADIENTS] == pytest.approx(4 * trainable / w, rel=0.01)


@settings(max_examples=30, deadline=None)
@given(
    slug=st.sampled_from(("llama-3.1-8b", "qwen2.5-7b", "mistral-7b-v0.1")),
    sharding=st.sampled_from(["fsdp", "zero3", "hsdp"]),
    how=st.sampled_from(["lora", "qlora", "freeze"]),
    k=st.integers(0, 8),
    raf=st.booleans(),
    ckpt=st.sampled_from(["none", "full"]),
)
def test_more_ranks_never_add_per_rank_memory_with_adapters(
    slug: str, sharding: str, how: str, k: int, raf: bool, ckpt: str
) -> None:
    """Per-rank states never grow with W. The whole rank never grows either, except under FSDP2 past W =
    rank: LoRA's A (r × d_in) is sharded on dim 0 into ⌈r/W⌉ padded rows, so its all-gather output holds
    W·⌈r/W⌉ ≥ W rows (torch.chunk in _fsdp_param.py ``_init_sharded_param``; the fake-PG trace shows the same
    growth, tests/trace/test_distributed_finetune.py)."""
    if how == "qlora" and sharding == "zero3":
        return  # refused (test_unmodelled_layouts_are_refused_in_one_line)
    w = 2**k
    s = _ft(
        how,
        w,
        sharding,
        freeze=("embeddings", "layers:0-3") if how == "freeze" else (),
        checkpointing=ckpt,
        engine=EngineOptions(reshard_after_forward=raf if sharding != "zero3" else True),  # FSDP2's setting
    )
    a = estimate(slug, s)
    b = estimate(slug, dataclasses.replace(s, parallelism=Parallelism(data=2 * w)))
    states = (Component.WEIGHTS, Component.ADAPTER_WEIGHTS, Component.GRADIENTS, Component.OPTIMIZER_STATES)
    padded_rows = sharding != "zero3" and how != "freeze" and 2 * w > 16
    for pa, pb in zip(a.phases, b.phases, strict=True):
        assert sum(pb.get(c) for c in states) <= sum(pa.get(c) for c in states), (pa.phase, w)
        if not padded_rows:
            assert pb.total_bytes <= pa.total_bytes, (pa.phase, w)


def test_fsdp_all_gather_grows_past_the_lora_rank() -> None:
    """W·⌈r/W⌉ padded rows of each A in one layer's all-gather output: from W = r on, doubling W adds
    W·d_in more rows per A of the layer (bf16 under the policy). Per layer + root: under FSDP2's units the forward
    peaks at the loss, with [final norm, head]'s all-gather output alive instead of a layer's."""
    w = 32

    def root(s: Strategy) -> Strategy:
        return dataclasses.replace(s, engine=dataclasses.replace(s.engine, fsdp_wrap="root"))

    a = estimate(SLUG, root(_ft("lora", w, "fsdp"))).phase(Phase.FORWARD).get(Component.COMM_BUFFERS)
    b = estimate(SLUG, root(_ft("lora", 2 * w, "fsdp"))).phase(Phase.FORWARD).get(Component.COMM_BUFFERS)
    h, inter = 4096, 14336
    d_ins = [h] * 6 + [inter]  # q, k, v, o, gate, up read h; down reads the MLP width
    # ⌈16/W⌉ = 1 row per rank for A; B (d_out × 16) pads dim 0 by < W rows
    grown = sum((2 * w - w) * d * 2 for d in d_ins)
    assert b - a == pytest.approx(grown, rel=0.05)


@pytest.mark.parametrize("sharding", ["ddp", "fsdp", "hsdp", "zero1", "zero2", "zero3"])
@pytest.mark.parametrize("w", [2, 16])
def test_lora_never_adds_gradient_or_optimizer_memory(sharding: str, w: int) -> None:
    full = estimate(SLUG, _ft("full", w, sharding))
    lora = estimate(SLUG, _ft("lora", w, sharding))
    for c in (Component.GRADIENTS, Component.OPTIMIZER_STATES, Component.MASTER_WEIGHTS):
        assert max(p.get(c) for p in lora.phases) <= max(p.get(c) for p in full.phases), c


@pytest.mark.parametrize(
    ("how", "kw", "needle"),
    [
        ("lora", {"parallelism": Parallelism(data=2, tensor=2), "sharding": "zero1"}, "Megatron"),
        ("qlora", {"parallelism": Parallelism(data=8), "sharding": "zero3"}, "QLoRA with DeepSpeed"),
        ("lora-int8", {"parallelism": Parallelism(data=8), "sharding": "fsdp"}, "int8"),
    ],
)
def test_unmodelled_layouts_are_refused_in_one_line(how: str, kw: dict[str, object], needle: str) -> None:
    adapter, base = finetune_setup("lora", base_dtype="int8") if how == "lora-int8" else finetune_setup(how)
    with pytest.raises(StrategyError, match=needle) as exc:
        estimate(SLUG, Strategy(adapter=adapter, base_weights=base, **kw))  # type: ignore[arg-type]
    assert "\n" not in str(exc.value)


def test_fsdp_qlora_on_mixtral_packs_only_the_attention_linears() -> None:
    """transformers' ``replace_with_bnb_linear`` converts ``nn.Linear`` modules only: Mixtral's attention q/k/v/o.
    The router (a plain ``nn.Parameter`` of ``MixtralTopKRouter``) and the 3-D expert stacks stay float, fp32 after
    ``prepare_model_for_kbit_training``, and shard like any fp32 tensor."""
    spec = load_model("mixtral-8x7b-v0.1")
    inv = inventory(spec)
    packed = sum(x.numel * g.count for g in inv.layers for x in g.tensors if x.name.startswith("attn."))
    rest = inv.total - packed
    w = 8
    adapter, base = finetune_setup("qlora", rank=16, targets="q_proj,v_proj")
    s = Strategy(adapter=adapter, base_weights=base, parallelism=Parallelism(data=w), sharding="fsdp")
    c = _step(s, spec.name)
    expected = packed / 2 / w + packed / 64 + 4 * packed / 64 / 256 + 4 * rest / w
    assert c[Component.WEIGHTS] == pytest.approx(expected, rel=0.001)
    # the router on its own (a few MB against the experts' 23 GB per rank): an fp32 tensor, not packed storage
    from trainfit.analytic.parallel import held_tensors

    router = [h for h in held_tensors(spec, s, fsdp_mixed=True) if h.tensor.name == "mlp.router.weight"]
    assert router and all(h.packed_bytes == 0 and h.quant_state_bytes == 0 and h.bits == 32 for h in router)


_CPU = Offload.parse("optimizer+params")


@pytest.mark.parametrize(
    ("slug", "kw", "needle"),
    [
        ("mixtral-8x7b-v0.1", {"sharding": "zero2"}, "MoE layers with many GPUs"),
        ("mixtral-8x7b-v0.1", {"sharding": "fsdp", "offload": _CPU}, "MoE layers with many GPUs"),
        ("deepseek-v3", {"sharding": "fsdp"}, "mixed dense and MoE layers under FSDP2"),
    ],
)
def test_adapters_on_moe_layers_outside_ddp_and_fsdp2_are_refused(
    slug: str, kw: dict[str, object], needle: str
) -> None:
    adapter, base = finetune_setup("lora", targets="all-linear")
    s = Strategy(adapter=adapter, base_weights=base, parallelism=Parallelism(data=8), checkpointing="full", **kw)  # type: ignore[arg-type]
    with pytest.raises(StrategyError, match=needle) as exc:
        estimate(slug, s)
    assert "\n" not in str(exc.value)
    # DDP holds whole replicas (no layer groups): the one-GPU closed forms plus the buckets of the trainable gradients
    estimate(slug, dataclasses.replace(s, sharding="ddp", offload=Offload()))

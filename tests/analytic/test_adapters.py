"""Fine-tuning in the analytic model: adapter tensors, frozen and quantised base storage, what a frozen layer
saves, refusals, and invariants (freezing or LoRA never adds gradient or optimizer memory).

Expected numbers are derived by hand from the formulas in the docstrings they cite, never read off the code.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfit import Strategy, estimate
from trainfit.analytic.activations import first_layer_unsaved_bytes, layer_terms
from trainfit.analytic.states import model_states, param_states
from trainfit.arch import load_model
from trainfit.arch.config import spec_from_config
from trainfit.errors import StrategyError
from trainfit.result import Component, Phase
from trainfit.strategy import Adapter, AdapterKind, BaseWeights, Parallelism, finetune_setup

LLAMA = {
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
    "max_position_embeddings": 512, "tie_word_embeddings": False,
}  # fmt: skip


def tiny(**over: object) -> object:
    return spec_from_config({**LLAMA, **over}, name="tiny-llama", source="test")


def test_frozen_layer_saves_what_the_closed_forms_say() -> None:
    """amp-bf16 over a bf16 base, fp32 adapters on q and v, no dropout, flash SDPA (DESIGN §4.4):
    RMSNorm keeps its fp32 input and rsqrt but no normed output (frozen weight); frozen q/k/v/o keep nothing;
    each adapter keeps a bf16 copy of x (T·d_in·2; PEFT casts x to fp32, autocast casts it back) and lora_A's
    output (T·r·2); SDPA keeps q, k, v, out, lse; a frozen SwiGLU keeps gate, act and up (3·2·T·i)."""
    spec = tiny()
    a, b = finetune_setup("lora", rank=8, targets="q_proj,v_proj", base_dtype="bf16")
    s = Strategy(adapter=a, base_weights=b, micro_batch=2, seq_len=256)
    t, h, i, r = 512, 256, 512, 8
    qd, kd = 4 * 64, 2 * 64
    norm = 4 * t + 4 * t * h
    lora = 2 * (2 * t * h + 2 * t * r)
    sdpa = 2 * t * (qd + 2 * kd) + 2 * t * qd + 4 * 2 * 4 * 256
    mlp = 3 * 2 * t * i
    assert sum(x.bytes for x in layer_terms(spec, s)) == 2 * norm + lora + sdpa + mlp
    # Without checkpointing PEFT leaves the embeddings' output without grad: layer 0's first norm saves nothing.
    assert first_layer_unsaved_bytes(spec, s) == norm
    assert first_layer_unsaved_bytes(spec, dataclasses.replace(s, checkpointing="full")) == 0


def test_dropout_and_bf16_adapters_change_the_adapter_terms_as_derived() -> None:
    spec = tiny()
    t, h, r = 512, 256, 8
    base = Strategy(micro_batch=2, seq_len=256, precision="pure-bf16")
    a16, b = finetune_setup("lora", rank=r, targets="q_proj,v_proj", base_dtype="bf16", adapter_dtype="bf16")
    a16d, _ = finetune_setup(
        "lora", rank=r, targets="q_proj,v_proj", base_dtype="bf16", adapter_dtype="bf16", dropout=0.1
    )
    plain = sum(x.bytes for x in layer_terms(spec, dataclasses.replace(base, adapter=a16, base_weights=b)))
    dropped = sum(x.bytes for x in layer_terms(spec, dataclasses.replace(base, adapter=a16d, base_weights=b)))
    # bf16 adapters on a bf16 input, no autocast, no dropout: x itself is saved once for both adapters.
    # With dropout each adapter keeps its dropped copy (2·T·h) and a bool mask (T·h) instead.
    assert dropped - plain == 2 * (2 * t * h + t * h) - 2 * t * h


def test_lora_states_count_only_the_adapters() -> None:
    """Llama-3.2-1B, rank 16, q and v: A (16 × 2048) + B (2048 × 16 / 512 × 16) per layer, 16 layers; fp32
    adapters: fp32 grads, AdamW states 8 B/param plus the fused kernel's step per tensor (512-byte block)."""
    spec = load_model("llama-3.2-1b")
    a, b = finetune_setup("lora", rank=16, targets="q_proj,v_proj", base_dtype="bf16")
    stt = model_states(spec, Strategy(adapter=a, base_weights=b))
    per_layer = 16 * (2048 + 2048) + 16 * (2048 + 512)
    n = 16 * per_layer
    assert stt.trainable_params == n
    assert stt.grads_bytes == 4 * n and stt.adapter_weights_bytes == 4 * n
    assert stt.optimizer_bytes == 8 * n + 16 * 4 * 512
    # The base: bf16, every tensor frozen.
    assert stt.weights_bytes == 2 * stt.params
    assert stt.master_bytes == 0


@pytest.mark.parametrize("name", ["llama-3.1-8b", "gpt2-large", "phi-2", "pythia-6.9b"])
def test_qlora_base_is_about_half_a_byte_per_parameter(name: str) -> None:
    """nf4 + double quantisation: n/2 + n/64 (uint8 absmax) + 4·n/(64·256) ≈ 0.516 B/param for the layer
    linears (QLoRA paper: 4.127 bits), on GPT-2's Conv1D, Phi-2 and NeoX layers as on Llama's;
    prepare_model_for_kbit_training keeps the rest in fp32."""
    spec = load_model(name)
    a, b = finetune_setup("qlora", rank=16)
    states = param_states(spec, Strategy(adapter=a, base_weights=b))
    out = ("lm_head", "embed")  # the head (GPT-2: the tied token table) is not quantised
    packed = [x for x in states if not x.adapter and x.tensor.matmul and not x.tensor.name.startswith(out)]
    per_param = sum(x.count * x.weight_bytes for x in packed) / sum(x.count * x.tensor.numel for x in packed)
    assert 0.515 < per_param < 0.53
    if name != "llama-3.1-8b":
        return
    (emb,) = [x for x in states if x.tensor.name == "embed_tokens.weight"]
    assert emb.weight_bytes == 4 * emb.tensor.numel  # cast to fp32 by prepare_model_for_kbit_training


def test_nf4_bytes_match_bitsandbytes() -> None:
    """The byte formula against bitsandbytes' own quantize_4bit on a real CPU tensor (DESIGN §4.4)."""
    torch = pytest.importorskip("torch")
    f = pytest.importorskip("bitsandbytes.functional")
    from trainfit.cuda_facts import quantized_weight_tensors

    for rows, cols, dq in ((300, 1000, True), (257, 130, True), (300, 1000, False)):
        w = torch.zeros(rows, cols, dtype=torch.bfloat16)
        q, qs = f.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=dq)
        parts = [q, qs.absmax, qs.code]
        if dq:
            parts += [qs.offset, qs.state2.absmax, qs.state2.code]
        real = sum(p.numel() * p.element_size() for p in parts)
        assert real == sum(quantized_weight_tensors(rows * cols, rows, "nf4", double_quant=dq))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(finetune="qlora", base_dtype="fp32"), "qlora quantises the base"),
        (dict(finetune="lora", rank=0), r"rank \(--lora-rank\) must be a positive integer"),
        (dict(finetune="lora", dropout=1.0), "dropout"),
        (dict(finetune="full", base_dtype="bf16"), "frozen base"),
        (dict(finetune="freeze"), "needs --freeze"),
        (dict(finetune="lora", freeze="embeddings"), "needs --finetune freeze"),
        (dict(finetune="lora", adapter_dtype="int8"), "adapter-dtype|16- or 32-bit"),
        (dict(finetune="dora-ish"), "unknown finetune"),
    ],
)
def test_bad_combinations_are_one_line_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(StrategyError, match=match):
        finetune_setup(**kwargs)  # type: ignore[arg-type]


def test_model_dependent_refusals() -> None:
    spec = tiny()
    a, b = finetune_setup("lora", targets="q_proj,query_key_value")
    with pytest.raises(StrategyError, match="no module named query_key_value"):
        estimate(spec, Strategy(adapter=a, base_weights=b))
    _, bad = finetune_setup("freeze", freeze="layers:0-9")
    with pytest.raises(StrategyError, match="goes past"):
        estimate(spec, Strategy(base_weights=bad))
    with pytest.raises(StrategyError, match="cannot be fully fine-tuned"):
        Strategy(base_weights=BaseWeights(quantization="nf4"))


def test_freeze_removes_exactly_the_frozen_tensors_states() -> None:
    """Freezing embeddings and layers 0-1 of 4: AdamW (fp32 recipe) keeps 8 B per trainable parameter (+ one
    512-byte fused step counter per trainable tensor)."""
    spec = tiny()
    _, fb = finetune_setup("freeze", freeze="embeddings,layers:0-1")
    s = Strategy(precision="fp32", base_weights=fb)
    stt = model_states(spec, s)
    full = model_states(spec, Strategy(precision="fp32"))
    layer = (full.params - 2 * 1024 * 256 - 256) // 4  # minus embed, lm_head, final norm
    assert stt.trainable_params == full.params - 1024 * 256 - 2 * layer
    assert stt.grads_bytes == 4 * stt.trainable_params


@settings(max_examples=25, deadline=None)
@given(
    layers=st.integers(1, 6),
    rank=st.integers(1, 64),
    targets=st.sampled_from(["all-linear", "q_proj,v_proj", "down_proj", "o_proj,up_proj"]),
    freeze=st.sampled_from(["embeddings", "layers:0-0", "lm_head,norm", "q_proj,k_proj"]),
    precision=st.sampled_from(["amp-bf16", "pure-bf16", "fp32", "master-bf16"]),
)
def test_freezing_or_lora_never_adds_gradient_or_optimizer_memory(
    layers: int, rank: int, targets: str, freeze: str, precision: str
) -> None:
    spec = tiny(num_hidden_layers=layers)
    full = Strategy(precision=precision)
    ref = model_states(spec, full)
    a, b = finetune_setup("lora", rank=rank, targets=targets)
    _, fb = finetune_setup("freeze", freeze=freeze)
    for s in (dataclasses.replace(full, adapter=a, base_weights=b), dataclasses.replace(full, base_weights=fb)):
        stt = model_states(spec, s)
        assert stt.grads_bytes <= ref.grads_bytes
        assert stt.optimizer_bytes + stt.master_bytes <= ref.optimizer_bytes + ref.master_bytes
        r = estimate(spec, s)
        step = r.phase(Phase.OPTIMIZER_STEP)
        assert step.get(Component.GRADIENTS) <= ref.grads_bytes


def test_full_fine_tuning_numbers_are_untouched_by_the_adapter_code() -> None:
    """An adapter-free strategy takes none of the fine-tuning paths (goldens pin the exact numbers)."""
    spec = load_model("llama-3.2-1b")
    s = Strategy()
    assert all(x.trainable and not x.adapter and x.bits == 0 for x in param_states(spec, s))
    assert model_states(spec, s).adapter_weights_bytes == 0
    assert Adapter().targets == ("all-linear",)


# -- layouts beyond Llama: the linears as transformers names them (modeling_gpt2.py, modeling_falcon.py, ...) --

GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 128}
PHI3 = {
    "model_type": "phi3", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128,
    "pad_token_id": 0,
}  # fmt: skip
FALCON = {
    "model_type": "falcon", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "vocab_size": 256, "new_decoder_architecture": False, "multi_query": True, "parallel_attn": True,
    "bias": False, "max_position_embeddings": 128,
}  # fmt: skip


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        # GPT2Attention: c_attn Conv1D(3h, h), c_proj Conv1D(h, h); GPT2MLP: c_fc Conv1D(4h, h), c_proj Conv1D(h, 4h)
        (GPT2, {"c_attn": (64, 192), "attn.c_proj": (64, 64), "c_fc": (64, 256), "mlp.c_proj": (256, 64)}),
        # Phi3Attention: qkv_proj (h → (heads + 2·kv)·hd), o_proj; Phi3MLP: gate_up_proj (h → 2·i), down_proj
        (PHI3, {"qkv_proj": (64, 128), "o_proj": (64, 64), "gate_up_proj": (64, 192), "down_proj": (96, 64)}),
        # FalconAttention: query_key_value (multi-query: h + 2·hd), dense; FalconMLP: dense_h_to_4h, dense_4h_to_h
        (
            FALCON,
            {"query_key_value": (64, 96), "dense": (64, 64), "dense_h_to_4h": (64, 256), "dense_4h_to_h": (256, 64)},
        ),
    ],
)
def test_all_linear_is_every_linear_as_transformers_names_it(
    cfg: dict[str, object], expected: dict[str, tuple[int, int]]
) -> None:
    from trainfit.analytic.adapters import adapter_sites

    spec = spec_from_config(cfg, name="tiny", source="test")
    sites = adapter_sites(spec, Adapter(rank=4))
    assert {s.name: (s.d_in, s.d_out) for s in sites} == expected


def test_targets_match_as_peft_matches_module_paths() -> None:
    """PEFT matches a target as the module path or a ``.``-suffix of it: GPT-2's ``c_proj`` is both projections,
    ``attn.c_proj`` only the attention's; a parallel block's MLP reads the attention's normed input."""
    from trainfit.analytic.adapters import SiteInput, adapter_sites

    gpt2 = spec_from_config(GPT2, name="tiny-gpt2", source="test")
    assert [s.name for s in adapter_sites(gpt2, Adapter(targets=("c_proj",)))] == ["attn.c_proj", "mlp.c_proj"]
    assert [s.name for s in adapter_sites(gpt2, Adapter(targets=("attn.c_proj",)))] == ["attn.c_proj"]
    falcon = spec_from_config(FALCON, name="tiny-falcon", source="test")
    reads = {s.name: s.reads for s in adapter_sites(falcon, Adapter())}
    assert reads["dense_h_to_4h"] is SiteInput.NORM1 and reads["query_key_value"] is SiteInput.NORM1
    with pytest.raises(StrategyError, match="no module named q_proj in tiny-falcon; its linears are query_key_value"):
        adapter_sites(falcon, Adapter(targets=("q_proj",)))
    # BERT: ``output.dense`` ends both outputs' paths (attention.output.dense, layer.N.output.dense); the longer
    # ``attention.output.dense`` ends only the attention's (it once adapted both); a target on one layer's module
    # is PEFT's to run (the trace), not the closed forms'
    bert = load_model("bert-base-uncased")
    names = [s.name for s in adapter_sites(bert, Adapter(targets=("output.dense",)))]
    assert names == ["attention.output.dense", "output.dense"]
    assert [s.name for s in adapter_sites(bert, Adapter(targets=("attention.output.dense",)))] == names[:1]
    assert [s.name for s in adapter_sites(bert, Adapter(targets=("intermediate.dense",)))] == ["intermediate.dense"]
    from trainfit.analytic.adapters import check_finetune_model

    one_layer = Strategy(adapter=Adapter(targets=("layer.0.output.dense",)), base_weights=BaseWeights())
    with pytest.raises(StrategyError, match=r"on some layers only \(layer.0.output.dense\)"):
        check_finetune_model(bert, one_layer)
    check_finetune_model(bert, one_layer, analytic=False)


def test_moe_targets_are_checked_and_the_layouts_beyond_routed_experts_refused() -> None:
    """Mixtral's v4 expert names are PEFT targets (converted to target_parameters), half of the fused gate_up is
    not (PEFT raises), ParamWrapper refuses dropout and DoRA (both methods); DeepSeek-V3 (MLA, shared experts, dense
    layers) is modelled over a float, a 4-bit and an LLM.int8 base."""
    mixtral = load_model("mixtral-8x7b-v0.1")
    from trainfit.analytic.adapters import adapter_sites, check_finetune_model

    a, b = finetune_setup("lora", targets="q_proj,v_proj", base_dtype="bf16")
    s = Strategy(adapter=a, base_weights=b)
    check_finetune_model(mixtral, s)
    check_finetune_model(mixtral, dataclasses.replace(s, adapter=Adapter(targets=("q_proj", "w1", "w3", "w2", "gate"))))
    with pytest.raises(StrategyError, match="fuses w1 and w3 into gate_up_proj"):
        check_finetune_model(mixtral, dataclasses.replace(s, adapter=Adapter(targets=("w1",))), analytic=False)
    with pytest.raises(StrategyError, match="experts are 3-D parameters"):
        check_finetune_model(mixtral, dataclasses.replace(s, adapter=Adapter(targets=("experts",))), analytic=False)
    for bad in (Adapter(dropout=0.05), Adapter(kind=AdapterKind.DORA)):
        for analytic in (True, False):
            with pytest.raises(StrategyError, match="ParamWrapper"):
                check_finetune_model(mixtral, dataclasses.replace(s, adapter=bad), analytic=analytic)
    # without checkpointing the first layer saves from its first adapter on (BlindLayer): not derived for adapted
    # experts over an input that needs no gradient; an attention target (o_proj included) makes that input need one
    experts_only = dataclasses.replace(s, adapter=Adapter(targets=("w1", "w3", "w2")))
    with pytest.raises(StrategyError, match="only with an attention target"):
        check_finetune_model(mixtral, experts_only)
    check_finetune_model(mixtral, dataclasses.replace(s, adapter=Adapter(targets=("w2", "o_proj"))))
    check_finetune_model(mixtral, dataclasses.replace(s, adapter=Adapter(targets=("o_proj",))))
    check_finetune_model(mixtral, experts_only, analytic=False)
    check_finetune_model(mixtral, dataclasses.replace(experts_only, checkpointing="full"))
    # attention-only targets never reach a ParamWrapper: dropout is fine there
    check_finetune_model(mixtral, dataclasses.replace(s, adapter=Adapter(targets=("q_proj",), dropout=0.05)))
    from trainfit.analytic.parallel import check_parallel_finetune, resolve_engine

    sharded = dataclasses.replace(s, parallelism=Parallelism(data=8), sharding="zero3")
    with pytest.raises(StrategyError, match=r"modelled for --sharding ddp\|fsdp\|hsdp without offload only"):
        check_parallel_finetune(mixtral, sharded, resolve_engine(sharded))
    fsdp = dataclasses.replace(sharded, sharding="fsdp")
    check_parallel_finetune(mixtral, fsdp, resolve_engine(fsdp))  # checked against the trace of one FSDP2 rank
    # PEFT leaves Qwen2-MoE's config alone: no ParamWrapper, so dropout is fine; its shared expert is a layer site
    qwen2_moe = spec_from_config(
        {"model_type": "qwen2_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256, "num_experts": 4, "num_experts_per_tok": 2},
        name="tiny-qwen2-moe", source="test",
    )  # fmt: skip
    check_finetune_model(qwen2_moe, dataclasses.replace(s, adapter=Adapter(dropout=0.05)))
    assert {x.name for x in adapter_sites(qwen2_moe, Adapter())} >= {"gate_proj", "down_proj", "shared_expert_gate"}
    deepseek = load_model("deepseek-v3")
    mla = Adapter(targets=("q_a_proj", "kv_b_proj"))
    check_finetune_model(deepseek, dataclasses.replace(s, adapter=mla), analytic=False)
    check_finetune_model(deepseek, dataclasses.replace(s, adapter=mla))
    # without checkpointing: DeepSeek's first layer is dense (first_k_dense_replace), its MoE layers all see inputs
    # that need a gradient, so any attention target will do (against the trace: tests/trace/test_peft.py)
    check_finetune_model(deepseek, dataclasses.replace(s, adapter=Adapter(targets=("kv_b_proj", "o_proj"))))
    # a 4-bit base: the MLA linears and shared experts packed, the experts and router float (both methods)
    qa, qb = finetune_setup("qlora", targets="q_a_proj", base_dtype="nf4")
    check_finetune_model(deepseek, dataclasses.replace(s, adapter=qa, base_weights=qb))
    # LLM.int8: both methods (the inputs MatMul8bitLt keeps on ctx in MoE/MLA layers: activations.int8_layer_inputs)
    ia, ib = finetune_setup("lora", targets="q_a_proj", base_dtype="int8")
    check_finetune_model(deepseek, dataclasses.replace(s, adapter=ia, base_weights=ib), analytic=False)
    check_finetune_model(deepseek, dataclasses.replace(s, adapter=ia, base_weights=ib))


def test_deepseek_lora_parameters_follow_peft_conversion() -> None:
    """all-linear on DeepSeek-V3 (transformers' conversion_mapping.py maps ``deepseek_v3`` to the Qwen2-MoE pattern,
    so PEFT's ``_convert_peft_config_moe`` rewrites the config): every layer's MLA linears (q_a, q_b, kv_a, kv_b, o) get
    a LoRA pair; the 58 MoE layers' router and expert stacks get ParamWrapper pairs (gate_up at twice the rank); the
    names gate_proj/up_proj/down_proj go to the experts, so the 3 dense MLPs and the shared experts get nothing.
    Written out from the config numbers."""
    ds = load_model("deepseek-v3")
    assert ds.mla is not None and ds.moe is not None and ds.mla.q_lora_rank is not None
    m, e = ds.mla, ds.moe
    r, h, heads = 8, ds.hidden_size, ds.num_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    attention = (
        r * (h + m.q_lora_rank)
        + r * (m.q_lora_rank + heads * qk)
        + r * (h + m.kv_lora_rank + m.qk_rope_head_dim)
        + r * (m.kv_lora_rank + heads * (m.qk_nope_head_dim + m.v_head_dim))
        + r * (heads * m.v_head_dim + h)
    )
    n_e, i = e.num_experts, e.expert_intermediate_size
    moe = r * (h + n_e) + 2 * r * n_e * (h + 2 * i) + r * n_e * (i + h)
    n_moe = ds.num_layers - e.num_dense_layers
    a, b = finetune_setup("lora", rank=r, targets="all-linear", base_dtype="bf16")
    s = Strategy(adapter=a, base_weights=b, micro_batch=1, seq_len=512, checkpointing="full")
    assert estimate(ds, s).trainable_params == ds.num_layers * attention + n_moe * moe
    # gate_proj names the routed experts' fused gate_up (with up_proj), never the dense or shared MLPs
    a, b = finetune_setup("lora", rank=r, targets="q_b_proj,gate_proj,up_proj", base_dtype="bf16")
    s = dataclasses.replace(s, adapter=a, base_weights=b)
    want = ds.num_layers * r * (m.q_lora_rank + heads * qk) + n_moe * 2 * r * n_e * (h + 2 * i)
    assert estimate(ds, s).trainable_params == want


def test_moe_lora_parameters_are_peft_param_wrappers() -> None:
    """all-linear on Mixtral-8x7B: attention pairs, plus ParamWrapper pairs (PEFT ``ParamWrapper.update_layer``:
    lora_A r·E × d_in, lora_B d_out × r·E) on the router's E × h weight (E = 1 there), the fused gate_up stack at
    twice the rank (``_convert_peft_config_moe`` rank_pattern) and the down stack, written out from the config."""
    mixtral = load_model("mixtral-8x7b-v0.1")
    r, e, h, i, kv, n = 16, 8, 4096, 14336, 1024, 32
    a, b = finetune_setup("lora", rank=r, targets="all-linear", base_dtype="bf16")
    report = estimate(mixtral, Strategy(adapter=a, base_weights=b, micro_batch=1, seq_len=512))
    attention = r * (h + h) + 2 * r * (h + kv) + r * (h + h)
    router = r * (h + e)
    experts = 2 * r * e * (h + 2 * i) + r * e * (i + h)
    assert report.trainable_params == n * (attention + router + experts)
    a, b = finetune_setup("lora", rank=r, targets="q_proj,w2", base_dtype="bf16")
    report = estimate(mixtral, Strategy(adapter=a, base_weights=b, micro_batch=1, seq_len=512))
    assert report.trainable_params == n * (r * (h + h) + r * e * (i + h))


@pytest.mark.parametrize("slug", ["mixtral-8x7b-v0.1", "qwen3-30b-a3b"])
@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj"])
def test_moe_lora_never_needs_more_gradient_or_optimizer_memory_than_full_finetuning(slug: str, targets: str) -> None:
    spec = load_model(slug)
    full = estimate(spec, Strategy(precision="pure-bf16", micro_batch=1, seq_len=1024))
    a, b = finetune_setup("lora", targets=targets, base_dtype="bf16", adapter_dtype="bf16")
    lora = estimate(spec, Strategy(adapter=a, base_weights=b, precision="pure-bf16", micro_batch=1, seq_len=1024))
    step_f, step_l = full.phases[-1], lora.phases[-1]
    for comp in (Component.GRADIENTS, Component.OPTIMIZER_STATES):
        assert step_l.get(comp) <= step_f.get(comp), comp
    assert lora.trainable_params < full.trainable_params


def test_qlora_without_autocast_feeds_sdpa_fp32() -> None:
    """A 4-bit q/k/v returns its input's dtype (bitsandbytes ``Linear4bit.forward``), fp32 over QLoRA's fp32
    residual: under pure bf16 a grouped-query Llama gets SDPA's math kernel and a warning that says why; under
    amp-bf16 autocast casts q/k/v and flash runs; LoRA over a bf16 base keeps flash under pure bf16 too."""
    from trainfit.analytic.activations import MATH, sdpa_kernel
    from trainfit.cuda_facts import SdpaKernel
    from trainfit.estimate import attention_warnings
    from trainfit.strategy import finetune_setup

    spec = load_model("llama-3.2-1b")
    a, b = finetune_setup("qlora", rank=16, targets="all-linear")
    pure = Strategy(adapter=a, base_weights=b, precision="pure-bf16", seq_len=512)
    assert sdpa_kernel(spec, pure) is MATH
    (warning,) = attention_warnings(spec, pure)
    assert "4-bit base's q/k/v come out fp32" in warning
    amp = dataclasses.replace(pure, precision="amp-bf16")
    assert sdpa_kernel(spec, amp) is SdpaKernel.FLASH and attention_warnings(spec, amp) == []
    la, lb = finetune_setup("lora", rank=16, targets="all-linear", base_dtype="bf16")
    assert sdpa_kernel(spec, Strategy(adapter=la, base_weights=lb, precision="pure-bf16")) is SdpaKernel.FLASH

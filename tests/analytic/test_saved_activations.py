"""The analytic saved-activation model against what autograd really saves, tensor storage by storage.

A ``saved_tensors_hooks`` pack hook sees every tensor autograd keeps for backward during a real
forward of the transformers module on the CPU (tiny random configs, no download). Storages are
de-duplicated; parameters and autocast's weight casts (``autocast_copies``, a separate component)
are excluded. fp32 and pure-bf16 run the same kernels' saving logic on CPU and CUDA except for the
attention kernel; autocast is compared only for blocks whose ops have the same CPU and CUDA policy.
"""

from __future__ import annotations

from unittest import mock

import pytest

from trainfit.analytic import activations as act
from trainfit.analytic.activations import layer_terms, model_terms
from trainfit.arch.config import spec_from_config
from trainfit.arch.spec import ModelKind, ModelSpec, NormKind
from trainfit.strategy import Strategy

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

B, S = 2, 32
_SMALL = dict(vocab_size=320, max_position_embeddings=128)

CONFIGS: dict[str, dict] = {
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **_SMALL,
    ),
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **_SMALL,
    ),
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        **_SMALL,
    ),
    "mistral": dict(
        model_type="mistral",
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=None,
        **_SMALL,
    ),
    "gpt2": dict(
        model_type="gpt2",
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=320,
        n_positions=128,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    ),
    # Residual and embedding dropout save 1-byte masks (attention dropout is left at 0: the CPU flash
    # kernel has no dropout and falls back to the math kernel, unlike CUDA's flash kernel).
    "gpt2-dropout": dict(
        model_type="gpt2",
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=320,
        n_positions=128,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.0,
    ),
    "gpt_neox": dict(
        model_type="gpt_neox",
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **_SMALL,
    ),
    "starcoder2": dict(
        model_type="starcoder2",
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        residual_dropout=0.0,
        embedding_dropout=0.0,
        attention_dropout=0.0,
        sliding_window=None,
        **_SMALL,
    ),
    "phi": dict(
        model_type="phi",
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        **_SMALL,
    ),
    "mixtral": dict(
        model_type="mixtral",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        **_SMALL,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=48,
        num_hidden_layers=2,
        head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        **_SMALL,
    ),
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        **_SMALL,
    ),
    "gemma": dict(
        model_type="gemma",
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        **_SMALL,
    ),
    # Gemma-2 has no SDPA path in transformers: eager attention with tanh soft-capping.
    "gemma2": dict(
        model_type="gemma2",
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=64,
        **_SMALL,
    ),
    "opt": dict(
        model_type="opt",
        hidden_size=64,
        ffn_dim=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        dropout=0.0,
        attention_dropout=0.0,
        word_embed_proj_dim=64,
        **_SMALL,
    ),
    "phi3": dict(
        model_type="phi3",
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        **_SMALL,
    ),
    "bert": dict(
        model_type="bert",
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **_SMALL,
    ),
}


def _is_weight_cast(t: torch.Tensor) -> bool:
    """A 16-bit copy of a parameter made by autocast (a separate component, ``autocast_copies``):
    a cast / transpose / view chain of at most three nodes that ends at a parameter's AccumulateGrad."""
    fn = t.grad_fn
    for _ in range(3):
        if fn is None or type(fn).__name__ not in ("TBackward0", "ToCopyBackward0", "SelectBackward0", "ViewBackward0"):
            return False
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if any(type(f).__name__ == "AccumulateGrad" for f in nxt):
            return True
        fn = nxt[0] if len(nxt) == 1 else None
    return False


def _attention(cfg: dict) -> str:
    spec = spec_from_config(cfg, name="t", source="test")
    return "sdpa" if spec.supports_sdpa else "eager"


def measured_saved_bytes(cfg: dict, dtype: torch.dtype, amp: bool, attention: str | None = None, batch: int = B) -> int:
    hf = transformers.AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    hf._attn_implementation = attention or _attention(cfg)
    auto = transformers.AutoModelForMaskedLM if cfg["model_type"] == "bert" else transformers.AutoModelForCausalLM
    torch.manual_seed(0)
    model = auto.from_config(hf).to(dtype).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params and not _is_weight_cast(t):
            seen[st.data_ptr()] = st.nbytes()
        return t

    ids = torch.randint(0, hf.vocab_size, (batch, S))
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp),
    ):
        model(input_ids=ids)  # no labels: the loss/logits part is modelled separately
    return sum(seen.values())


def _layers_bytes(spec: ModelSpec, st: Strategy) -> int:
    total = 0
    for count, moe in ((spec.num_dense_layers, False), (spec.num_moe_layers, True)):
        if count:
            total += count * sum(t.bytes for t in layer_terms(spec, st, moe=moe))
    return total


def analytic_saved_bytes(cfg: dict, precision: str, attention: str | None = None, batch: int = B) -> int:
    spec = spec_from_config(cfg, name="t", source="test")
    st = Strategy(precision=precision, micro_batch=batch, seq_len=S, attention=attention or _attention(cfg))  # type: ignore[arg-type]
    # Gemma-2's final soft-cap saves tanh(logits) during the forward itself (the loss is modelled apart).
    softcap = st.recipe.compute_bits // 8 * batch * S * spec.vocab_size if spec.final_logit_softcapping else 0
    layers = 0
    for count, moe in ((spec.num_dense_layers, False), (spec.num_moe_layers, True)):
        if count:
            layers += count * sum(t.bytes for t in layer_terms(spec, st, moe=moe))
    return layers + sum(t.bytes for t in model_terms(spec, st)) + softcap


#: Families whose RoPE builds q with ``torch.cat`` (partial rotary: NeoX, Phi; Phi-3 always).
Q_BUILT_BY_CAT = frozenset({"gpt_neox", "phi", "phi3"})


def cpu_artefacts(
    cfg: dict, precision: str, batch: int = B, attention: str | None = None, *, cpu_math_kernel: bool = False
) -> int:
    """Bytes by which a CPU run differs from the CUDA run the analytic model describes (documented
    in docs/accuracy.md):

    1. The CPU flash-attention kernel lays its output out like q. Where q is built by ``torch.cat``
       (NeoX, Phi, Phi-3), q is contiguous as (b, heads, s, hd), so the ``transpose(1, 2)
       .contiguous()`` before the output projection copies it: +a·t·q_dim per layer. CUDA's flash and
       memory-efficient kernels always allocate the output as (b, s, heads, hd): no copy.
    2. CPU ``layer_norm`` keeps mean and rstd in the input dtype; CUDA keeps them in fp32 (opmath):
       −4·t bytes per LayerNorm in bf16.
    3. CPU dropout multiplies by a noise tensor of the input dtype; CUDA's fused ``native_dropout``
       saves a bool mask (1 byte per element): +(a − 1)·t·h per dropout.
    4. The CPU flash kernel runs fp32 and fewer k/v heads (``enable_gqa``); on CUDA flash is 16-bit only
       and the memory-efficient kernel has no GQA, so CUDA takes the math kernel for GQA models in fp32
       (``sdpa_kernel``): the CPU saves what a flash kernel saves instead.

    ``cpu_math_kernel``: the CPU run was forced onto SDPA's math kernel, as the analytic side is; then
    1. and 4. do not arise (the math kernel saves no output of its own, and runs the CUDA code).
    """
    spec = spec_from_config(cfg, name="t", source="test")
    t = batch * S
    a = 4 if precision == "fp32" else 2
    delta = 0
    st = Strategy(precision=precision, micro_batch=batch, seq_len=S, attention=attention or _attention(cfg))  # type: ignore[arg-type]
    if st.attention.value == "sdpa" and act.sdpa_kernel(spec, st) == act.MATH and not cpu_math_kernel:
        with mock.patch.object(act, "sdpa_kernel", return_value=act.FLASH):
            as_flash = _layers_bytes(spec, st)
        delta += as_flash - _layers_bytes(spec, st)
    if spec.model_type in Q_BUILT_BY_CAT and not (cpu_math_kernel and st.attention.value == "sdpa"):
        delta += spec.num_layers * a * t * spec.q_dim
    if spec.norm is NormKind.LAYERNORM and precision == "pure-bf16":
        n_norms = spec.num_layers * spec.norms_per_layer + int(spec.final_norm) + int(spec.embedding_norm)
        n_norms += int(spec.kind is ModelKind.MASKED_LM)  # MLM head transform LayerNorm
        delta -= 4 * t * n_norms
    masks = 2 * spec.num_layers * (spec.hidden_dropout > 0) + (spec.embedding_dropout > 0)
    delta += masks * (a - 1) * t * spec.hidden_size
    return delta


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize(("precision", "dtype"), [("fp32", "float32"), ("pure-bf16", "bfloat16")])
def test_saved_activations_match_autograd(family: str, precision: str, dtype: str) -> None:
    cfg = CONFIGS[family]
    measured = measured_saved_bytes(cfg, getattr(torch, dtype), amp=False)
    assert analytic_saved_bytes(cfg, precision) + cpu_artefacts(cfg, precision) == measured


@pytest.mark.parametrize(
    "family", ["llama", "qwen2", "qwen3", "mistral", "starcoder2", "mixtral", "qwen2_moe", "qwen3_moe"]
)
def test_saved_activations_match_autograd_under_autocast(family: str) -> None:
    """Blocks whose every op has the same autocast policy on CPU and CUDA. Left out: HF's Python
    gelu_new (GPT-2, Phi: CUDA autocast runs ``pow`` in fp32, CPU autocast in bf16) and BERT's MLM
    head LayerNorm on a bf16 input (CUDA autocast upcasts ``layer_norm``, CPU autocast does not);
    the trace engine emulates CUDA's policy for those."""
    cfg = CONFIGS[family]
    assert analytic_saved_bytes(cfg, "amp-bf16") == measured_saved_bytes(cfg, torch.float32, True)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma", "gpt2", "bert", "opt"])
@pytest.mark.parametrize(("precision", "dtype"), [("fp32", "float32"), ("pure-bf16", "bfloat16")])
def test_eager_attention_matches_autograd(family: str, precision: str, dtype: str) -> None:
    """Eager attention: repeat_kv copies, the softmax output (fp32 where the model upcasts it; GPT-2 and
    BERT keep the scores' dtype) and the probabilities."""
    cfg = CONFIGS[family]
    measured = measured_saved_bytes(cfg, getattr(torch, dtype), amp=False, attention="eager")
    assert (
        analytic_saved_bytes(cfg, precision, attention="eager") + cpu_artefacts(cfg, precision, attention="eager")
        == measured
    )


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_eager_attention_batch_of_one(family: str) -> None:
    """With one sequence, matmul folds (batch, heads) of a head-interleaved view without copying, so GPT-2's
    q stays a view that keeps the whole fused qkv output (next to the KV cache's k, v copies)."""
    cfg = CONFIGS[family]
    measured = measured_saved_bytes(cfg, torch.float32, amp=False, attention="eager", batch=1)
    analytic = analytic_saved_bytes(cfg, "fp32", attention="eager", batch=1)
    assert analytic + cpu_artefacts(cfg, "fp32", 1, attention="eager") == measured


@pytest.mark.parametrize("batch", [1, B])
@pytest.mark.parametrize(("precision", "dtype"), [("fp32", "float32"), ("pure-bf16", "bfloat16")])
@pytest.mark.parametrize("family", sorted(f for f in CONFIGS if f != "gemma2"))
def test_sdpa_math_kernel_matches_autograd(family: str, precision: str, dtype: str, batch: int) -> None:
    """The math kernel's own terms, checked in place: the CPU run is forced onto SDPA's math kernel
    (``sdpa_kernel(SDPBackend.MATH)``, the same composite code CUDA runs) and the analytic model is told the
    same (for GQA in fp32 it picks the math kernel itself; otherwise the patch is what a GPU without
    FlashAttention runs). Multi-query Falcon (k/v broadcast without enable_gqa) is checked term by term in
    test_sdpa_math.py."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = CONFIGS[family]
    with sdpa_kernel(SDPBackend.MATH):
        measured = measured_saved_bytes(cfg, getattr(torch, dtype), amp=False, batch=batch)
    with mock.patch.object(act, "sdpa_kernel", return_value=act.MATH):
        analytic = analytic_saved_bytes(cfg, precision, batch=batch)
    assert analytic + cpu_artefacts(cfg, precision, batch, cpu_math_kernel=True) == measured


@pytest.mark.parametrize(
    ("family", "term"), [("llama", "mlp.swiglu"), ("gpt2", "mlp.gelu_python"), ("opt", "mlp.relu")]
)
def test_the_mlp_activation_terms_are_the_tensors_autograd_saves(family: str, term: str) -> None:
    """The stream allocates a term's ``tensors()`` one by one (trainfit.analytic.events), so they must be the
    storages autograd keeps, not their sum: SwiGLU keeps four intermediate-wide tensors (gate, act, up, product),
    GPT-2's tanh GELU five, ReLU one. Counted from the first layer's MLP alone (its saved storages that are
    intermediate-wide), fp32."""
    cfg = CONFIGS[family]
    spec = spec_from_config(cfg, name="t", source="test")
    st = Strategy(precision="fp32", micro_batch=B, seq_len=S, attention=_attention(cfg))  # type: ignore[arg-type]
    (analytic,) = [x for x in layer_terms(spec, st) if x.name == term]
    hf = transformers.AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    model = transformers.AutoModelForCausalLM.from_config(hf).float().train()
    base = model.base_model
    layer = {"llama": lambda: base.layers[0], "gpt2": lambda: base.h[0], "opt": lambda: base.decoder.layers[0]}[
        family
    ]()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st_ = t.untyped_storage()
        if st_.data_ptr() not in params:
            seen[st_.data_ptr()] = st_.nbytes()
        return t

    width = 4 * B * S * spec.intermediate_size
    x = torch.randn(B, S, spec.hidden_size, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if family == "opt":  # OPT's MLP is fc1 → relu → fc2 inside the decoder layer
            layer.fc2(layer.activation_fn(layer.fc1(x)))
        else:
            layer.mlp(x)
    assert sorted(n for n in seen.values() if n == width) == sorted(analytic.tensors())

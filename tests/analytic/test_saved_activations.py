"""The analytic saved-activation model against what autograd really saves, tensor storage by storage.

A ``saved_tensors_hooks`` pack hook sees every tensor autograd keeps for backward during a real
forward of the transformers module on the CPU (tiny random configs, no download). Storages are
de-duplicated; parameters and autocast's weight casts (``autocast_copies``, a separate component)
are excluded. fp32 and pure-bf16 run the same kernels' saving logic on CPU and CUDA except for the
attention kernel; autocast is compared only for blocks whose ops have the same CPU and CUDA policy.
"""

from __future__ import annotations

import pytest

from trainfit.analytic.activations import layer_terms, model_terms
from trainfit.arch.config import spec_from_config
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


def measured_saved_bytes(cfg: dict, dtype: torch.dtype, amp: bool) -> int:
    hf = transformers.AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    hf._attn_implementation = "sdpa"
    auto = transformers.AutoModelForMaskedLM if cfg["model_type"] == "bert" else transformers.AutoModelForCausalLM
    torch.manual_seed(0)
    model = auto.from_config(hf).to(dtype).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        weight_cast = type(t.grad_fn).__name__ == "TBackward0" or (t.grad_fn is None and t.is_leaf and t.requires_grad)
        if st.data_ptr() not in params and not weight_cast:
            seen[st.data_ptr()] = st.nbytes()
        return t

    ids = torch.randint(0, hf.vocab_size, (B, S))
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp),
    ):
        model(input_ids=ids)  # no labels: the loss/logits part is modelled separately
    return sum(seen.values())


def analytic_saved_bytes(cfg: dict, precision: str) -> int:
    spec = spec_from_config(cfg, name="t", source="test")
    st = Strategy(precision=precision, micro_batch=B, seq_len=S)
    per_layer = sum(t.bytes for t in layer_terms(spec, st))
    return spec.num_layers * per_layer + sum(t.bytes for t in model_terms(spec, st))


#: Families whose every saved tensor the analytic model accounts for, byte for byte.
EXACT = ("llama", "mistral", "qwen2", "qwen3")
#: Families still approximated (LayerNorm/GeLU blocks, BERT's MLM head): held to 10% until refined.
#: The gap per family is listed in docs/accuracy.md.
APPROX_TOLERANCE = 0.10


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize(("precision", "dtype"), [("fp32", "float32"), ("pure-bf16", "bfloat16")])
def test_saved_activations_match_autograd(family: str, precision: str, dtype: str) -> None:
    cfg = CONFIGS[family]
    measured = measured_saved_bytes(cfg, getattr(torch, dtype), amp=False)
    analytic = analytic_saved_bytes(cfg, precision)
    if family in EXACT:
        assert analytic == measured
    else:
        assert abs(analytic - measured) <= APPROX_TOLERANCE * measured, (analytic, measured)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_saved_activations_match_autograd_under_autocast(family: str) -> None:
    """RMSNorm blocks: every op they run has the same autocast policy on CPU and CUDA."""
    cfg = CONFIGS[family]
    assert analytic_saved_bytes(cfg, "amp-bf16") == measured_saved_bytes(cfg, torch.float32, True)

"""One per-tensor rule for model states: the trainable mask and per-tensor formats (frozen, quantised)."""

from __future__ import annotations

from trainfit.analytic.states import model_states, param_states
from trainfit.arch import load_model
from trainfit.cuda_facts import allocator_bytes, quantized_weight_tensors
from trainfit.strategy import Adapter, BaseWeights, Strategy


def test_full_fine_tuning_trains_every_tensor() -> None:
    spec = load_model("llama-3.2-1b")
    st = model_states(spec, Strategy())
    assert st.trainable_params == st.params
    assert all(x.trainable for x in param_states(spec, Strategy()))


def test_a_frozen_base_has_no_gradients_master_or_optimizer_states() -> None:
    spec = load_model("llama-3.2-1b")
    s = Strategy(precision="master-bf16", adapter=Adapter(rank=8))
    st = model_states(spec, s)
    assert all(not x.trainable for x in param_states(spec, s) if not x.adapter)
    # Only the fp32 LoRA pairs train: per layer r·(d_in + d_out) over q, k, v, o (2048→2048, 2048→512 twice,
    # 2048→2048) and gate, up, down (2048↔8192), 16 layers; all tensor sizes are multiples of 512 bytes.
    per_layer = 8 * (2 * 4096 + 2 * 2560 + 3 * 10240)
    assert st.trainable_params == 16 * per_layer
    # fp32 adapters: fp32 grads, no master copy, fp32 AdamW states (+ the fused kernel's step per tensor).
    assert st.grads_bytes == 4 * 16 * per_layer and st.master_bytes == 0
    assert st.optimizer_bytes == 8 * 16 * per_layer + 16 * 14 * 512
    assert st.step_temp_bytes == 0  # no fp32 master: no fp32 grad copies


def test_nf4_base_packs_layer_linears_only() -> None:
    spec = load_model("llama-3.2-1b")
    s = Strategy(precision="pure-bf16", adapter=Adapter(), base_weights=BaseWeights(quantization="nf4"))
    states = param_states(spec, s)
    packed = [x for x in states if x.tensor.name.endswith("q_proj.weight")]
    (q,) = packed
    n = q.tensor.numel
    assert q.weight_bytes == sum(allocator_bytes(b) for b in quantized_weight_tensors(n, q.tensor.shape[0], "nf4"))
    assert not q.autocast_copy
    # The embedding stays 16-bit (bitsandbytes quantises nn.Linear layers, not the embedding or the head).
    (emb,) = [x for x in states if x.tensor.name.startswith("embed")]
    assert emb.weight_bytes == allocator_bytes(emb.tensor.numel * 2)

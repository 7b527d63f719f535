"""Tensor-parallel ``generate`` traced against the closed forms: rank 0 of transformers' own plan
(``base_model_tp_plan`` through ``apply_tensor_parallelism``) on the fake process group, each phase within 2% and
the rank's weights and cache exact. The trace runs transformers' plan classes and cache code; the analytic
model is the vLLM/Megatron-style split written in closed form — two independent computations."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.cli._cli_helper import run_cli
from trainfit.analytic.inference import kv_cache_bytes, phase_estimates, weight_bytes
from trainfit.arch import load_model
from trainfit.arch.config import spec_from_config
from trainfit.arch.spec import ModelSpec
from trainfit.errors import TraceError
from trainfit.result import InferencePhase
from trainfit.strategy.inference import InferenceSetup

from .conftest import assert_generate_agrees

pytest.importorskip("torch")
pytest.importorskip("transformers")

from trainfit.trace.generate import GenerateTrace, trace_generate

FIXTURES = Path(__file__).parents[1] / "fixtures" / "configs"


def _agrees(name: str, spec: ModelSpec, setup: InferenceSetup) -> GenerateTrace:
    """Each phase of the TP trace within 2% of the closed forms, the rank's weights and cache to the byte."""
    traced: GenerateTrace = assert_generate_agrees(name, spec, setup)
    return traced


def _config(**kw: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }
    cfg.update(kw)
    return cfg


def _spec(**kw: Any) -> ModelSpec:
    cfg = _config(**kw)
    return spec_from_config(cfg, name=f"tiny-{cfg['model_type']}", source="explicit")


def _phases_agree(doc: dict[str, Any], analytic: dict[str, Any]) -> None:
    """Two ``infer --json`` documents (trace, analytic): each phase within 2% of the trace."""
    for ph in ("prefill", "decode"):
        t, a = doc["phases"][ph]["total_bytes"], analytic["phases"][ph]["total_bytes"]
        assert abs(a - t) <= 0.02 * t, ph


CASES = [
    ("gqa-tp2", _spec(), InferenceSetup(batch=2, prompt=128, new_tokens=6, tp=2)),
    ("gqa-tp4-static", _spec(), InferenceSetup(batch=2, prompt=128, new_tokens=6, tp=4, cache="static")),
    (
        "mha-fp16-tp2",
        _spec(num_key_value_heads=8),
        InferenceSetup(batch=2, prompt=64, new_tokens=4, dtype="fp16", tp=2),
    ),
    # intermediate / tp < hidden: the replicated post-attention RMSNorm's fp32 transients outgrow the split MLP
    ("narrow-mlp-tp4", _spec(intermediate_size=512), InferenceSetup(batch=2, prompt=128, new_tokens=4, tp=4)),
    # Qwen2: q/k/v biases sharded with their weights
    ("qwen2-bias-tp2", _spec(model_type="qwen2"), InferenceSetup(batch=2, prompt=64, new_tokens=4, tp=2)),
    ("eager-tp2", _spec(), InferenceSetup(batch=1, prompt=96, new_tokens=4, tp=2, attention="eager")),
    (
        "tied-fp32-tp2",
        _spec(tie_word_embeddings=True),
        InferenceSetup(batch=2, prompt=64, new_tokens=4, dtype="fp32", tp=2),
    ),
]


@pytest.mark.parametrize(("name", "spec", "setup"), CASES, ids=[c[0] for c in CASES])
def test_tp_trace_within_2_percent_and_exact_rank_states(name: str, spec: ModelSpec, setup: InferenceSetup) -> None:
    traced = _agrees(name, spec, setup)
    assert any("rank 0 of TP" in n for n in traced.notes)


def test_the_rank_holds_a_shard_not_the_model() -> None:
    """The TP trace's weights and cache are smaller than one GPU's by about the degree (norms replicated)."""
    spec = _spec()
    one = trace_generate(spec, InferenceSetup(batch=2, prompt=64, new_tokens=3))
    four = trace_generate(spec, InferenceSetup(batch=2, prompt=64, new_tokens=3, tp=4))
    assert 3.9 < one.weights_bytes / four.weights_bytes <= 4.0
    assert 3.8 < one.kv_cache_bytes / four.kv_cache_bytes <= 4.0  # each tensor rounded to 512 bytes


def test_narrow_mlp_peaks_at_the_replicated_norm() -> None:
    """The mechanism the TP trace showed: with intermediate / tp < hidden the prefill peak is the
    post-attention RMSNorm (fp32 upcast of the residual sum), which tensor parallelism does not split."""
    spec, setup = CASES[3][1], CASES[3][2]
    closed = phase_estimates(spec, setup)
    assert closed[InferencePhase.PREFILL].moment == "prefill norm"
    assert phase_estimates(spec, InferenceSetup(batch=2, prompt=128, new_tokens=4))[InferencePhase.PREFILL].moment != (
        "prefill norm"
    )


def test_tp_moe_experts() -> None:
    """Qwen3-MoE's plan: experts ``packed_colwise``/``rowwise`` under ``moe_tp_experts``; the router (no rule)
    replicated on every rank, as the closed forms hold it."""
    spec = spec_from_config(
        {
            "model_type": "qwen3_moe",
            "hidden_size": 128,
            "intermediate_size": 256,
            "moe_intermediate_size": 64,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "vocab_size": 1000,
            "max_position_embeddings": 512,
            "tie_word_embeddings": False,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
        name="tiny-qwen3-moe",
        source="explicit",
    )
    _experts_agree_or_are_named("tiny-qwen3-moe", spec, InferenceSetup(batch=2, prompt=96, new_tokens=4, tp=2))


def _tp_plan_shards_experts(model_type: str) -> bool:
    """Whether the installed transformers' TP plan for ``model_type`` names the fused experts (up to 5.24:
    ``moe_tp_experts`` with ``packed_colwise``/``rowwise`` parameters; 5.25 moved them to ``base_model_ep_plan``,
    used only with ``ep_size``)."""
    from transformers import AutoConfig

    plan = AutoConfig.for_model(model_type).base_model_tp_plan or {}
    return any(".experts" in key for key in plan)


def _experts_agree_or_are_named(name: str, spec: ModelSpec, setup: InferenceSetup) -> None:
    """Where transformers' TP plan shards the fused experts, each phase of the trace within 2% of the closed forms
    (which split them, as vLLM does); where it does not, the trace says they are replicated and holds more."""
    if _tp_plan_shards_experts(spec.model_type):
        _agrees(name, spec, setup)
        return
    traced = trace_generate(spec, setup)
    assert any("no rule for mlp.experts" in n for n in traced.notes), traced.notes
    closed = phase_estimates(spec, setup)
    assert traced.weights_bytes > weight_bytes(spec, setup)
    assert sum(traced.phases[InferencePhase.PREFILL].values()) > closed[InferencePhase.PREFILL].breakdown.total_bytes


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("tiny-phi3", "gathers the output of gate_up_proj, qkv_proj"),
        ("tiny-qwen2-moe", "mlp.shared_expert.down_proj"),
    ],
)
def test_tp_plans_that_depart_from_a_head_split_are_named(name: str, needle: str) -> None:
    """Where transformers' own plan keeps more on a rank than the closed forms' Megatron/vLLM split — Phi-3
    gathers its fused q/k/v and gate/up outputs (the whole cache on every rank); Qwen2-MoE's dense-MLP rules
    miss its ``shared_expert`` (replicated) — the trace says so and holds more than the analytic rank."""
    spec = load_model(str(FIXTURES / f"{name}.json"))
    setup = InferenceSetup(batch=2, prompt=96, new_tokens=4, tp=2)
    traced = trace_generate(spec, setup)
    assert any(needle in n for n in traced.notes), traced.notes
    closed = phase_estimates(spec, setup)
    assert traced.weights_bytes + traced.kv_cache_bytes > weight_bytes(spec, setup) + kv_cache_bytes(spec, setup)
    assert sum(traced.phases[InferencePhase.PREFILL].values()) > closed[InferencePhase.PREFILL].breakdown.total_bytes


@pytest.mark.parametrize(
    ("spec", "setup", "needle"),
    [
        (_spec(num_key_value_heads=2), InferenceSetup(batch=1, prompt=32, new_tokens=2, tp=4), "k/v heads"),
        (_spec(), InferenceSetup(batch=1, prompt=32, new_tokens=2, tp=2, dtype="nf4"), "quantisation state"),
        (
            spec_from_config(
                {"model_type": "gpt2", "n_embd": 128, "n_layer": 2, "n_head": 4, "vocab_size": 500, "n_positions": 256},
                name="tiny-gpt2",
                source="explicit",
            ),
            InferenceSetup(batch=1, prompt=32, new_tokens=2, tp=2),
            "tp_plan",
        ),
    ],
    ids=["kv-heads", "bnb", "no-plan"],
)
def test_tp_trace_refusals(spec: ModelSpec, setup: InferenceSetup, needle: str) -> None:
    with pytest.raises(TraceError, match=needle):
        trace_generate(spec, setup)


def test_cli_issue_command(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 12: ``trainfit infer qwen2.5-72b --gpus 4 --tp 4 --method trace`` runs (short request)."""
    args = ("infer", "qwen2.5-72b", "--gpus", "4", "--tp", "4", "--prompt", "256", "--new-tokens", "3", "--json")
    res = run_cli(capsys, *args, "--method", "trace")
    assert res.code == 0, res.err
    _phases_agree(json.loads(res.out), json.loads(run_cli(capsys, *args).out))


# -- quantised weights under tensor parallelism (issue 12) ------------------------------------------------------

_MOE_MID = {
    "model_type": "qwen3_moe",
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 384,
    "num_experts": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 1000,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}

FP8_CASES = [
    ("fp8-gqa-tp2", _spec(), InferenceSetup(batch=2, prompt=128, new_tokens=6, tp=2, dtype="fp8")),
    (
        "fp8-narrow-mlp-tp4",
        _spec(intermediate_size=512),
        InferenceSetup(batch=2, prompt=128, new_tokens=4, tp=4, dtype="fp8"),
    ),
    # fused experts: gate_up's [E, 6, 4] block scales ``_StridedShard(sf=2)`` -> [E, 4, 4] on rank 0, down's
    # [E, 4, 3] ``Shard(-1)`` -> [E, 4, 2]: an even split of the scales would be 3 KiB short
    (
        "fp8-moe-experts-tp2",
        spec_from_config(_MOE_MID, name="tiny-qwen3-moe-mid", source="explicit"),
        InferenceSetup(batch=2, prompt=96, new_tokens=4, tp=2, dtype="fp8"),
    ),
]


@pytest.mark.parametrize(("name", "spec", "setup"), FP8_CASES, ids=[c[0] for c in FP8_CASES])
def test_fp8_tp_trace_within_2_percent_and_exact_rank_states(name: str, spec: ModelSpec, setup: InferenceSetup) -> None:
    """transformers' fine-grained fp8 under its own TP plan: each rank's fp8 weight and block scales (sharded
    with it, the quantizer's ``update_parallel_plan`` applied) to the byte, each phase within 2%."""
    if spec.moe is not None and not _tp_plan_shards_experts(spec.model_type):
        _experts_agree_or_are_named(name, spec, setup)
        return
    traced = _agrees(name, spec, setup)
    assert any("rank 0 of TP" in n for n in traced.notes)


def test_fp8_tp_rank_holds_a_quarter_of_the_fp8_linears() -> None:
    """The fp8 rank is the one-GPU fp8 model split: weights about 1/tp (norms, scales rounding replicated)."""
    spec = _spec(hidden_size=512, intermediate_size=1536, num_key_value_heads=8)
    one = trace_generate(spec, InferenceSetup(batch=1, prompt=32, new_tokens=2, dtype="fp8"))
    four = trace_generate(spec, InferenceSetup(batch=1, prompt=32, new_tokens=2, dtype="fp8", tp=4))
    assert 3.8 < one.weights_bytes / four.weights_bytes <= 4.0


def _vllm_nf4_linear_bytes(shape: tuple[int, int], tp: int, row_parallel: bool) -> tuple[int, int]:
    """(nf4 bytes at rest, bf16 bytes) of rank 0's shard of one linear, from real bitsandbytes: the shard
    vLLM's loader slices (columns for a row-parallel linear, rows otherwise), ``quantize_4bit`` with
    ``compress_statistics=True``, then the nested absmax dequantised to fp32 as ``_dequantize_dq`` does."""
    import torch
    from bitsandbytes.functional import dequantize_blockwise, quantize_4bit

    from trainfit.cuda_facts import allocator_bytes

    out, inp = shape
    w = torch.randn((out, inp // tp) if row_parallel else (out // tp, inp), dtype=torch.bfloat16)
    packed, state = quantize_4bit(w, compress_statistics=True, quant_type="nf4")
    absmax = dequantize_blockwise(state.absmax, state.state2) + state.offset
    held = [packed, absmax.float(), state.code]
    return sum(allocator_bytes(t.numel() * t.element_size()) for t in held), allocator_bytes(w.numel() * 2)


def test_vllm_nf4_tp_weights_match_real_bitsandbytes_shards() -> None:
    """``--dtype nf4 --tp`` is vLLM's in-flight bitsandbytes: the closed forms' rank weights exceed the bf16
    rank's by exactly what real bitsandbytes makes of each linear's shard, minus its bf16 bytes."""
    pytest.importorskip("bitsandbytes")
    from trainfit.arch.params import inventory

    spec, tp = _spec(hidden_size=512, intermediate_size=1024, num_key_value_heads=8), 4
    nf4 = InferenceSetup(batch=1, prompt=32, new_tokens=2, tp=tp, dtype="nf4")
    bf16 = InferenceSetup(batch=1, prompt=32, new_tokens=2, tp=tp)
    extra = 0
    for group in inventory(spec).layers:
        for t in group.tensors:
            if t.matmul and len(t.shape) == 2:
                row = t.name in ("attn.o_proj.weight", "mlp.down_proj.weight")
                q, b = _vllm_nf4_linear_bytes((t.shape[0], t.shape[1]), tp, row)
                extra += group.count * (q - b)
    assert weight_bytes(spec, nf4) - weight_bytes(spec, bf16) == extra


def test_vllm_nf4_tp_ignores_double_quant() -> None:
    """vLLM dequantises the nested absmax at load: --no-double-quant changes nothing under --tp."""
    spec = _spec()
    a = InferenceSetup(batch=1, prompt=32, new_tokens=2, tp=2, dtype="nf4")
    b = InferenceSetup(batch=1, prompt=32, new_tokens=2, tp=2, dtype="nf4", double_quant=False)
    assert weight_bytes(spec, a) == weight_bytes(spec, b)
    assert phase_estimates(spec, a)[InferencePhase.PREFILL].breakdown.total_bytes == (
        phase_estimates(spec, b)[InferencePhase.PREFILL].breakdown.total_bytes
    )


@pytest.mark.parametrize("method", ["analytic", "trace"])
@pytest.mark.parametrize("dtype", ["int8", "fp4"])
def test_cli_refuses_bitsandbytes_tp_no_engine_runs(
    capsys: pytest.CaptureFixture[str], dtype: str, method: str
) -> None:
    """int8 and fp4 under tensor parallelism: transformers loses the quantisation state and vLLM shards only
    the nf4 it quantises itself - one line, exit 2, in both methods."""
    args = ("infer", "llama-3.1-8b", "--tp", "2", "--dtype", dtype, "--prompt", "64", "--new-tokens", "2")
    res = run_cli(capsys, *args, "--method", method)
    assert res.code == 2
    assert "no engine trainfit models runs it" in res.err and len(res.err.strip().splitlines()) == 1
    assert "Traceback" not in res.err


def test_cli_nf4_tp_trace_refused_and_analytic_names_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    args = ("infer", "llama-3.1-8b", "--tp", "2", "--dtype", "nf4", "--prompt", "64", "--new-tokens", "2")
    res = run_cli(capsys, *args, "--method", "trace")
    assert res.code == 2 and "quantisation state" in res.err and len(res.err.strip().splitlines()) == 1
    res = run_cli(capsys, *args, "--json")
    assert res.code == 0, res.err
    doc = json.loads(res.out)
    assert any("the weights are vLLM's" in n for n in doc["notes"]), doc["notes"]
    res = run_cli(capsys, *args, "--compute-dtype", "fp32")
    assert res.code == 2 and "computes in the model's dtype" in res.err


def test_cli_fp8_tp_trace_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``trainfit infer ... --dtype fp8 --tp 2 --method trace --json`` runs and agrees with the analytic."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(_config()))
    args = ("infer", str(cfg), "--tp", "2", "--dtype", "fp8", "--prompt", "64", "--new-tokens", "3", "--json")
    res = run_cli(capsys, *args, "--method", "trace")
    assert res.code == 0, res.err
    doc, analytic = json.loads(res.out), json.loads(run_cli(capsys, *args).out)
    assert doc["weights_bytes"] == analytic["weights_bytes"]
    _phases_agree(doc, analytic)

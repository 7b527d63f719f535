"""Tiny model configs (built from dicts, never downloaded) shared by the trace tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from trainfit.arch.config import spec_from_config
from trainfit.arch.spec import ModelSpec
from trainfit.strategy import Strategy

pytest.importorskip("torch")
pytest.importorskip("transformers")

TINY: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
        "max_position_embeddings": 512, "tie_word_embeddings": False,
    },
    "qwen2": {
        "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 512, "tie_word_embeddings": True,
    },
    "gemma2": {
        "model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
        "max_position_embeddings": 512, "sliding_window": 16,
    },
    "gpt2": {
        "model_type": "gpt2", "n_embd": 64, "n_layer": 4, "n_head": 4, "vocab_size": 256,
        "n_positions": 512,
    },
    "bert": {
        "model_type": "bert", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 512,
    },
    # Every layer slides; with seq >= sliding_window transformers builds a real mask for SDPA.
    "mistral-window": {
        "model_type": "mistral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
        "max_position_embeddings": 512, "sliding_window": 160,
    },
    # Multi-query, a mask always built: before transformers 5.25 one k/v head handed to SDPA without enable_gqa
    # (math kernel); from 5.25 repeat_kv's stride-0 views of it (memory-efficient kernel).
    "falcon": {
        "model_type": "falcon", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "vocab_size": 256, "new_decoder_architecture": False, "multi_query": True, "parallel_attn": True,
        "bias": False, "max_position_embeddings": 512,
    },
    # New architecture: k/v expanded to every head before SDPA (memory-efficient kernel with a bias).
    "falcon-new": {
        "model_type": "falcon", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_kv_heads": 2, "vocab_size": 256, "new_decoder_architecture": True, "bias": False,
        "max_position_embeddings": 512,
    },
    "mixtral": {
        "model_type": "mixtral", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "num_local_experts": 4,
        "num_experts_per_tok": 2, "max_position_embeddings": 512,
    },
    "deepseek_v2": {
        "model_type": "deepseek_v2", "hidden_size": 64, "intermediate_size": 160, "moe_intermediate_size": 32,
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None,
        "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "vocab_size": 256, "max_position_embeddings": 512, "tie_word_embeddings": False, "n_group": 1,
        "topk_group": 1, "topk_method": "greedy", "moe_layer_freq": 1,
    },
}  # fmt: skip


R = TypeVar("R")

_REPORTS: dict[tuple[str, str, str, str], Any] = {}


def traced_once(fn: Callable[..., R], spec: ModelSpec, strategy: Strategy, **kwargs: Any) -> R:
    """``fn(spec, strategy, **kwargs)``, computed once per test process for equal arguments (keyed by ``repr``, every
    field). Only for the entry points whose result is a pure function of those arguments and a frozen
    ``MemoryReport`` (``trace_spec``, ``trace_distributed``, ``trace_deepspeed`` with its ``rank``, ``estimate``) or
    a frozen ``TraceReserved`` (``trace.events.reserved_from_trace``), and never under a test's monkeypatch: several
    tests check different things of the same traced cell, and each trace is seconds. A failure is not kept: the next
    caller traces again."""
    key = (f"{fn.__module__}.{fn.__qualname__}", repr(spec), repr(strategy), repr(sorted(kwargs.items())))
    if key not in _REPORTS:
        _REPORTS[key] = fn(spec, strategy, **kwargs)
    return _REPORTS[key]  # type: ignore[no-any-return]


def tiny_spec(family: str, **overrides: Any) -> ModelSpec:
    cfg = {**TINY[family], **overrides}
    return spec_from_config(cfg, name=f"tiny-{family}", source="test")


def assert_phases_agree(closed: Any, traced: Any, tolerance: float, *, step_slack: int = 0) -> None:
    """Each phase of the analytic report ``closed`` within ``tolerance`` of the trace's; the optimizer step may
    also differ by ``step_slack`` bytes (grad clipping's per-tensor norms, which neither model counts)."""
    from trainfit.result import Phase

    for a, t in zip(closed.phases, traced.phases, strict=True):
        slack = step_slack if a.phase is Phase.OPTIMIZER_STEP else 0
        assert abs(a.total_bytes - t.total_bytes) <= tolerance * t.total_bytes + slack, (
            a.phase,
            a.total_bytes,
            t.total_bytes,
        )


def assert_generate_agrees(name: str, spec: ModelSpec, setup: Any) -> Any:
    """``trainfit infer``'s closed forms against the traced ``generate``: each phase within 2%, the (rank's)
    weights and cache to the byte, and the decode's logits — ``generate``'s bookkeeping between passes, which
    the trace counts with them — to the byte; returns the trace."""
    from trainfit.analytic.inference import kv_cache_bytes, phase_estimates, weight_bytes
    from trainfit.result import InferencePhase
    from trainfit.trace.generate import trace_generate

    traced = trace_generate(spec, setup)
    closed = phase_estimates(spec, setup)
    for ph in InferencePhase:
        t = sum(traced.phases[ph].values())
        a = closed[ph].breakdown.total_bytes
        assert abs(a - t) <= 0.02 * t, f"{name} {ph.value}: analytic {a} vs trace {t}"
    assert traced.weights_bytes == weight_bytes(spec, setup)
    assert traced.kv_cache_bytes == kv_cache_bytes(spec, setup)
    assert_decode_logits_exact(name, traced, closed)
    return traced


def assert_decode_logits_exact(name: str, traced: Any, closed: Any) -> None:
    """The decode peak's logits component, trace against closed form, to the byte (when both have a decode)."""
    from trainfit.result import Component, InferencePhase

    ph = InferencePhase.DECODE
    if ph in traced.phases and ph in closed:
        t = traced.phases[ph].get(Component.LOGITS_LOSS, 0)
        a = closed[ph].breakdown.components.get(Component.LOGITS_LOSS, 0)
        assert a == t, f"{name} decode logits: analytic {a} vs trace {t} ({closed[ph].moment})"

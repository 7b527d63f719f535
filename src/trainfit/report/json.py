"""Versioned JSON for scripts. ``schema_version`` changes only when a key changes meaning or goes.

Every phase carries every component (zeros included); ``max_micro_batch`` is null when the method does not
search it (trace, measure) and ``max_micro_batch_capped`` says when the search stopped at its cap."""

from __future__ import annotations

from typing import Any

from trainfit.arch.spec import ModelSpec
from trainfit.result import SCHEMA_VERSION, Component, MemoryReport, PhaseBreakdown
from trainfit.strategy import Strategy


def strategy_json(strategy: Strategy) -> dict[str, Any]:
    out = _strategy_core(strategy)
    a, base = strategy.adapter, strategy.base_weights
    if a is not None or not base.is_default:  # fine-tuning keys only when set: full fine-tuning JSON unchanged
        out["finetune"] = {
            "adapter": None
            if a is None
            else {
                "kind": a.kind.value,
                "rank": a.rank,
                "alpha": a.alpha,
                "targets": list(a.targets),
                "dropout": a.dropout,
                "dtype": a.dtype.value,
            },
            "base_dtype": base.dtype.value if base.dtype is not None else None,
            "base_quantization": base.quantization.value,
            "double_quant": base.double_quant,
            "kbit_prepared": base.kbit_prepared,
            "frozen": list(base.frozen),
        }
    return out


def _strategy_core(strategy: Strategy) -> dict[str, Any]:
    return {
        "precision": strategy.precision.value,
        "optimizer": strategy.optimizer.value,
        "checkpointing": strategy.checkpointing.value,
        "attention": strategy.attention.value,
        "optimizer_impl": strategy.optimizer_impl.value,
        "micro_batch": strategy.micro_batch,
        "seq_len": strategy.seq_len,
        "grad_accum": strategy.grad_accum,
        "effective_batch": strategy.effective_batch,
    }


def _components(phase: PhaseBreakdown) -> dict[str, int]:
    """Every component, zeros included, whatever the method filled in."""
    return {c.value: phase.get(c) for c in Component}


def report_json(
    report: MemoryReport, spec: ModelSpec | None = None, strategy: Strategy | None = None
) -> dict[str, Any]:
    """The report as one JSON object. ``spec``/``strategy`` default to the inputs the report echoes."""
    spec = spec or report.model
    strategy = strategy or report.strategy
    if spec is None or strategy is None:
        raise ValueError("report_json needs a report from trainfit.estimate (or the model and strategy)")
    peak = report.peak
    out: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "method": report.method.value,
        "model": {
            "name": spec.name,
            "source": spec.source,
            "model_type": spec.model_type,
            "architecture": spec.architecture,
        },
        "params": report.params,
        "trainable_params": report.trainable_params,
        "strategy": strategy_json(strategy),
        "peak_bytes": report.peak_bytes,
        "phase": report.peak_phase.value,
        "components": _components(peak),
        "phases": {
            p.phase.value: {
                "total_bytes": p.total_bytes,
                "components": _components(p),
            }
            for p in report.phases
        },
        "overhead": {
            "cuda_context_bytes": report.overhead.cuda_context_bytes,
            "allocator_reserve_bytes": report.overhead.allocator_reserve_bytes,
        },
        "reserved_estimate_bytes": report.reserved_estimate_bytes,
        "nvidia_smi_estimate_bytes": report.nvidia_smi_estimate_bytes,
        "bytes_per_param": report.bytes_per_param.as_dict(),
        "terms": [{"name": t.name, "bytes": t.bytes, "formula": t.formula, "source": t.source} for t in report.terms],
        "notes": list(report.notes),
        "warnings": list(report.warnings),
        "extra": dict(report.extra),
    }
    if report.low_bytes is not None:  # the rule of thumb's range of the nvidia-smi total (overhead included)
        out["low_bytes"] = report.low_bytes
        out["high_bytes"] = report.high_bytes
    if report.fit is not None:
        f = report.fit
        out |= {
            "gpu": f.gpu_id,
            "fits": f.fits,
            "headroom_fraction": f.headroom_fraction,
            "headroom_bytes": f.gpu_memory_bytes - f.usable_bytes,
            "usable_bytes": f.usable_bytes,
            "required_bytes": f.required_bytes,
            "free_bytes": f.free_bytes,
            "max_micro_batch": f.max_micro_batch,
            "max_micro_batch_capped": f.max_micro_batch_capped,
            "suggestions": [
                {"kind": x.kind.value, "reason": x.reason, "flags": list(x.flags), "states_bytes": x.states_bytes}
                for x in f.suggestions
            ],
        }
    return out

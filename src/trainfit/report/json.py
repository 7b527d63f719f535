"""Versioned JSON for scripts. ``schema_version`` changes only when a key changes meaning or goes.

Every phase carries every component (zeros included); ``max_micro_batch`` is null when the method does not
search it (trace, measure) and ``max_micro_batch_capped`` says when the search stopped at its cap."""

from __future__ import annotations

from typing import Any

from trainfit.arch.spec import ModelSpec
from trainfit.history import ProcessHistory
from trainfit.result import SCHEMA_VERSION, Component, MemoryReport, PhaseBreakdown, RankMemory
from trainfit.strategy import Strategy


def model_row(spec: ModelSpec) -> dict[str, Any]:
    """One model as ``trainfit models --json`` (and the web page's catalog) lists it."""
    from trainfit.arch import count_params

    return {
        "id": spec.name,
        "model_type": spec.model_type,
        "architecture": spec.architecture,
        "params": count_params(spec),
        "hidden_size": spec.hidden_size,
        "num_layers": spec.num_layers,
        "num_heads": spec.num_heads,
        "num_kv_heads": spec.num_kv_heads,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "num_experts": spec.moe.num_experts if spec.moe else None,
    }


def strategy_json(strategy: Strategy) -> dict[str, Any]:
    out = _strategy_core(strategy)
    if strategy.is_distributed:
        out |= parallel_json(strategy)
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
    sv = strategy.savers
    if sv.any:  # savers' keys only when set: JSON without them unchanged
        out["savers"] = {
            "loss": sv.loss.value,
            "loss_chunks": sv.loss_chunks,
            "optimizer_in_backward": sv.optimizer_in_backward,
            "activation_offload": sv.activation_offload,
            "paged_optimizer": sv.paged_optimizer,
        }
    return out


def history_json(history: ProcessHistory) -> dict[str, Any]:
    """The process the run starts in (``trainfit.history``): how its model was built, the warm-up, earlier runs."""
    return {
        "build": history.build.value,
        "warm_up": history.warm_up,
        "after": [
            {"model": r.model.name, "build": r.build.value, "strategy": strategy_json(r.strategy)}
            for r in history.after
        ],
    }


def _strategy_core(strategy: Strategy) -> dict[str, Any]:
    core = {
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
    if strategy.float8.value != "none":  # present only when asked: other JSON is unchanged
        core["float8"] = strategy.float8.value
    return core


def parallel_json(strategy: Strategy) -> dict[str, Any]:
    """The many-GPU settings (present only for a multi-GPU, sharded or offloaded strategy: one-GPU JSON is
    unchanged)."""
    return {
        "gpus": strategy.world_size,
        "global_batch": strategy.global_batch,
        "data_parallel": strategy.parallelism.data,
        "tensor_parallel": strategy.parallelism.tensor,
        "pipeline_parallel": strategy.parallelism.pipeline,
        "sequence_parallel": strategy.parallelism.sequence_parallel,
        "pp_schedule": strategy.parallelism.pipeline_schedule.value,
        "virtual_stages": strategy.parallelism.virtual_stages,
        "microbatches": strategy.parallelism.microbatches,
        "sharding": strategy.sharding.value,
        "engine": strategy.engine.engine.value,
        "reshard_after_forward": strategy.engine.reshard_after_forward,
        "sync_each_batch": strategy.engine.sync_each_batch,  # FSDP2 with accumulation: reduce every micro-step
        "sharded_init": strategy.engine.sharded_init,  # FSDP2: built on meta, no whole weights at wrap time
        "fsdp_wrap": strategy.engine.fsdp_wrap.value,  # FSDP2's units: auto | root | units (as asked)
        "offload": strategy.offload.flag,
    }


def _phase_json(p: PhaseBreakdown) -> dict[str, Any]:
    out: dict[str, Any] = {"total_bytes": p.total_bytes, "components": _components(p)}
    if p.host_components:
        out["host_bytes"] = p.host_bytes
        out["host_components"] = {c.value: n for c, n in p.host_components.items()}
    return out


def ranks_json(report: MemoryReport) -> list[dict[str, Any]]:
    """Each distinct rank (pipeline stage; one entry for all ranks when they hold the same): its rank
    indices, peak, peak phase and phases; a pipeline stage's in-flight micro-batches (``pipeline``); with a GPU,
    the bytes that must fit and whether they do."""
    out = []
    fit = report.fit
    ranks = report.ranks or (RankMemory(ranks=tuple(range(report.world_size)), phases=report.phases),)
    for i, r in enumerate(ranks):
        peak = max(r.phases, key=lambda p: p.total_bytes)
        row: dict[str, Any] = {
            "ranks": list(r.ranks),
            "peak_bytes": r.peak_bytes,
            "phase": peak.phase.value,
            "phases": {p.phase.value: _phase_json(p) for p in r.phases},
        }
        if r.pipeline is not None:  # a pipeline stage: what it holds in flight at its peak
            row["pipeline"] = {
                "stage": r.pipeline.stage,
                "in_flight_chunks": r.pipeline.in_flight_chunks,
                "model_chunks": r.pipeline.model_chunks,
                "in_flight_microbatches": r.pipeline.in_flight_microbatches,
            }
        if fit is not None and report.ranks and i < len(fit.rank_required_bytes):
            row["required_bytes"] = fit.rank_required_bytes[i]
            row["fits"] = fit.rank_required_bytes[i] <= fit.usable_bytes
        elif fit is not None:  # every rank holds the headline
            row["required_bytes"] = fit.required_bytes
            row["fits"] = fit.fits
        out.append(row)
    return out


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
            # a task head only when it is not a language-model head (goldens unchanged)
            **({"head": spec.kind.value} if not spec.kind.has_vocab_logits else {}),
            **({"num_labels": spec.num_labels} if spec.kind.value.endswith("-cls") else {}),
        },
        "params": report.params,
        "trainable_params": report.trainable_params,
        "strategy": strategy_json(strategy),
        "history": history_json(report.history or ProcessHistory()),
        "peak_bytes": report.peak_bytes,
        "phase": report.peak_phase.value,
        "components": _components(peak),
        "phases": {p.phase.value: _phase_json(p) for p in report.phases},
        "overhead": {
            "cuda_context_bytes": report.overhead.cuda_context_bytes,
            "kernel_images_bytes": report.overhead.kernel_images_bytes,
            "nccl_bytes": report.overhead.nccl_bytes,  # the one-rank measurement of the framework, or 0
            # many GPUs only (one-GPU JSON unchanged): where nccl_bytes comes from, what it leaves out
            **({"nccl_basis": report.overhead.nccl_basis} if report.overhead.nccl_basis else {}),
            "outside_allocator_bytes": report.overhead.outside_allocator_bytes,
            "allocator_reserve_bytes": report.overhead.allocator_reserve_bytes,
            "basis": report.overhead.basis,
        },
        "reserved_estimate_bytes": report.reserved_estimate_bytes,
        "torch_version": report.torch_version or None,  # the release whose cuBLAS workspaces are counted
        "cuda_version": report.cuda_version or None,  # the release whose CUDA context is counted
        "nvidia_smi_estimate_bytes": report.nvidia_smi_estimate_bytes,
        "bytes_per_param": report.bytes_per_param.as_dict(),
        "terms": [{"name": t.name, "bytes": t.bytes, "formula": t.formula, "source": t.source} for t in report.terms],
        "notes": list(report.notes),
        "warnings": list(report.warnings),
        "extra": dict(report.extra),
    }
    if strategy.sharding.value in ("fsdp", "hsdp"):  # --fsdp-wrap auto: the wrapping modelled, root | units
        from trainfit.fsdp_units import resolved_fsdp_wrap

        out["strategy"]["fsdp_wrap_modelled"] = resolved_fsdp_wrap(spec, strategy).value
    if report.comparison:  # the article's rule of thumb beside this estimate, term by term, and why they differ
        out["comparison"] = [
            {
                "term": d.term,
                "rule_of_thumb_bytes": d.rule_of_thumb_bytes,
                "analytic_bytes": d.analytic_bytes,
                "why": d.why,
            }
            for d in report.comparison
        ]
    # host memory per node (offloaded states and activations, pinned buffers, paged optimizer states; 0 without)
    out["host_peak_bytes"] = report.host_peak_bytes
    if strategy.is_distributed:  # many GPUs: the worst rank is the headline; each distinct rank
        out["ranks"] = ranks_json(report)
    if report.low_bytes is not None:  # the rule of thumb's range of the nvidia-smi total (overhead included)
        out["low_bytes"] = report.low_bytes
        out["high_bytes"] = report.high_bytes
    if report.fit is not None:
        f = report.fit
        out |= {
            "gpu": f.gpu_id,
            "fits": f.fits,  # without cache flushes (the tier "fits")
            "verdict": f.tier.value,  # fits | fits-with-flushes | does-not-fit
            "cache_flushes": f.cache_flushes,  # fits-with-flushes: the simulated flush-and-retries; else 0
            # the report's stream simulated under the allocator's share of the usable memory (borderline only)
            "capped_run": report.capped.as_dict() if report.capped is not None else None,
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
            # null: it does not fit and the planner was not asked (trace, measure, --no-fixes)
            "fixes": [{"kind": x.kind.value, "reason": x.reason, "flags": list(x.flags)} for x in f.fixes]
            if (f.fits and f.host_fits is not False) or f.fixes_searched
            else None,
        }
        if f.host_memory_bytes is not None:  # --host-memory-gib: the host's verdict beside the GPU's (fits, verdict)
            out |= {
                "host_memory_bytes": f.host_memory_bytes,
                "host_usable_bytes": f.host_usable_bytes,  # × (1 − headroom), as trainfit plan holds a plan to it
                "host_free_bytes": f.host_free_bytes,  # usable − peak: negative when it does not fit ("short by")
                "host_fits": f.host_fits,
            }
    if report.gpu is not None:  # the speed model for exactly this configuration (None: no peak for its dtype)
        out["step_seconds"] = report.speed.step_seconds if report.speed is not None else None
        out["tokens_per_second"] = report.speed.tokens_per_second if report.speed is not None else None
        out["mfu"] = report.speed.mfu if report.speed is not None else None
    return out

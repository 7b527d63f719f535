"""JSON and rich tables for ``trainfit infer``: the answer first (verdict, peak, capacities), then where the
bytes go per phase, then the terms. Formatting only: every number comes from the
:class:`~trainfit.infer.InferenceReport`. GiB everywhere; the rule of thumb's line adds decimal GB.

JSON keys (``schema_version`` is :data:`trainfit.result.SCHEMA_VERSION`): ``peak_bytes``, ``peak_phase``,
``weights_bytes``, ``kv_cache_bytes``, ``kv_bytes_per_token``, ``steady_state_bytes``, ``phases`` (every
component, zeros included, and the worst moment), ``overhead``, ``nvidia_smi_estimate_bytes``,
``rule_of_thumb_bytes``, and with a GPU ``fit`` and ``capacity`` (and ``paged`` for ``--server paged``);
``null`` where not computed.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from trainfit.infer import InferenceReport, Server
from trainfit.result import SCHEMA_VERSION, Component, InferencePhase
from trainfit.units import fmt_count, fmt_gb, fmt_gib, gib

#: Components an inference phase can hold, in display order.
INFER_COMPONENTS: tuple[Component, ...] = (
    Component.WEIGHTS,
    Component.KV_CACHE,
    Component.ACTIVATIONS,
    Component.LOGITS_LOSS,
    Component.WORKSPACES,
)


def infer_json(report: InferenceReport) -> dict[str, Any]:
    s = report.setup
    phases = {
        p.phase.value: {
            "total_bytes": p.total_bytes,
            "components": {c.value: p.get(c) for c in INFER_COMPONENTS},
            "moment": report.moments.get(InferencePhase(p.phase.value), ""),
        }
        for p in report.phases
    }
    out: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "command": "infer",
        "method": report.method.value,
        "model": report.model.name,
        "params": report.params,
        "setup": {
            "batch": s.batch,
            "prompt": s.prompt,
            "new_tokens": s.new_tokens,
            "dtype": s.dtype.value,
            "double_quant": s.double_quant,
            "compute_dtype": s.four_bit_compute.value if s.dtype.value in ("nf4", "fp4") else None,
            "kv_dtype": s.kv_format.value,
            "cache": s.cache.value,
            "block_size": s.block_size,
            "attention": s.attention.value,
            "padded": s.padded,
            "tp": s.tp,
            "gpus": report.gpus,
            "server": report.server.value,
        },
        "peak_bytes": report.peak_bytes,
        "peak_phase": report.peak_phase.value,
        "weights_bytes": report.weights_bytes,
        "kv_cache_bytes": report.kv_cache_bytes,
        "kv_bytes_per_token": report.kv_bytes_per_token,
        "steady_state_bytes": report.steady_state_bytes,
        "phases": phases,
        "overhead": {
            "cuda_context_bytes": report.overhead.cuda_context_bytes,
            "kernel_images_bytes": report.overhead.kernel_images_bytes,
            "outside_allocator_bytes": report.overhead.outside_allocator_bytes,
            "allocator_reserve_bytes": report.overhead.allocator_reserve_bytes,
            "basis": report.overhead.basis,
        },
        "nvidia_smi_estimate_bytes": report.nvidia_smi_estimate_bytes,
        "rule_of_thumb_bytes": report.rule_of_thumb_bytes,
        "gpu": report.gpu.id if report.gpu is not None else None,
        "fit": None,
        "capacity": None,
        "paged": None,
        "terms": [{"name": t.name, "bytes": t.bytes, "formula": t.formula, "source": t.source} for t in report.terms],
        "notes": list(report.notes),
        "warnings": list(report.warnings),
    }
    if report.trace_seconds is not None:
        out["trace"] = {"seconds": report.trace_seconds, "layers_traced": list(report.layers_traced)}
    if report.fit is not None:
        f = report.fit
        out["fit"] = {
            "gpu_id": f.gpu_id,
            "gpu_memory_bytes": f.gpu_memory_bytes,
            "headroom_fraction": f.headroom_fraction,
            "usable_bytes": f.usable_bytes,
            "required_bytes": f.required_bytes,
            "fits": f.fits,
            "free_bytes": f.free_bytes,
        }
    if report.capacity is not None:
        c = report.capacity
        out["capacity"] = {
            "usable_bytes": c.usable_bytes,
            "max_batch": c.max_batch,
            "max_batch_capped": c.max_batch_capped,
            "max_context": c.max_context,
            "max_context_capped": c.max_context_capped,
        }
    if report.paged is not None:
        p = report.paged
        out["paged"] = {
            "gpu_memory_utilization": p.gpu_memory_utilization,
            "requested_bytes": p.requested_bytes,
            "weights_bytes": p.weights_bytes,
            "profile_peak_bytes": p.profile_peak_bytes,
            "non_torch_bytes": p.non_torch_bytes,
            "kv_budget_bytes": p.kv_budget_bytes,
            "block_size": p.block_size,
            "block_bytes": p.block_bytes,
            "kv_blocks": p.kv_blocks,
            "max_concurrent_tokens": p.max_concurrent_tokens,
            "max_concurrent_sequences": p.max_concurrent_sequences,
        }
    return out


def _header(report: InferenceReport) -> Text:
    s = report.setup
    t = Text()
    t.append(report.model.name, style="bold")
    t.append(f"  {fmt_count(report.params)} params  {report.model.architecture}\n")
    t.append(
        f"{s.dtype.value} weights · {s.kv_format.value} cache ({s.cache.value}"
        + (f", blocks of {s.block_size}" if s.cache.value == "paged" else "")
        + f") · {s.attention.value} · batch {s.batch} × (prompt {s.prompt} + {s.new_tokens} new)"
        + (" · left-padded" if s.padded else "")
        + (f" · tp {s.tp}" if s.tp > 1 else "")
        + (f" · {report.gpus} GPUs" if report.gpus > 1 else "")
        + f" · method {report.method.value}"
    )
    return t


def _answer(report: InferenceReport) -> Text:
    t = Text()
    if report.fit is not None:
        f = report.fit
        style = "bold green" if f.fits else "bold red"
        verdict = "FITS" if f.fits else "DOES NOT FIT"
        t.append(f"{verdict} on {f.gpu_id}", style=style)
        t.append(
            f": needs {fmt_gib(f.required_bytes)} of {fmt_gib(f.usable_bytes)} usable "
            f"({fmt_gib(f.gpu_memory_bytes)} less {f.headroom_fraction:.0%} headroom)\n"
        )
    t.append(f"Peak allocated {fmt_gib(report.peak_bytes)}", style="bold")
    t.append(
        f" during {report.peak_phase.value}; nvidia-smi ≈ {fmt_gib(report.nvidia_smi_estimate_bytes)} "
        f"(+ allocator reserve and CUDA context)\n"
    )
    t.append(
        f"Weights {fmt_gib(report.weights_bytes)} · KV cache at full length {fmt_gib(report.kv_cache_bytes)} "
        f"({report.kv_bytes_per_token:,} B per token) · steady state {fmt_gib(report.steady_state_bytes)}\n"
    )
    rot = report.rule_of_thumb_bytes
    t.append(f"Rule of thumb (weights × 1.2): {fmt_gib(rot)} ({fmt_gb(rot)})", style="dim")
    return t


def _phases(report: InferenceReport) -> Table:
    table = Table(title="Where the bytes go (GiB, per GPU)")
    table.add_column("component")
    for p in report.phases:
        table.add_column(p.phase.value, justify="right")
    for c in INFER_COMPONENTS:
        if any(p.get(c) for p in report.phases):
            table.add_row(c.value, *(f"{gib(p.get(c)):.3f}" for p in report.phases))
    table.add_row("total", *(f"{gib(p.total_bytes):.3f}" for p in report.phases), style="bold")
    table.add_row(
        "worst moment", *(report.moments.get(InferencePhase(p.phase.value), "") for p in report.phases), style="dim"
    )
    return table


def _capacity(report: InferenceReport) -> Table | None:
    rows: list[tuple[str, str]] = []
    c = report.capacity
    if c is not None:
        s = report.setup
        at_least = "≥ " if c.max_batch_capped else ""
        rows.append((f"largest batch at prompt {s.prompt} + {s.new_tokens} new", f"{at_least}{c.max_batch}"))
        ctx = ("≥ " if c.max_context_capped else "") + f"{c.max_context}"
        rows.append((f"longest context (prompt + new) at batch {s.batch}", ctx))
        if report.replicas > 1:
            rows.append(("data-parallel replicas", f"{report.replicas} (each answers the above)"))
    p = report.paged
    if p is not None:
        rows += [
            (f"requested ({p.gpu_memory_utilization:.0%} of the GPU)", fmt_gib(p.requested_bytes)),
            ("weights + profile run + non-torch", fmt_gib(p.weights_bytes + p.profile_peak_bytes + p.non_torch_bytes)),
            ("KV budget", fmt_gib(p.kv_budget_bytes)),
            (f"KV blocks of {p.block_size} tokens", f"{p.kv_blocks:,}"),
            ("max concurrent tokens", f"{p.max_concurrent_tokens:,}"),
            (f"concurrent sequences at {report.setup.context} tokens", f"{p.max_concurrent_sequences:,}"),
        ]
    if not rows:
        return None
    title = "Paged server capacity (vLLM's start-up arithmetic)" if report.server is Server.PAGED else "Capacity"
    table = Table(title=title)
    table.add_column("question")
    table.add_column("answer", justify="right")
    for q, a in rows:
        table.add_row(q, a)
    return table


def render_infer(console: Console, report: InferenceReport, *, verbose: bool = False, capacity: bool = True) -> None:
    console.print(_header(report))
    console.print(_answer(report))
    console.print(_phases(report))
    cap = _capacity(report) if capacity or report.paged is not None else None
    if cap is not None:
        console.print(cap)
    if verbose:
        terms = Table(title="Terms")
        for col in ("term", "GiB", "formula", "source"):
            terms.add_column(col, overflow="fold")  # sources are file and function names: never cut them
        for term in report.terms:
            terms.add_row(term.name, f"{gib(term.bytes):.3f}", term.formula, term.source)
        console.print(terms)
        for n in report.notes:
            console.print(Text(f"note: {n}", style="dim"))

"""``trainfit models`` and ``trainfit gpus``: the built-in catalogs."""

from __future__ import annotations

from typing import Annotated

import typer


def models_cmd(json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """List the built-in model catalog (verbatim HF configs; provenance in SOURCES.md).

    Example: trainfit models --json
    """
    from rich.table import Table

    from trainfit.arch import catalog_slugs, count_params, load_model
    from trainfit.cli.common import print_json, print_table
    from trainfit.report.json import model_row
    from trainfit.units import fmt_count

    specs = [load_model(s) for s in catalog_slugs()]
    if json_out:
        print_json(
            {
                "schema_version": 1,
                "models": [model_row(s) for s in specs],
            }
        )
        return
    t = Table(title="Built-in models")
    for col in ("id", "type", "params", "hidden", "layers", "heads/kv", "vocab", "max pos", "experts"):
        t.add_column(col, justify="left" if col in ("id", "type") else "right")
    for s in specs:
        t.add_row(
            s.name,
            s.model_type,
            fmt_count(count_params(s)),
            str(s.hidden_size),
            str(s.num_layers),
            f"{s.num_heads}/{s.num_kv_heads}",
            str(s.vocab_size),
            str(s.max_position_embeddings or "-"),
            f"{s.moe.experts_per_token}/{s.moe.num_experts}" if s.moe else "-",
        )
    print_table(t)


def gpus_cmd(json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """List the GPU catalog: memory per device (basis: driver-reported with ECC on, or nominal), native
    bf16/fp8, peak TFLOPS, bandwidth.

    Example: trainfit gpus --json
    """
    from rich.table import Table

    from trainfit.cli.common import print_json, print_table
    from trainfit.hardware import list_gpus
    from trainfit.units import gib

    gpus = list_gpus()
    if json_out:
        print_json({"schema_version": 1, "gpus": [g.to_json() for g in gpus]})
        return
    t = Table(title="GPU catalog")
    for col in ("id", "name", "memory GiB", "basis", "cc", "bf16", "fp8", "bf16 TFLOPS", "GB/s"):
        t.add_column(col, justify="left" if col in ("id", "name", "basis") else "right")
    for g in gpus:
        bf = g.peak_tflops.get("bf16")
        t.add_row(
            g.id,
            g.name,
            f"{gib(g.memory_bytes):.2f}",
            g.memory_basis,
            g.compute_capability or "-",
            "yes" if g.bf16 else "no",
            "yes" if g.fp8 else "no",
            f"{bf:g}" if bf else "-",
            f"{g.memory_bandwidth_gbps:g}" if g.memory_bandwidth_gbps else "-",
        )
    print_table(t)


def register(app: typer.Typer) -> None:
    app.command("models")(models_cmd)
    app.command("gpus")(gpus_cmd)

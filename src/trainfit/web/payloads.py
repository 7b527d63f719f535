"""The JSON of the catalog commands (``trainfit models/gpus/formats/precision --json``), for the web API.

These objects are built in the CLI command bodies; the same dictionaries are built here from the same library
calls, and ``tests/web`` holds each to the CLI's output, key for key. The model list is computed once per
process (36 catalog configs parse in a few tens of milliseconds; a search then filters the cached rows).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from trainfit.report.json import model_row
from trainfit.result import SCHEMA_VERSION


@cache
def _model_rows() -> tuple[dict[str, Any], ...]:
    from trainfit.arch import catalog_slugs, load_model

    return tuple(model_row(load_model(s)) for s in catalog_slugs())


def models_payload(query: str = "") -> dict[str, Any]:
    """``trainfit models --json``; with ``query``, the rows whose id, type or architecture contain every word."""
    words = query.lower().split()
    rows = [
        r for r in _model_rows() if all(w in f"{r['id']} {r['model_type']} {r['architecture']}".lower() for w in words)
    ]
    return {"schema_version": 1, "models": rows}


def gpus_payload() -> dict[str, Any]:
    """``trainfit gpus --json``."""
    from trainfit.hardware import list_gpus

    return {"schema_version": 1, "gpus": [g.to_json() for g in list_gpus()]}


def formats_payload() -> dict[str, Any]:
    """``trainfit formats --json``."""
    from trainfit.precision.formats import FLOAT_FORMATS, INT8_VS_BF16, INTEGER_FORMATS, edge_facts

    return {
        "schema_version": SCHEMA_VERSION,
        "formats": [f.to_json() for f in FLOAT_FORMATS],
        "integer_formats": [f.to_json() for f in INTEGER_FORMATS],
        "edge_facts": [f.to_json() for f in edge_facts()],
        "int8_vs_bf16": INT8_VS_BF16,
    }


def precision_payload(gpu: str) -> dict[str, Any]:
    """``trainfit precision --gpu GPU --json`` (a catalog GPU: the server never inspects its own devices)."""
    from trainfit.hardware.gpus import get_gpu
    from trainfit.precision.advice import accelerator_from_spec, recommend

    advice = recommend(accelerator_from_spec(get_gpu(gpu)))
    return {
        "schema_version": SCHEMA_VERSION,
        "recommendation": advice.to_json(),
        "devices": [advice.accelerator.to_json()],
    }

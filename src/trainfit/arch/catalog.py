"""The built-in model catalog: verbatim (or, where noted, assembled) HF config.json files shipped as
package data. Provenance per file is in ``data/models/SOURCES.md``."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

from trainfit.errors import ConfigError


def _dir() -> Any:
    return resources.files("trainfit.arch").joinpath("data/models")


@cache
def catalog_slugs() -> tuple[str, ...]:
    return tuple(sorted(p.name[:-5] for p in _dir().iterdir() if p.name.endswith(".json")))


def catalog_config(slug: str) -> dict[str, Any]:
    try:
        data = json.loads(_dir().joinpath(f"{slug}.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:  # pragma: no cover - package data is tested
        raise ConfigError(f"catalog entry '{slug}' is unreadable: {exc}") from None
    if not isinstance(data, dict):  # pragma: no cover
        raise ConfigError(f"catalog entry '{slug}' is not a JSON object")
    return data

"""Resolve what the user typed into a ModelSpec: catalog slug, local config.json (file or folder),
Hugging Face repo id (optional, needs huggingface_hub and network), or explicit numbers."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from trainfit._suggest import did_you_mean
from trainfit.arch.catalog import catalog_config, catalog_slugs
from trainfit.arch.config import spec_from_config
from trainfit.arch.spec import MlpKind, ModelSpec
from trainfit.errors import ConfigError, DependencyError, UnknownModelError


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


def _from_hub(repo_id: str) -> dict[str, Any]:
    """Download only config.json (never code). Offline, gated or missing repos raise one-line errors."""
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
    except ImportError:
        raise DependencyError(
            f"'{repo_id}' is not a catalog model or a local path; to fetch it from the Hugging Face Hub "
            "install huggingface_hub (pip install 'trainfit[hf]'), or pass a local config.json"
        ) from None
    try:
        path = hf_hub_download(repo_id, "config.json")
    except GatedRepoError:
        raise UnknownModelError(
            f"'{repo_id}' is gated on the Hub; log in with `hf auth login` after accepting its licence, "
            "or download its config.json and pass the local path"
        ) from None
    except RepositoryNotFoundError:
        raise UnknownModelError(
            f"no Hub repo '{repo_id}'.{did_you_mean(repo_id.split('/')[-1], catalog_slugs())} "
            "Run 'trainfit models' for the built-in catalog."
        ) from None
    except Exception as exc:  # network errors come in many types (offline mode, DNS, timeouts)
        raise UnknownModelError(
            f"could not fetch config.json for '{repo_id}' from the Hub ({type(exc).__name__}); "
            "offline? Use a catalog model ('trainfit models') or a local config.json path"
        ) from None
    return _read_json(Path(path))


def load_model(name: str) -> ModelSpec:
    """Catalog slug | path to config.json or its folder | Hugging Face repo id."""
    key = name.strip()
    slugs = catalog_slugs()
    lowered = {s.lower(): s for s in slugs}
    if key.lower() in lowered:
        slug = lowered[key.lower()]
        return spec_from_config(catalog_config(slug), name=slug, source=f"catalog:{slug}")
    path = Path(os.path.expanduser(key))
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path.parent} has no config.json")
    if path.is_file():
        label = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
        return spec_from_config(_read_json(path), name=label, source=str(path))
    if key.endswith(".json") or (os.sep in key and not _looks_like_repo_id(key)):
        raise ConfigError(f"no such file: {key}")
    if _looks_like_repo_id(key):
        return spec_from_config(_from_hub(key), name=key, source=f"hub:{key}")
    raise UnknownModelError(
        f"unknown model '{name}'.{did_you_mean(key, slugs)} Run 'trainfit models' for the catalog, "
        "or pass a config.json path, a Hub repo id (org/name), or --params/--hidden-size/--num-layers."
    )


def _looks_like_repo_id(key: str) -> bool:
    parts = key.split("/")
    return len(parts) == 2 and all(parts) and not key.startswith((".", "/", "~"))


def explicit_model(
    *,
    params: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    vocab_size: int | None = None,
    intermediate_size: int | None = None,
) -> ModelSpec:
    """A what-if Llama-style model from explicit numbers. ``params`` is taken as given.

    Unset dimensions get Llama conventions: head_dim 128 (heads = hidden/128), no GQA, a 32000-token
    vocabulary, and an intermediate size solved from ``params`` (P ≈ 2·V·h + L·(4h² + 3h·i)), falling
    back to 8h/3 when that is not positive.
    """
    for label, v in (("--params", params), ("--hidden-size", hidden_size), ("--num-layers", num_layers)):
        if v <= 0:
            raise ConfigError(f"{label} must be positive, got {v}")
    heads = num_heads or max(1, hidden_size // 128)
    if hidden_size % heads:
        raise ConfigError(f"--hidden-size {hidden_size} is not divisible by --num-heads {heads}")
    kv = num_kv_heads or heads
    if heads % kv:
        raise ConfigError(f"--num-heads {heads} is not a multiple of --num-kv-heads {kv}")
    vocab = vocab_size or 32000
    head_dim = hidden_size // heads
    if intermediate_size is None:
        attn = 2 * hidden_size * heads * head_dim + 2 * hidden_size * kv * head_dim
        solved = (params - 2 * vocab * hidden_size - num_layers * attn) // (3 * hidden_size * num_layers)
        intermediate_size = int(solved) if solved > 0 else (8 * hidden_size) // 3
    return ModelSpec(
        name=f"explicit-{params / 1e9:.3g}B",
        source="explicit",
        model_type="explicit",
        architecture="explicit (Llama-style)",
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        vocab_size=vocab,
        mlp=MlpKind.GATED,
        rotary_dim=head_dim,
        params_override=params,
    )

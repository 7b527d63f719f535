"""Resolve what the user typed into a ModelSpec: catalog slug, local config.json (file or folder),
Hugging Face repo id (optional, needs huggingface_hub and network), or explicit numbers.

Every bad input raises a one-line TrainfitError: unreadable or binary files, names the OS refuses
(too long, NUL bytes), invalid Hub ids, an unreachable Hub, and explicit numbers that describe no model.
Offline, a Hub id fails in about two seconds: a short TCP probe of the Hub endpoint decides whether to
ask the network at all (huggingface_hub otherwise retries for ~20 s and logs every retry); without the
network only the local Hugging Face cache is consulted.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from trainfit._suggest import did_you_mean
from trainfit.arch.catalog import catalog_config, catalog_slugs
from trainfit.arch.config import spec_from_config
from trainfit.arch.params import inventory
from trainfit.arch.spec import MAX_DIM, MlpKind, ModelSpec
from trainfit.errors import ConfigError, DependencyError, UnknownModelError

#: Seconds to wait for a TCP connection to the Hub (DNS included) before treating the machine as offline.
HUB_PROBE_TIMEOUT_S = 2.0
#: Seconds huggingface_hub may wait for the Hub's answer about config.json once the probe succeeded.
HUB_REQUEST_TIMEOUT_S = 5.0


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a text file (not UTF-8); pass a model's config.json") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    except RecursionError:
        raise ConfigError(f"{path} nests JSON too deeply to be a config.json") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


def _hub_reachable(endpoint: str, timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the Hub endpoint opens within ``timeout`` seconds.

    Name resolution has no timeout of its own, so the probe runs in a daemon thread that is abandoned
    when it takes too long. With a proxy configured the proxy decides what is reachable: no probe.
    """
    parts = urlsplit(endpoint)
    host = parts.hostname
    if not host:
        return True
    proxies = urllib.request.getproxies()
    if (proxies.get(parts.scheme) or proxies.get("all")) and not urllib.request.proxy_bypass(host):
        return True
    port = parts.port or (443 if parts.scheme == "https" else 80)
    outcome: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                outcome.append(True)
        except (OSError, UnicodeError):
            outcome.append(False)

    worker = threading.Thread(target=probe, name="trainfit-hub-probe", daemon=True)
    worker.start()
    worker.join(timeout)
    return bool(outcome and outcome[0])


@contextmanager
def _quiet_hub_logs() -> Iterator[None]:
    """huggingface_hub logs each network retry as a warning; our one-line error says what went wrong."""
    logger = logging.getLogger("huggingface_hub")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _from_hub(repo_id: str) -> dict[str, Any]:
    """Download only config.json (never code). Offline, gated or missing repos raise one-line errors."""
    try:
        from huggingface_hub import constants, hf_hub_download
        from huggingface_hub.errors import (
            GatedRepoError,
            HFValidationError,
            LocalEntryNotFoundError,
            RemoteEntryNotFoundError,
            RepositoryNotFoundError,
        )
        from huggingface_hub.utils import validate_repo_id  # type: ignore[attr-defined]
    except ImportError:
        raise DependencyError(
            f"'{_short(repo_id)}' is not a catalog model or a local path; to fetch it from the Hugging Face Hub "
            "install huggingface_hub (pip install 'trainfit[hf]'), or pass a local config.json"
        ) from None
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise UnknownModelError(
            f"'{_short(repo_id)}' is not a catalog model, a local file or a valid Hub repo id (org/name: letters, "
            "digits, '-', '_', '.', at most 96 characters). Run 'trainfit models' for the catalog."
        ) from None
    offline = bool(constants.HF_HUB_OFFLINE) or not _hub_reachable(constants.ENDPOINT)
    try:
        with _quiet_hub_logs():
            path = hf_hub_download(repo_id, "config.json", local_files_only=offline, etag_timeout=HUB_REQUEST_TIMEOUT_S)
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
    except RemoteEntryNotFoundError:
        raise UnknownModelError(
            f"Hub repo '{repo_id}' has no config.json; pass a local config.json or explicit --params numbers"
        ) from None
    except LocalEntryNotFoundError:
        if not offline:
            raise UnknownModelError(
                f"could not fetch config.json for '{repo_id}' from the Hub (no answer within "
                f"{HUB_REQUEST_TIMEOUT_S:g} s) and it is not in the local cache; use a catalog model "
                "('trainfit models') or a local config.json path"
            ) from None
        where = urlsplit(constants.ENDPOINT).hostname or constants.ENDPOINT
        reason = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else f"cannot reach {where}"
        raise UnknownModelError(
            f"'{repo_id}' is not in the local Hugging Face cache and {reason}; use a catalog model "
            "('trainfit models') or a local config.json path"
        ) from None
    except Exception as exc:  # network errors come in many types (DNS, TLS, timeouts, HTTP 5xx)
        raise UnknownModelError(
            f"could not fetch config.json for '{repo_id}' from the Hub ({type(exc).__name__}); "
            "offline? Use a catalog model ('trainfit models') or a local config.json path"
        ) from None
    return _read_json(Path(path))


#: Largest config file we read: real config.json files are a few KB (DeepSeek-V3's is 1.7 KB); anything
#: this big is a weights file or an archive passed by mistake.
MAX_CONFIG_BYTES = 16 * 2**20


def _path_kind(path: Path) -> str | None:
    """ "dir", "file", "other" (a device, FIFO...) or None when nothing is there or the OS refuses the name
    (too long, NUL bytes)."""
    try:
        if path.is_dir():
            return "dir"
        if path.is_file():
            return "file"
        return "other" if path.exists() else None
    except (OSError, ValueError):
        return None


def load_model(name: str) -> ModelSpec:
    """Catalog slug | path to config.json or its folder | Hugging Face repo id."""
    if not isinstance(name, str):
        raise UnknownModelError(f"a model is named by a string (slug, path or Hub id), got {type(name).__name__}")
    key = name.strip()
    slugs = catalog_slugs()
    if not key:
        raise UnknownModelError("empty model name; run 'trainfit models' for the catalog or pass a config.json path")
    lowered = {s.lower(): s for s in slugs}
    if key.lower() in lowered:
        slug = lowered[key.lower()]
        return spec_from_config(catalog_config(slug), name=slug, source=f"catalog:{slug}")
    path = Path(os.path.expanduser(key))
    kind = _path_kind(path)
    if kind == "dir":
        path = path / "config.json"
        kind = _path_kind(path)
        if kind != "file":
            raise ConfigError(f"{path.parent} has no config.json")
    if kind == "other":
        raise ConfigError(f"{_short(key)} is not a regular file; pass a model's config.json")
    if kind == "file":
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"{path} is {size / 2**20:.0f} MiB, too big for a config.json (a few KB); pass the model's "
                "config.json, not its weights"
            )
        label = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
        return spec_from_config(_read_json(path), name=label, source=str(path))
    if key.endswith(".json") or (os.sep in key and not _looks_like_repo_id(key)):
        raise ConfigError(f"no such file: {_short(key)}")
    if _looks_like_repo_id(key):
        return spec_from_config(_from_hub(key), name=key, source=f"hub:{key}")
    raise UnknownModelError(
        f"unknown model '{_short(key)}'.{did_you_mean(key, slugs)} Run 'trainfit models' for the catalog, "
        "or pass a config.json path, a Hub repo id (org/name), or --params/--hidden-size/--num-layers."
    )


def _looks_like_repo_id(key: str) -> bool:
    parts = key.split("/")
    return len(parts) == 2 and all(parts) and not key.startswith((".", "/", "~"))


#: The widest MLP an explicit model may imply, per layer, in units of hidden_size²: 1024. The most
#: expert-heavy model in the catalog, DeepSeek-V3, carries 210·h² of MLP/expert weights per layer; dense
#: models carry 8–24·h². Five times DeepSeek-V3's budget leaves room for any plausible what-if MoE total.
MAX_MLP_PARAMS_PER_H2 = 1024


def _whole(label: str, value: Any, *, minimum: int = 1, maximum: int | None = MAX_DIM) -> int:
    """``value`` as an int in [minimum, maximum]; bools are not numbers. Without a maximum (a parameter
    count) an integral float such as 7e9 is whole too."""
    if maximum is None and isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{label} must be a whole number, got {value!r}")
    if value < minimum:
        word = "positive" if minimum == 1 else f"at least {minimum}"
        raise ConfigError(f"{label} must be {word}, got {value}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{label} must be at most {maximum}, got {value}")
    return value


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
    """A what-if Llama-style model from explicit numbers; ``params`` is the total the estimate uses.

    Unset dimensions get Llama conventions: head_dim 128 (heads = hidden/128), no GQA, a 32000-token
    vocabulary, untied embeddings, and an intermediate size solved from ``params``
    (P = 2·V·h + L·(attention + norms + 3·h·i) + h). When ``params`` is too small for an untied head, the
    embedding is tied and the solve repeated.

    ``params`` must be consistent with the dimensions, P_min ≤ P ≤ P_min + V·h + 1024·L·h², where P_min is the
    smallest model they describe (tied embedding, attention and norms, no MLP) and 1024·h² per layer bounds
    the MLP (``MAX_MLP_PARAMS_PER_H2``, five times DeepSeek-V3's expert budget). Outside that range the
    numbers describe no transformer, and the estimate would mix a total with activations of another model.
    """
    params = _whole("--params", params, maximum=None)
    hidden_size = _whole("--hidden-size", hidden_size)
    num_layers = _whole("--num-layers", num_layers)
    if num_heads is not None:
        num_heads = _whole("--num-heads", num_heads)
    if num_kv_heads is not None:
        num_kv_heads = _whole("--num-kv-heads", num_kv_heads)
    if vocab_size is not None:
        vocab_size = _whole("--vocab-size", vocab_size)
    if intermediate_size is not None:
        intermediate_size = _whole("--intermediate-size", intermediate_size, minimum=0)
    heads = num_heads if num_heads is not None else max(1, hidden_size // 128)
    if hidden_size % heads:
        given = "" if num_heads is not None else " (the default, hidden/128); give --num-heads"
        raise ConfigError(f"--hidden-size {hidden_size} is not divisible by --num-heads {heads}{given}")
    kv = num_kv_heads if num_kv_heads is not None else heads
    if heads % kv:
        raise ConfigError(f"--num-heads {heads} is not a multiple of --num-kv-heads {kv}")
    vocab = vocab_size if vocab_size is not None else 32000
    head_dim = hidden_size // heads
    spec = ModelSpec(
        name=f"explicit-{params / 1e9:.3g}B",
        source="explicit",
        model_type="explicit",
        architecture="explicit (Llama-style)",
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        intermediate_size=0,
        vocab_size=vocab,
        mlp=MlpKind.GATED,
        rotary_dim=head_dim,
        params_override=params,
    )
    untied_min = inventory(spec).total
    tied_min = inventory(dataclasses.replace(spec, tie_word_embeddings=True)).total
    most = untied_min + MAX_MLP_PARAMS_PER_H2 * num_layers * hidden_size**2
    dims = f"hidden {hidden_size}, {num_layers} layers, {heads}/{kv} heads, vocabulary {vocab}"
    if params < tied_min:
        raise ConfigError(
            f"--params {params:,} is fewer than the {tied_min:,} parameters of the smallest model with {dims} "
            "(tied embedding and attention, no MLP); check --params or give smaller dimensions "
            "(--num-kv-heads, --vocab-size)"
        )
    if params > most:
        raise ConfigError(
            f"--params {params:,} is more than {most:,}, the most a model with {dims} can hold (an MLP of "
            f"{MAX_MLP_PARAMS_PER_H2}·hidden² per layer); check --params or give larger dimensions"
        )
    per_mlp = 3 * hidden_size * num_layers
    if intermediate_size is not None:
        tied = False
    elif params >= untied_min:
        tied, intermediate_size = False, (params - untied_min) // per_mlp
    else:
        tied, intermediate_size = True, (params - tied_min) // per_mlp
    return dataclasses.replace(spec, intermediate_size=intermediate_size, tie_word_embeddings=tied)

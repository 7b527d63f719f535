"""Turn a web request's options into the library's inputs, with the CLI's vocabulary and defaults.

The web API speaks the CLI's language: an option is a CLI flag spelled with underscores (``--grad-accum`` is
``grad_accum``), and its type and default are read from the CLI command's own signature
(:func:`trainfit.cli.estimate.estimate_cmd`, :func:`trainfit.cli.infer.infer_cmd`), so a flag added to the CLI
is a field of the API without a second list to keep in step. What a command does with its flags (building a
``Strategy`` or an ``InferenceSetup``) is mirrored here line for line; ``tests/web`` holds the two to the same
JSON for the same inputs, so a drift fails a test.

Values arrive as strings (a query string) or JSON scalars (a request body); a repeatable flag (``--after``) takes
a list of strings, or one string. Bad values raise
:class:`~trainfit.errors.ConfigError` with one line that names the flag as the CLI spells it, which the page
uses to show the message next to that field.

Models: a catalog slug, or a pasted ``config.json`` (text or object, JSON only, size-limited, never code).
A Hub id is fetched only when the server was started with ``--allow-hub``. A local path is never read: the
page is served to a browser, and a browser has no business naming the server's files.
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from trainfit._suggest import did_you_mean
from trainfit.arch import ModelSpec, catalog_slugs, explicit_model, load_model
from trainfit.arch.config import spec_from_config
from trainfit.errors import ConfigError, StrategyError, UnknownModelError

#: The largest pasted config.json the server parses (real ones are a few KB; catalog's largest is ~2 KB).
MAX_CONFIG_BYTES = 256 * 1024

#: Keys of a request that are not CLI flags: the model (the CLI's argument) and a pasted config.
MODEL_KEYS = ("model", "config", "config_name")

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


@dataclass(frozen=True, slots=True, kw_only=True)
class Option:
    """One CLI option as the API sees it: its name, the flag the CLI prints, its scalar type and default."""

    name: str
    flag: str
    kind: type
    optional: bool
    default: Any


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _options_of(fn: Callable[..., Any], json_flag: str = "json_out") -> dict[str, Option]:
    out: dict[str, Option] = {}
    # the signature typer reads (``trainfit plan``'s includes estimate's run flags: cli.estimate.with_run_flags)
    for name, param in inspect.signature(fn, eval_str=True).parameters.items():
        if name in ("model", json_flag, "explain", "modules", "max_batch", "from_path"):
            continue  # the model is handled apart; output switches have no meaning for JSON; no local files
        hint = param.annotation
        base = typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Annotated else hint
        args = [a for a in typing.get_args(base) if a is not type(None)]
        optional = bool(args) and len(args) < len(typing.get_args(base))
        kind = args[0] if optional else base
        flag = _flag(name)
        annotated = typing.get_args(hint)[1:] if typing.get_origin(hint) is typing.Annotated else ()
        for meta in annotated:  # the flag as typer declares it (e.g. --optimizer-impl), when it says
            decls = [d for d in getattr(meta, "param_decls", ()) or () if d.startswith("--")]
            if decls:
                flag = decls[0].split("/")[0]
        default = None if param.default is inspect.Parameter.empty else param.default
        out[name] = Option(name=name, flag=flag, kind=kind, optional=optional, default=default)
    return out


@cache
def estimate_options() -> dict[str, Option]:
    """The options of ``trainfit estimate``, by API name."""
    from trainfit.cli.estimate import estimate_cmd

    return _options_of(estimate_cmd)


@cache
def plan_options() -> dict[str, Option]:
    """The options of ``trainfit plan``, by API name (``export`` writes files: not offered here)."""
    from trainfit.cli.plan import plan_cmd

    out = _options_of(plan_cmd)
    out.pop("export", None)
    return out


def plan_inputs(raw: Mapping[str, Any], *, allow_hub: bool) -> tuple[ModelSpec, dict[str, Any]]:
    """The model and the keyword arguments of :func:`trainfit.planner.api.plan` for a request (``build``,
    ``warm_up`` and ``after`` become its ``history``, as ``trainfit plan`` builds it; ``host_memory_gib`` its
    ``host_memory_bytes``; the run fields of ``trainfit estimate`` — ``precision``, ``checkpointing``, ``batch``,
    ``finetune``… — its ``baseline``, those the request names laid over the default as ``trainfit plan`` lays its
    given flags)."""
    from trainfit.cli.estimate import process_history
    from trainfit.cli.plan import BASELINE_FLAGS, baseline_from_flags
    from trainfit.planner.api import model_workload
    from trainfit.planner.workload import host_memory_bytes

    o = parse_options(raw, plan_options())
    spec = resolve_model(raw, allow_hub=allow_hub)
    assert spec is not None
    if not o.get("gpu"):
        raise ConfigError("--gpu is required: the GPU to plan for (see /api/gpus)")
    run = {name: o.pop(name) for name in BASELINE_FLAGS}
    sizes = ("gpus", "nodes", "gpus_per_node", "seq", "global_batch", "tokens_per_step")
    o["workload"] = model_workload(spec, **{name: o.pop(name) for name in sizes})  # as trainfit plan builds it
    o["baseline"] = baseline_from_flags(spec, run, [name for name in BASELINE_FLAGS if name in raw], o["workload"])
    o["history"] = process_history(o.pop("build"), o.pop("warm_up"), o.pop("after"))
    o["host_memory_bytes"] = host_memory_bytes(o.pop("host_memory_gib"))  # as trainfit plan converts it
    return spec, o


@cache
def infer_options() -> dict[str, Option]:
    """The options of ``trainfit infer``, by API name."""
    from trainfit.cli.infer import infer_cmd

    return _options_of(infer_cmd)


def _coerce(opt: Option, value: Any) -> Any:
    if value is None or (opt.optional and isinstance(value, str) and value.strip() == ""):
        if opt.optional:
            return None
        raise ConfigError(f"{opt.flag} needs a value")
    shown = str(value)[:40]
    if opt.kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"invalid value for '{opt.flag}': '{shown}' is not a valid boolean")
    if opt.kind is int:
        if isinstance(value, bool):
            raise ConfigError(f"invalid value for '{opt.flag}': '{shown}' is not a valid integer")
        if isinstance(value, int):
            return value
        try:
            return int(str(value).strip())
        except ValueError:
            raise ConfigError(f"invalid value for '{opt.flag}': '{shown}' is not a valid integer") from None
    if opt.kind is float:
        if isinstance(value, bool):
            raise ConfigError(f"invalid value for '{opt.flag}': '{shown}' is not a valid float")
        if isinstance(value, int | float):
            return float(value)
        try:
            return float(str(value).strip())
        except ValueError:
            raise ConfigError(f"invalid value for '{opt.flag}': '{shown}' is not a valid float") from None
    if typing.get_origin(opt.kind) is list:  # a repeatable flag (--after): a list of texts, or one text
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, dict | list | bool) or v is None for v in values):
            raise ConfigError(f"invalid value for '{opt.flag}': expected a text or a list of texts")
        return [str(v) for v in values]
    if isinstance(value, dict | list):
        raise ConfigError(f"invalid value for '{opt.flag}': expected text")
    return str(value)


def parse_options(raw: Mapping[str, Any], options: Mapping[str, Option]) -> dict[str, Any]:
    """Every option with its value: the request's, coerced, else the CLI's default. Unknown keys are errors."""
    for key in raw:
        if key not in options and key not in MODEL_KEYS:
            hint = did_you_mean(key, list(options))
            raise ConfigError(f"no such option: {_flag(key)}.{hint}".rstrip("."))
    return {name: (_coerce(opt, raw[name]) if name in raw else opt.default) for name, opt in options.items()}


def _parse_config(text: Any, name: str) -> ModelSpec:
    if isinstance(text, dict):
        data: Any = text
        size = len(json.dumps(text))
    elif isinstance(text, str):
        size = len(text.encode("utf-8"))
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"config.json is {size // 1024} KiB, more than the {MAX_CONFIG_BYTES // 1024} KiB a config.json "
                "may have here; paste the model's config.json, not its weights"
            )
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{name} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
        except RecursionError:
            raise ConfigError(f"{name} nests JSON too deeply to be a config.json") from None
    else:
        raise ConfigError("config must be the text of a config.json (or its JSON object)")
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"config.json is more than the {MAX_CONFIG_BYTES // 1024} KiB a config.json may have here")
    if not isinstance(data, dict):
        raise ConfigError(f"{name} must hold a JSON object")
    label = name.removesuffix(".json") if name != "config.json" else str(data.get("_name_or_path") or "config")
    return spec_from_config(data, name=label[:80] or "config", source="upload")


def resolve_model(raw: Mapping[str, Any], *, allow_hub: bool, required: bool = True) -> ModelSpec | None:
    """The model a request names: a pasted ``config``, else a catalog slug (or, with ``allow_hub``, a Hub id)."""
    config = raw.get("config")
    if config not in (None, ""):
        name = str(raw.get("config_name") or "config.json")
        return _parse_config(config, name)
    model = raw.get("model")
    if model in (None, ""):
        if required:
            raise UnknownModelError("give a model: a catalog slug (see /api/models) or a pasted config.json")
        return None
    key = str(model).strip()
    slugs = catalog_slugs()
    if key.lower() in {s.lower() for s in slugs}:
        return load_model(key)
    if allow_hub and _REPO_ID.match(key):
        return load_model(key)
    hub = (
        " or a Hub repo id (org/name)"
        if allow_hub
        else "; a Hub id needs the server started with 'trainfit serve --allow-hub'"
    )
    raise UnknownModelError(
        f"unknown model '{key[:60]}'.{did_you_mean(key, slugs)} Pick a catalog model (see /api/models), "
        f"paste a config.json{hub}"
    )


def estimate_inputs(raw: Mapping[str, Any], *, allow_hub: bool) -> tuple[ModelSpec, dict[str, Any]]:
    """The model and the keyword arguments of :func:`trainfit.estimate.estimate` for a request, as
    ``trainfit estimate`` builds them from its flags (``method_options`` excluded)."""
    from trainfit.cli.estimate import (
        STRATEGY_FLAGS,
        parse_count,
        process_history,
        refuse_inapplicable,
        strategy_from_flags,
    )
    from trainfit.planner.workload import host_memory_bytes
    from trainfit.result import Method

    o = parse_options(raw, estimate_options())
    host = host_memory_bytes(o["host_memory_gib"])  # first, as trainfit estimate checks it
    explicit = [o["params"], o["hidden_size"], o["num_layers"]]
    spec = resolve_model(raw, allow_hub=allow_hub, required=False)
    if spec is not None and any(v is not None for v in explicit):
        raise ConfigError("give either MODEL or --params/--hidden-size/--num-layers, not both")
    if spec is None:
        if any(v is None for v in explicit):
            raise ConfigError(
                "give a MODEL (catalog slug, config.json or Hub id; see 'trainfit models') or all of "
                "--params, --hidden-size and --num-layers"
            )
        spec = explicit_model(
            params=parse_count(o["params"], "--params") or 0,
            hidden_size=o["hidden_size"],
            num_layers=o["num_layers"],
            num_heads=o["num_heads"],
            num_kv_heads=o["num_kv_heads"],
            vocab_size=o["vocab_size"],
            intermediate_size=o["intermediate_size"],
        )
    spec, strategy = strategy_from_flags(spec, **{name: o[name] for name in STRATEGY_FLAGS})
    refuse_inapplicable(strategy, frozenset(raw))  # the request's own fields, as the CLI's given flags
    try:
        method = Method(o["method"])
    except ValueError:
        raise StrategyError(
            f"unknown method '{o['method']}'; choose one of: {', '.join(x.value for x in Method)}"
        ) from None
    return spec, {
        "strategy": strategy,
        "method": method,
        "gpu": o["gpu"],
        "headroom": o["headroom"],
        "allocator": o["alloc_conf"],
        "allocator_layout": o["segments"],
        "fixes": o["fixes"],
        "torch_version": o["torch_version"],
        "cuda_version": o["cuda_version"],
        "history": process_history(o["build"], o["warm_up"], o["after"]),
        "host_memory_bytes": host,
    }


def infer_inputs(raw: Mapping[str, Any], *, allow_hub: bool) -> tuple[ModelSpec, dict[str, Any]]:
    """The model and the keyword arguments of :func:`trainfit.infer.infer` for a request, as ``trainfit infer``
    builds them from its flags (``progress`` excluded)."""
    from trainfit.cli.infer import SETUP_FLAGS, setup_from_flags

    o = parse_options(raw, infer_options())
    spec = resolve_model(raw, allow_hub=allow_hub)
    assert spec is not None
    setup = setup_from_flags(spec, **{name: o[name] for name in SETUP_FLAGS})
    return spec, {
        "setup": setup,
        "method": o["method"],
        "gpu": o["gpu"],
        "gpus": o["gpus"],
        "server": o["server"],
        "gpu_memory_utilization": o["gpu_memory_utilization"],
        "headroom": o["headroom"],
        "allocator": o["alloc_conf"],
        "simulate_allocator": o["simulate_allocator"] or o["alloc_conf"] is not None,
    }

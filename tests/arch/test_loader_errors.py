"""What the user types as a model: odd files and names, Hub ids offline (no network used: the probe and
the download are monkeypatched), and explicit numbers that describe no model (issue 15 #6, #7, #16)."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from trainfit.arch import count_params, explicit_model, load_model, loader
from trainfit.arch.catalog import catalog_config
from trainfit.arch.params import inventory
from trainfit.errors import ConfigError, UnknownModelError

# -- files and names --------------------------------------------------------------------------------------


def test_binary_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(bytes(range(256)))  # was UnicodeDecodeError
    with pytest.raises(ConfigError, match="not a text file"):
        load_model(str(path))


def test_deeply_nested_json_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match=r"nests JSON too deeply|must hold a JSON object"):
        load_model(str(path))


def test_weights_file_passed_by_mistake_is_refused_before_reading(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "model.json"
    path.write_text("{}")
    monkeypatch.setattr(loader, "MAX_CONFIG_BYTES", 1)
    with pytest.raises(ConfigError, match=r"too big for a config\.json"):
        load_model(str(path))


@pytest.mark.parametrize("name", ["a" * 300, "x" * 5000, "bad\x00name", "org/" + "b" * 300])
def test_names_the_os_refuses_are_unknown_models(name: str) -> None:
    """A 300-character name used to raise OSError (ENAMETOOLONG) from Path.is_dir."""
    with pytest.raises((UnknownModelError, ConfigError)) as exc:
        load_model(name)
    assert "\n" not in str(exc.value) and len(str(exc.value)) < 400


@pytest.mark.skipif(sys.platform == "win32", reason="no /dev/null file")
def test_a_device_is_not_a_config() -> None:
    with pytest.raises(ConfigError, match="not a regular file"):
        load_model("/dev/null")


@pytest.mark.parametrize("name", ["", "   "])
def test_empty_name(name: str) -> None:
    with pytest.raises(UnknownModelError, match="empty model name"):
        load_model(name)


def test_non_string_name() -> None:
    with pytest.raises(UnknownModelError, match="string"):
        load_model(123)  # type: ignore[arg-type]


# -- the Hub, offline ---------------------------------------------------------------------------------------

hub = pytest.importorskip("huggingface_hub")


class _Downloads:
    """Stands in for hf_hub_download; records how it was called."""

    def __init__(self, result: Any) -> None:
        self.result = result
        self.calls: list[dict[str, Any]] = []

    def __call__(self, repo_id: str, filename: str, **kwargs: Any) -> str:
        self.calls.append(kwargs)
        if isinstance(self.result, BaseException):
            raise self.result
        return str(self.result)


def _patch_hub(monkeypatch, *, reachable: bool, result: Any) -> _Downloads:
    fake = _Downloads(result)
    monkeypatch.setattr(hub, "hf_hub_download", fake)
    monkeypatch.setattr(loader, "_hub_reachable", lambda endpoint, timeout=0: reachable)
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", False)
    return fake


def test_offline_hub_id_fails_fast_from_the_cache_only(monkeypatch) -> None:
    from huggingface_hub.errors import LocalEntryNotFoundError

    fake = _patch_hub(monkeypatch, reachable=False, result=LocalEntryNotFoundError("not cached"))
    start = time.perf_counter()
    with pytest.raises(UnknownModelError, match="not in the local Hugging Face cache and cannot reach") as exc:
        load_model("meta-llama/Llama-3.1-8B")
    assert time.perf_counter() - start < 1
    assert fake.calls == [{"local_files_only": True, "etag_timeout": loader.HUB_REQUEST_TIMEOUT_S}]
    assert "\n" not in str(exc.value)


def test_offline_hub_id_in_the_cache_still_loads(monkeypatch, tmp_path: Path) -> None:
    cached = tmp_path / "config.json"
    cached.write_text(json.dumps(catalog_config("llama-3.2-1b")))
    fake = _patch_hub(monkeypatch, reachable=False, result=cached)
    spec = load_model("meta-llama/Llama-3.2-1B")
    assert spec.source == "hub:meta-llama/Llama-3.2-1B" and fake.calls[0]["local_files_only"] is True


def test_online_hub_id_asks_the_network_with_a_short_timeout(monkeypatch, tmp_path: Path) -> None:
    cached = tmp_path / "config.json"
    cached.write_text(json.dumps(catalog_config("llama-3.2-1b")))
    fake = _patch_hub(monkeypatch, reachable=True, result=cached)
    load_model("meta-llama/Llama-3.2-1B")
    assert fake.calls == [{"local_files_only": False, "etag_timeout": loader.HUB_REQUEST_TIMEOUT_S}]


def test_hf_hub_offline_env_skips_the_probe(monkeypatch) -> None:
    from huggingface_hub.errors import LocalEntryNotFoundError

    fake = _patch_hub(monkeypatch, reachable=True, result=LocalEntryNotFoundError("not cached"))
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UnknownModelError, match="HF_HUB_OFFLINE is set"):
        load_model("org/model")
    assert fake.calls[0]["local_files_only"] is True


def test_invalid_repo_id_never_reaches_the_network(monkeypatch) -> None:
    fake = _patch_hub(monkeypatch, reachable=True, result=AssertionError("must not be called"))
    with pytest.raises(UnknownModelError, match="a valid Hub repo id"):
        load_model("org/" + "n" * 120)
    assert fake.calls == []


def test_retry_logs_are_silenced_and_restored() -> None:
    import logging

    logger = logging.getLogger("huggingface_hub")
    before = logger.level
    with loader._quiet_hub_logs():
        assert not logger.isEnabledFor(logging.WARNING)
    assert logger.level == before


def test_probe_is_false_for_a_closed_local_port() -> None:
    with socket.socket() as s:  # a port nobody listens on: connection refused, no network involved
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert loader._hub_reachable(f"http://127.0.0.1:{port}", timeout=1.0) is False


def test_probe_gives_up_after_its_timeout(monkeypatch) -> None:
    """Name resolution has no timeout of its own: a hanging lookup must not hang the CLI."""
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    monkeypatch.delenv("https_proxy", raising=False)
    monkeypatch.delenv("ALL_PROXY", raising=False)
    monkeypatch.delenv("all_proxy", raising=False)

    def hang(*args: Any, **kwargs: Any) -> Any:
        time.sleep(3)
        raise OSError("too late")

    monkeypatch.setattr(socket, "create_connection", hang)
    start = time.perf_counter()
    assert loader._hub_reachable("https://huggingface.co", timeout=0.2) is False
    assert time.perf_counter() - start < 1


# -- explicit numbers -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"num_heads": 0}, "--num-heads must be positive, got 0"),  # was treated as not given
        ({"vocab_size": 0}, "--vocab-size must be positive, got 0"),  # was treated as not given
        ({"num_kv_heads": 0}, "--num-kv-heads must be positive"),
        ({"intermediate_size": -1}, "--intermediate-size must be at least 0"),  # was a ValueError traceback
        ({"hidden_size": True}, "--hidden-size must be a whole number"),
        ({"hidden_size": 4096.0}, "--hidden-size must be a whole number"),
        ({"num_layers": 2**40}, "--num-layers must be at most"),
        ({"params": 1.5}, "--params must be a whole number"),
        ({"params": 1}, "fewer than the"),  # what `--params 1.5` becomes after the CLI's int()
        ({"params": 1e15}, "is more than"),
        ({"hidden_size": 1000}, "not divisible by --num-heads 7 (the default, hidden/128); give --num-heads"),
        ({"num_heads": 32, "num_kv_heads": 5}, "not a multiple of --num-kv-heads 5"),
    ],
)
def test_explicit_numbers_that_describe_no_model(kwargs: dict[str, Any], needle: str) -> None:
    args: dict[str, Any] = {"params": 7_000_000_000, "hidden_size": 4096, "num_layers": 32} | kwargs
    with pytest.raises(ConfigError) as exc:
        explicit_model(**args)
    assert needle in str(exc.value)


def test_params_range_is_the_smallest_and_largest_model_of_those_dims() -> None:
    """P_min (tied embedding + attention + norms, no MLP) <= P <= P_min + V·h + 1024·L·h²."""
    dims = {"hidden_size": 4096, "num_layers": 32}
    attention_and_norms = 32 * (4 * 4096 * 4096 + 2 * 4096) + 4096
    tied_min = 32000 * 4096 + attention_and_norms
    assert count_params(explicit_model(params=tied_min, **dims)) == tied_min
    with pytest.raises(ConfigError):
        explicit_model(params=tied_min - 1, **dims)
    untied_min = tied_min + 32000 * 4096
    most = untied_min + loader.MAX_MLP_PARAMS_PER_H2 * 32 * 4096**2
    explicit_model(params=most, **dims)
    with pytest.raises(ConfigError):
        explicit_model(params=most + 1, **dims)


def test_small_params_tie_the_embedding_instead_of_inventing_an_mlp() -> None:
    """Below the untied minimum the solve used to fall back to an 8h/3 MLP that params did not pay for."""
    spec = explicit_model(params=2_350_000_000, hidden_size=4096, num_layers=32)  # untied minimum: 2.41e9
    assert spec.tie_word_embeddings
    per_mlp = 3 * 4096 * 32
    assert 0 <= count_params(spec) - inventory(spec).total < per_mlp  # the solved MLP spends params, no more


def test_integral_float_params_are_accepted() -> None:
    assert count_params(explicit_model(params=7e9, hidden_size=4096, num_layers=32)) == 7_000_000_000

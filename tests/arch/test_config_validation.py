"""Bad config.json values raise one ConfigError that names the key, never a traceback or a wrong number
(issue 15 #6, #7); head widths follow what transformers builds for each family."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from trainfit.arch import count_params, load_model
from trainfit.arch.catalog import catalog_config
from trainfit.arch.config import HEAD_DIM_DEFAULTS, HEADS_MUST_DIVIDE, spec_from_config
from trainfit.arch.spec import MAX_DIM, ModelSpec, MoESpec
from trainfit.errors import ConfigError, TrainfitError


def _write(tmp_path: Path, cfg: dict[str, Any]) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _llama(**changes: Any) -> dict[str, Any]:
    cfg = catalog_config("llama-3.2-1b") | {"num_hidden_layers": 2}
    for key, value in changes.items():
        if value is ...:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    return cfg


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"hidden_size": "big"}, "'hidden_size' must be a whole number, got \"big\""),
        ({"hidden_size": [1024]}, "got [1024]"),
        ({"hidden_size": 1024.5}, "got 1024.5"),  # was truncated to 1024
        ({"hidden_size": 2048.0}, "got 2048.0"),  # transformers' strict config refuses floats too
        ({"hidden_size": True}, "got true"),  # was int(True) == 1
        ({"hidden_size": 0}, "'hidden_size' must be at least 1"),
        ({"hidden_size": -64}, "must be at least 1"),
        ({"hidden_size": MAX_DIM + 1}, "at most"),
        ({"num_attention_heads": 0, "head_dim": ...}, "'num_attention_heads' must be at least 1"),  # ZeroDivisionError
        ({"num_attention_heads": 0}, "'num_attention_heads' must be at least 1"),
        ({"num_key_value_heads": 3}, "not a multiple of 3 key/value heads"),
        ({"vocab_size": None}, "vocab_size"),
        ({"intermediate_size": -1}, "'intermediate_size' must be at least 0"),
        ({"head_dim": 0}, "'head_dim' must be at least 1"),
        ({"tie_word_embeddings": "false"}, "'tie_word_embeddings' must be true or false"),  # bool("false") is True
        ({"tie_word_embeddings": 1}, "true or false"),
        ({"attention_dropout": 1.5}, "'attention_dropout' must be a number from 0 to 1"),
        ({"attention_dropout": True}, "attention_dropout"),
        ({"hidden_act": ["silu"]}, "'hidden_act' must be a string"),
        ({"model_type": ["llama"]}, "'model_type' must be a string"),  # was unhashable list -> TypeError
        ({"architectures": 7}, "'architectures' must be a list"),
        ({"max_position_embeddings": "long"}, "max_position_embeddings"),
        ({"sliding_window": -1}, "sliding_window"),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, changes: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_model(_write(tmp_path, _llama(**changes)))
    message = str(exc.value)
    assert needle in message and "\n" not in message


@pytest.mark.parametrize(("top_k", "needle"), [(0, "must be at least 1"), (9, "only 8 experts"), (2.0, "whole number")])
def test_experts_per_token_must_be_1_to_num_experts(tmp_path: Path, top_k: Any, needle: str) -> None:
    cfg = catalog_config("mixtral-8x7b-v0.1") | {"num_experts_per_tok": top_k}
    with pytest.raises(ConfigError, match="num_experts_per_tok") as exc:
        load_model(_write(tmp_path, cfg))
    assert needle in str(exc.value)


def test_deepseek_dense_prefix_longer_than_the_stack(tmp_path: Path) -> None:
    cfg = catalog_config("deepseek-v3") | {"first_k_dense_replace": 100}
    with pytest.raises(ConfigError, match="first_k_dense_replace"):
        load_model(_write(tmp_path, cfg))


@pytest.mark.parametrize("model_type", sorted(HEADS_MUST_DIVIDE))
def test_families_that_need_divisible_heads_refuse_1000_over_16(model_type: str) -> None:
    cfg = {
        "model_type": model_type,
        "hidden_size": 1000,
        "num_attention_heads": 16,
        "num_hidden_layers": 2,
        "vocab_size": 128,
        "intermediate_size": 64,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 16,
        "v_head_dim": 16,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
    }
    with pytest.raises(ConfigError, match=f"not divisible by 16 attention heads.*'{model_type}'"):
        spec_from_config(cfg, name="x", source="test")


def test_mistral_builds_floor_width_heads_like_transformers(tmp_path: Path) -> None:
    cfg = catalog_config("mistral-7b-v0.1") | {"hidden_size": 1000, "num_attention_heads": 16}
    cfg.pop("head_dim", None)
    spec = load_model(_write(tmp_path, cfg))
    assert spec.head_dim == 1000 // 16  # transformers: q_proj is 16 * 62 = 992 wide


def test_very_deep_config_loads_in_constant_time(tmp_path: Path) -> None:
    cfg = catalog_config("qwen2.5-0.5b") | {"num_hidden_layers": MAX_DIM, "use_sliding_window": True}
    start = time.perf_counter()
    spec = load_model(_write(tmp_path, cfg))  # used to build a per-layer list of 2**31 entries
    assert time.perf_counter() - start < 2
    assert spec.sliding_layers == MAX_DIM - cfg["max_window_layers"]


def test_falcon_refuses_head_dim_as_transformers_does() -> None:
    cfg = catalog_config("falcon-7b") | {"head_dim": 32}
    with pytest.raises(ConfigError, match="falcon configs cannot set 'head_dim'"):
        spec_from_config(cfg, name="x", source="test")


def test_model_spec_and_moe_spec_protect_the_library_api() -> None:
    base: dict[str, Any] = dict(
        name="x",
        source="test",
        model_type="llama",
        architecture="",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        intermediate_size=128,
        vocab_size=100,
    )
    ModelSpec(**base)
    for bad in ({"hidden_size": True}, {"num_layers": 2.0}, {"vocab_size": 0}, {"intermediate_size": -1}):
        with pytest.raises(ConfigError):
            ModelSpec(**(base | bad))
    with pytest.raises(ConfigError, match="multiple"):
        ModelSpec(**(base | {"num_kv_heads": 3}))
    with pytest.raises(ConfigError, match="params_override"):
        ModelSpec(**(base | {"params_override": 1.5}))
    with pytest.raises(ConfigError, match="cannot exceed"):
        MoESpec(num_experts=8, experts_per_token=9, expert_intermediate_size=16)
    with pytest.raises(ConfigError):
        MoESpec(num_experts=8, experts_per_token=0, expert_intermediate_size=16)


def test_catalog_and_fixtures_still_load() -> None:
    from trainfit.arch import catalog_slugs

    for slug in catalog_slugs():
        assert count_params(load_model(slug)) > 0
    for path in sorted((Path(__file__).parents[1] / "fixtures" / "configs").glob("*.json")):
        assert count_params(load_model(str(path))) > 0


# -- against transformers: what the modules really build ------------------------------------------------

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _meta_params(cfg: dict[str, Any]) -> int:
    cfg = dict(cfg)
    model_type = cfg.pop("model_type")
    conf = transformers.AutoConfig.for_model(model_type, **cfg)
    auto = transformers.AutoModelForMaskedLM if model_type == "bert" else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(conf)
    return sum(p.numel() for p in model.parameters())


def _tiny(model_type: str, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model_type": model_type,
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "num_hidden_layers": 2,
        "vocab_size": 128,
        "intermediate_size": 64,
        "pad_token_id": 0,
    }
    return cfg | extra


@pytest.mark.parametrize("model_type", sorted(HEAD_DIM_DEFAULTS))
def test_head_dim_default_of_the_config_class(model_type: str) -> None:
    """Qwen3/Gemma/Gemma-2 configs default head_dim to 128/256, not hidden/heads (was counted wrong)."""
    cfg = _tiny(model_type, num_key_value_heads=16)
    spec = spec_from_config(cfg, name="x", source="test")
    assert spec.head_dim == HEAD_DIM_DEFAULTS[model_type]
    assert count_params(spec) == _meta_params(cfg)


@pytest.mark.parametrize("model_type", ["gpt2", "opt", "gpt_neox", "bert"])
def test_head_dim_key_ignored_where_the_module_ignores_it(model_type: str) -> None:
    """GPT-2/OPT/NeoX/BERT always split hidden into heads; a stray head_dim key must not change the count."""
    cfg = _tiny(model_type, head_dim=32)
    native_mlp_key = {"gpt2": "n_inner", "opt": "ffn_dim"}.get(model_type)
    if native_mlp_key:  # the key these config classes read for the MLP width
        cfg[native_mlp_key] = cfg.pop("intermediate_size")
    assert count_params(spec_from_config(cfg, name="x", source="test")) == _meta_params(cfg)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "phi3", "phi", "starcoder2"])
def test_head_dim_key_honoured_where_the_module_uses_it(model_type: str) -> None:
    cfg = _tiny(model_type, head_dim=32, num_key_value_heads=16)
    assert count_params(spec_from_config(cfg, name="x", source="test")) == _meta_params(cfg)


def test_trace_turns_transformers_refusals_into_one_line_config_errors(tmp_path: Path) -> None:
    """A config trainfit reads but transformers refuses (unknown activation; bad rope parameters): the trace
    raises ConfigError on one line instead of a KeyError/StrictDataclass traceback."""
    from trainfit.strategy import Strategy
    from trainfit.trace import hf

    bad_act = load_model(_write(tmp_path, _llama(hidden_act="no_such_activation")))
    with pytest.raises(ConfigError, match="no_such_activation") as exc:
        hf.build_meta(bad_act, Strategy(), torch.float32)
    assert "\n" not in str(exc.value)
    bad_rope = load_model(_write(tmp_path, _llama(rope_scaling={"rope_type": "llama3", "factor": 8.0})))
    with pytest.raises(TrainfitError) as exc2:
        hf.build_meta(bad_rope, Strategy(), torch.float32)
    assert "\n" not in str(exc2.value)


def test_transformers_logging_is_quiet_during_construction_and_restored() -> None:
    from trainfit.trace import hf

    tf_logging = transformers.utils.logging
    before = tf_logging.get_verbosity()
    tf_logging.set_verbosity_warning()
    try:
        with hf.quiet_transformers():
            assert tf_logging.get_verbosity() == tf_logging.ERROR
        assert tf_logging.get_verbosity() == tf_logging.WARNING
    finally:
        tf_logging.set_verbosity(before)


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_deepseek_norm_topk_prob_default_is_the_config_class_default(model_type: str) -> None:
    """A DeepSeek config.json without ``norm_topk_prob`` renormalises the top-k weights as transformers' config
    class says (V3: ``True``, was ``False`` here); V2's modeling never reads the key, so its spec says False
    whatever the config says."""
    import inspect

    from transformers.models.deepseek_v2 import modeling_deepseek_v2

    cls = transformers.AutoConfig.for_model(model_type)
    assert "norm_topk_prob" not in inspect.getsource(modeling_deepseek_v2)
    cfg = catalog_config("deepseek-v3") | {"model_type": model_type, "num_hidden_layers": 4}
    cfg.pop("norm_topk_prob")
    spec = spec_from_config(cfg, name="x", source="test")
    assert spec.moe is not None
    assert spec.moe.norm_topk_prob is cls.norm_topk_prob
    reads_it = model_type == "deepseek_v3"
    for value in (True, False):
        spec = spec_from_config(cfg | {"norm_topk_prob": value}, name="x", source="test")
        assert spec.moe is not None and spec.moe.norm_topk_prob is (value and reads_it)

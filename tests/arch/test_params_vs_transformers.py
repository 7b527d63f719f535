"""Parameter counts equal those of the real transformers modules, built on the meta device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainfit.arch import catalog_slugs, count_params, load_model
from trainfit.arch.catalog import catalog_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FIXTURES = sorted((Path(__file__).parent.parent / "fixtures" / "configs").glob("*.json"))


def _meta_count(cfg: dict) -> int:
    cfg = {k: v for k, v in cfg.items() if k not in ("auto_map", "quantization_config")}
    model_type = cfg.get("model_type") or "gpt2"
    hf_cfg = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items() if k != "model_type"})
    auto = transformers.AutoModelForMaskedLM if model_type == "bert" else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(hf_cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("slug", catalog_slugs())
def test_catalog_param_count_matches_transformers(slug: str) -> None:
    assert count_params(load_model(slug)) == _meta_count(catalog_config(slug))


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_fixture_param_count_matches_transformers(path: Path) -> None:
    assert count_params(load_model(str(path))) == _meta_count(json.loads(path.read_text()))

"""torchtune_overrides.txt against torchtune itself: every ``key=value`` override names a key of each config torchtune
registers for ``full_finetune_single_device`` (or an argument of the component it sets), and every ``_component_``
resolves. torchtune is not a dependency: ``pip install --no-deps torchtune`` (0.6.1) runs these; without it they
skip. torchtune 0.6.1 does not import next to torchao 0.18 (``torchtune.modules.common_utils`` imports
``torchao.dtypes.nf4tensor``, which torchao moved), so its files are read as files: the configs as YAML, the
registry as a standalone module, its modules' sources parsed (``ast``) to resolve a ``torchtune.*`` path."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

from trainfit import load_model
from trainfit.export import export_plan
from trainfit.export.configs import TORCHTUNE_RECIPE, torchtune_overrides
from trainfit.strategy import MemorySavers, Strategy

yaml = pytest.importorskip("yaml")


def _package_dir(name: str) -> Path:
    """Where an installed top-level package lives, without running its ``__init__`` (find_spec of a top-level name
    imports nothing)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{name} is not installed (pip install --no-deps torchtune)")
    return Path(next(iter(spec.submodule_search_locations)))


def _recipe_configs(recipe: str) -> list[dict[str, Any]]:
    """The configs torchtune's registry (``torchtune/_recipe_registry.py``, dataclasses only) lists for ``recipe``,
    loaded from the wheel's ``recipes/configs``."""
    path = _package_dir("torchtune") / "_recipe_registry.py"
    spec = importlib.util.spec_from_file_location("_torchtune_recipe_registry", path)
    assert spec is not None and spec.loader is not None
    registry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(registry)
    (entry,) = (r for r in registry._ALL_RECIPES if r.name == recipe)
    root = _package_dir("recipes") / "configs"
    return [yaml.safe_load((root / c.file_path).read_text()) for c in entry.configs]


def _module_source(dotted: str) -> ast.Module | None:
    parts = dotted.split(".")
    base = _package_dir(parts[0]).joinpath(*parts[1:])
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return ast.parse(path.read_text())
    return None


def _defines(module: str, name: str, depth: int = 0) -> ast.stmt | None:
    """The statement of ``module``'s source that defines or imports ``name`` (a relative import is followed)."""
    tree = _module_source(module)
    if tree is None or depth > 5:
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef) and node.name == name:
            return node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            (alias,) = (a for a in node.names if (a.asname or a.name) == name)
            source = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1 packages
                anchor = module.split(".")
                if not (_package_dir(anchor[0]).joinpath(*anchor[1:]) / "__init__.py").is_file():
                    anchor = anchor[:-1]  # a plain module: its package
                anchor = anchor[: len(anchor) - (node.level - 1)]
                source = ".".join(anchor + ([node.module] if node.module else []))
            return _defines(source, alias.name, depth + 1)
    return None


def _torchtune_class(path: str) -> ast.ClassDef:
    module, _, name = path.rpartition(".")
    node = _defines(module, name)
    assert isinstance(node, ast.ClassDef), f"{path} does not resolve to a class in torchtune's sources"
    return node


def _resolves(path: str) -> None:
    if path.startswith("torchtune."):
        _torchtune_class(path)
        return
    module, _, name = path.rpartition(".")
    top = module.partition(".")[0]
    if importlib.util.find_spec(top) is None:
        pytest.skip(f"{top} is not installed: {path} not checked")
    assert hasattr(importlib.import_module(module), name), path


def _init_args(cls: ast.ClassDef) -> set[str]:
    (init,) = (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {a.arg for a in init.args.args + init.args.kwonlyargs}


def _saver_plan(**savers: Any) -> Strategy:
    oib = savers.get("optimizer_in_backward", False)
    return Strategy(precision="pure-bf16", optimizer="adamw-8bit", checkpointing="full", seq_len=4096,
                    micro_batch=4 if oib else 2, grad_accum=1 if oib else 2, savers=MemorySavers(**savers))  # fmt: skip


SAVERS = {
    "chunked": {"loss": "chunked"},
    "offload": {"activation_offload": True},
    "in-backward": {"optimizer_in_backward": True},
    "chunked+offload": {"loss": "chunked", "activation_offload": True},
    "chunked+in-backward": {"loss": "chunked", "optimizer_in_backward": True},
    "offload+in-backward": {"activation_offload": True, "optimizer_in_backward": True},
    "all three": {"loss": "chunked", "activation_offload": True, "optimizer_in_backward": True},
}


@pytest.mark.parametrize("name", sorted(SAVERS))
def test_every_override_is_a_key_of_the_recipes_configs(name: str) -> None:
    """Each override's dotted key is in every config torchtune registers for ``full_finetune_single_device``
    (Llama 2/3/3.1/3.2, Code Llama, Mistral, Phi-3/4, Qwen2/2.5), except an argument of the component the overrides
    set (``loss.num_output_chunks``: ``CEWithChunkedOutputLoss.__init__``) or a key the recipe reads with a default
    (``cfg.get``: Llama 3.2 Vision's config has no ``enable_activation_offloading``)."""
    tune = dict(o.split("=", 1) for o in export_plan(load_model("llama-3.1-8b"), _saver_plan(**SAVERS[name]))
                .torchtune_overrides)  # fmt: skip
    assert tune, name
    configs = _recipe_configs(TORCHTUNE_RECIPE)
    assert len(configs) >= 10
    recipe = (_package_dir("recipes") / f"{TORCHTUNE_RECIPE}.py").read_text()
    for cfg in configs:
        for key in tune:
            *parents, leaf = key.split(".")
            node = cfg
            for p in parents:
                node = node[p]
            if leaf not in node and not parents and re.search(rf'cfg\.get\(\s*"{key}"', recipe):
                continue  # optional: the recipe reads it with a default (Llama 3.2 Vision's config omits offloading)
            if leaf not in node:
                component = tune.get(".".join([*parents, "_component_"]))
                assert component is not None, f"{key}: not in the config and no component set with it"
                assert leaf in _init_args(_torchtune_class(component)), f"{key}: not an argument of {component}"
    for key, value in tune.items():
        if key.endswith("_component_"):
            _resolves(value)


def test_dtype_and_the_recipes_own_refusals() -> None:
    """The exported ``dtype`` is a key of torchtune's ``PRECISION_STR_TO_DTYPE`` (training/precision.py), and the
    overrides keep the rules the recipe's ``__init__`` raises on (recipes/full_finetune_single_device.py, 0.6.1):
    optimizer_in_bwd only without accumulation, activation offloading only with activation checkpointing."""
    tree = _module_source("torchtune.training.precision")
    assert tree is not None
    (table,) = (n for n in tree.body if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") ==
                "PRECISION_STR_TO_DTYPE")  # fmt: skip
    assert isinstance(table.value, ast.Dict)
    dtypes = {ast.literal_eval(k) for k in table.value.keys if k is not None}
    recipe = (_package_dir("recipes") / "full_finetune_single_device.py").read_text()
    assert "enable_activation_offloading should only be True when enable_activation_checkpointing is True" in recipe
    assert "Gradient accumulation is not supported with optimizer in bwd" in recipe
    for savers in SAVERS.values():
        tune = dict(o.split("=", 1) for o in torchtune_overrides(_saver_plan(**savers)))
        assert tune["dtype"] in dtypes
        if tune["optimizer_in_bwd"] == "True":
            assert tune["gradient_accumulation_steps"] == "1"
        if tune["enable_activation_offloading"] == "True":
            assert tune["enable_activation_checkpointing"] == "True"

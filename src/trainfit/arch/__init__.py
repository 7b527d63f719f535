"""WHAT is trained: ModelSpec from a catalog slug, a config.json, a Hub id or explicit numbers."""

from trainfit.arch.catalog import catalog_slugs
from trainfit.arch.loader import explicit_model, load_model
from trainfit.arch.params import count_params, inventory
from trainfit.arch.spec import ModelSpec

__all__ = ["ModelSpec", "catalog_slugs", "count_params", "explicit_model", "inventory", "load_model"]

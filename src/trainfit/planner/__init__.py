"""What to change to make a setup fit. Today: the fit verdict and its micro-batch search
(:mod:`trainfit.planner.search`); the ranked planner over parallelism, sharding, offload and savers
builds on the same types."""

from trainfit.planner.search import (
    DEFAULT_HEADROOM,
    MAX_SEARCH_BATCH,
    Suggestion,
    SuggestionKind,
    fit_verdict,
    max_micro_batch,
    required_bytes,
    suggestions,
)

__all__ = [
    "DEFAULT_HEADROOM",
    "MAX_SEARCH_BATCH",
    "Suggestion",
    "SuggestionKind",
    "fit_verdict",
    "max_micro_batch",
    "required_bytes",
    "suggestions",
]

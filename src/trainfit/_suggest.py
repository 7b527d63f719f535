"""Close-name suggestions for unknown identifiers (models, GPUs, recipes)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(name: str, choices: Iterable[str], n: int = 3) -> str:
    """Return ``" Did you mean: a, b?"`` or an empty string when nothing is close."""
    pool = list(choices)
    lowered = {c.lower(): c for c in pool}
    # Substring matches first: 'a100' -> 'a100-sxm-80gb', which difflib scores below 'a10'.
    subs = [c for c in pool if name.lower() in c.lower()]
    close = [lowered[c] for c in difflib.get_close_matches(name.lower(), list(lowered), n=n, cutoff=0.5)]
    picks = list(dict.fromkeys(subs + close))[:n]
    return f" Did you mean: {', '.join(picks)}?" if picks else ""

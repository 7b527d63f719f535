"""Close-name suggestions for unknown identifiers (models, GPUs, recipes)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(name: str, choices: Iterable[str], n: int = 3) -> str:
    """Return ``" Did you mean: a, b?"`` or an empty string when nothing is close."""
    pool = list(choices)
    lowered = {c.lower(): c for c in pool}
    close = difflib.get_close_matches(name.lower(), list(lowered), n=n, cutoff=0.5)
    # Substring matches catch 'a100' -> 'a100-sxm-80gb' that difflib scores low.
    subs = [c for c in pool if name.lower() in c.lower() and c.lower() not in close]
    picks = [lowered[c] for c in close] + subs[: max(0, n - len(close))]
    return f" Did you mean: {', '.join(picks)}?" if picks else ""

"""Byte units. Bytes are plain ``int`` everywhere; formatting and parsing happen only here.

GiB (2**30) is what GPUs and ``torch.cuda`` report and what our tables show, always labelled GiB.
GB (10**9) appears only where we reproduce the article's decimal arithmetic.
"""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
GB = 10**9


def gib(n_bytes: int | float) -> float:
    """Bytes → GiB as a float (for display and JSON convenience fields only)."""
    return n_bytes / GiB


def gb(n_bytes: int | float) -> float:
    """Bytes → decimal GB (the article's unit)."""
    return n_bytes / GB


def bytes_of_gib(n_gib: float) -> int:
    """``n_gib`` GiB as whole bytes (a ``--...-gib`` flag's value)."""
    return int(n_gib * GiB)


def fmt_gib(n_bytes: int | float, digits: int = 2) -> str:
    """Format bytes as ``'12.34 GiB'``."""
    return f"{n_bytes / GiB:.{digits}f} GiB"


def fmt_binary(n_bytes: int | float) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1: ``'20.00 MiB'``, ``'1.50 GiB'``."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n_bytes) >= size:
            return f"{n_bytes / size:.2f} {unit}"
    return f"{int(n_bytes)} B"


def fmt_gb(n_bytes: int | float, digits: int = 1) -> str:
    """Format bytes as decimal ``'12.3 GB'`` (article style)."""
    return f"{n_bytes / GB:.{digits}f} GB"


def round_up(n_bytes: int, block: int) -> int:
    """Round ``n_bytes`` up to a multiple of ``block`` (e.g. the caching allocator's 512 bytes)."""
    if n_bytes <= 0:
        return 0
    return -(-n_bytes // block) * block


def fmt_count(n: int) -> str:
    """Human count: 6.74B, 124.4M, 12.3K."""
    for div, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}"
    return str(n)

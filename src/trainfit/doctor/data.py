"""Scan the batches for NaN/Inf, values beyond the chosen format's range and outlier batches (check 4).

A batch is walked recursively (tensors inside tuples, lists, dicts); only floating-point tensors are
inspected (token ids cannot be NaN). An *outlier batch* is one whose largest magnitude is more than
``outlier_ratio`` (100×) the median of the batches' largest magnitudes — a cheap, scale-free test that
finds the one corrupted or unnormalised batch among normal ones.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainfit.precision.formats import FloatFormat, json_float


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``obj`` (tensors, tuples, lists, mappings — dicts, model outputs, a tokenizer's
    ``BatchEncoding``, which is a ``UserDict``)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from iter_tensors(v)


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchScan:
    index: int
    float_values: int
    nan: int
    inf: int
    beyond_format: int  # finite values a cast to the format would overflow
    absmax: float
    outlier: bool

    @property
    def clean(self) -> bool:
        return self.nan == 0 and self.inf == 0 and self.beyond_format == 0 and not self.outlier

    def to_json(self) -> dict[str, object]:
        return {
            "batch": self.index,
            "float_values": self.float_values,
            "nan": self.nan,
            "inf": self.inf,
            "beyond_format": self.beyond_format,
            "absmax": json_float(self.absmax),
            "outlier": self.outlier,
        }


def scan_batches(batches: Sequence[Any], fmt: FloatFormat, *, outlier_ratio: float = 100.0) -> list[BatchScan]:
    rows: list[tuple[int, int, int, int, int, float]] = []
    for i, batch in enumerate(batches):
        n = nan = inf = beyond = 0
        absmax = 0.0
        for t in iter_tensors(batch):
            if not t.is_floating_point():
                continue
            t = t.detach()
            n += t.numel()
            nan += int(torch.isnan(t).sum())
            inf += int(torch.isinf(t).sum())
            finite = t[torch.isfinite(t)].abs().float()
            if finite.numel():
                absmax = max(absmax, float(finite.max()))
                beyond += int((finite >= fmt.overflow_threshold).sum())
        rows.append((i, n, nan, inf, beyond, absmax))
    maxima = [r[5] for r in rows if r[1] > 0]
    median = statistics.median(maxima) if len(maxima) >= 3 else None
    out = []
    for i, n, nan, inf, beyond, absmax in rows:
        outlier = bool(median is not None and median > 0 and absmax > outlier_ratio * median)
        out.append(
            BatchScan(index=i, float_values=n, nan=nan, inf=inf, beyond_format=beyond, absmax=absmax, outlier=outlier)
        )
    return out

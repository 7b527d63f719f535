"""The caching allocator's settings, parsed from a ``PYTORCH_CUDA_ALLOC_CONF`` string.

PyTorch lexes the string into tokens split at ``,``, ``:``, ``[`` and ``]`` (spaces dropped) and reads
``key:value`` pairs separated by commas (``AllocatorConfig::lexArgs`` / ``parseArgs`` in
c10/core/AllocatorConfig.cpp). We follow the same grammar and the same validity checks, and keep only what
changes device memory:

* ``large_segment_size_mb`` (> 10, the ``kMinLargeAlloc`` in MiB; default 20; ``parseLargeSegmentSize``, torch
  2.13's ``AcceleratorAllocatorConfig::large_segment_size``, which replaced the ``kLargeBuffer`` constant): the
  segment a 1–10 MiB request gets (``get_allocation_size``) and the page of a large-pool expandable segment;
* ``max_split_size_mb`` (≥ the large segment size in MiB as parsed so far, 20 by default;
  ``parseMaxSplitSize``): blocks this large are never split and never serve smaller requests;
* ``max_non_split_rounding_mb`` (≥ the same floor; ``parseMaxNonSplitRoundingSize``): how much larger than an
  oversize request a cached oversize block may be (default 20 MiB: the constructor's ``large_segment_size_``,
  which a later ``large_segment_size_mb`` does not change);
* ``roundup_power2_divisions`` (a power of two, or ``[MiB:divisions, ..., >:divisions]``;
  ``parseRoundUpPower2Divisions``): sixteen size intervals from 1 MiB to 64 GiB, one per power of two. In a
  list, a key of k MiB sets interval log2(k) (capped at 15), the first key also every interval below it, and
  ``>`` every interval *after* the last key (``last_index + 1`` onwards: ``[256:1,512:2,1024:4,>:8]`` gives
  1–2 GiB requests 4 divisions and 8 from 2 GiB). That is torch 2.13's ``AcceleratorAllocatorConfig``
  (c10/core/AllocatorConfig.cpp; checked by parsing strings with torch 2.13.0's own libc10, git cf30153c);
  ``CUDAAllocatorConfig::parseRoundUpPower2Divisions`` in c10/cuda/CUDAAllocatorConfig.cpp of torch <= 2.9
  filled from ``last_index`` itself, so there ``>:8`` overwrote the 1024 MiB entry. The change probably came with
  pytorch/pytorch#165304 ("Fix AllocatorConfig parse roundup division bug", Oct 2025: torch 2.10); we model
  the new rule, which torch 2.11 (the measuring device) and 2.13 share if so;
* ``garbage_collection_threshold`` (in (0, 1); ``parseGarbageCollectionThreshold``), only active together
  with a memory fraction (``set_fraction`` in ``DeviceCachingAllocator::malloc``);
* ``expandable_segments`` (``True``/``False``);
* ``backend`` (``native`` or ``cudaMallocAsync``: the simulator models the native one only).

Options without a device-memory effect (``release_lock_on_cudamalloc``, the ``pinned_*`` host options) are
accepted and ignored. Anything else is an :class:`AllocatorConfigError` with a one-line message, as PyTorch
raises at start-up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import StrEnum

from trainfit.errors import TrainfitError

MIB = 1024 * 1024
#: ``kLargeBuffer`` (c10/cuda/CUDACachingAllocator.cpp), since torch 2.13 the default ``large_segment_size_``
#: (c10/core/AllocatorConfig.h): the default floor of ``max_split_size_mb`` and ``max_non_split_rounding_mb``.
LARGE_BUFFER_BYTES = 20 * MIB
#: ``kMinLargeAlloc``: ``large_segment_size_mb`` must exceed it (``parseLargeSegmentSize``).
MIN_LARGE_ALLOC_BYTES = 10 * MIB
#: ``kRoundUpPowerOfTwoIntervals`` (c10/core/AllocatorConfig.cpp): intervals 1 MiB, 2 MiB, ... 32 GiB+.
ROUNDUP_INTERVALS = 16
_ROUNDUP_START_LOG2 = 20  # kRoundUpPowerOfTwoStart = 1 MiB


class AllocatorConfigError(TrainfitError):
    """A ``PYTORCH_CUDA_ALLOC_CONF`` string PyTorch would refuse."""


class Backend(StrEnum):
    NATIVE = "native"
    CUDA_MALLOC_ASYNC = "cudaMallocAsync"


_BOOL_OPTIONS = {
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "pinned_use_background_threads",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocatorConfig:
    """The allocator settings that shape reserved memory (defaults: PyTorch's defaults)."""

    #: ``large_segment_size``: the segment of a 1–10 MiB request and the large-pool expandable page.
    large_segment_size_bytes: int = LARGE_BUFFER_BYTES
    #: ``None``: no limit (PyTorch's ``SIZE_MAX``).
    max_split_size_bytes: int | None = None
    max_non_split_rounding_bytes: int = LARGE_BUFFER_BYTES
    #: One entry per interval (index = log2(size) − 20, clamped to 0..15); 0 or 1 means plain 512 B rounding.
    roundup_power2_divisions: tuple[int, ...] = field(default=(0,) * ROUNDUP_INTERVALS)
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    backend: Backend = Backend.NATIVE

    def __post_init__(self) -> None:
        # the parser applies PyTorch's order-dependent floors; here only what holds in any order
        if self.large_segment_size_bytes <= MIN_LARGE_ALLOC_BYTES or self.large_segment_size_bytes % MIB:
            raise AllocatorConfigError("large_segment_size must be a whole number of MiB above 10 MiB")
        floor = min(LARGE_BUFFER_BYTES, self.large_segment_size_bytes)
        if self.max_split_size_bytes is not None and self.max_split_size_bytes < floor:
            raise AllocatorConfigError(f"max_split_size must be at least {floor >> 20} MiB")
        if self.max_non_split_rounding_bytes < floor:
            raise AllocatorConfigError(f"max_non_split_rounding must be at least {floor >> 20} MiB")
        if len(self.roundup_power2_divisions) != ROUNDUP_INTERVALS:
            raise AllocatorConfigError(f"roundup_power2_divisions needs {ROUNDUP_INTERVALS} intervals")
        for d in self.roundup_power2_divisions:
            if d < 0 or (d and d & (d - 1)):
                raise AllocatorConfigError(f"roundup_power2_divisions: {d} is not 0 or a power of 2")
        if not 0.0 <= self.garbage_collection_threshold < 1.0:
            raise AllocatorConfigError("garbage_collection_threshold must be in (0.0, 1.0)")

    @property
    def max_split_bytes(self) -> int:
        """``max_split_size`` as the source compares it (``SIZE_MAX`` when unset)."""
        return (1 << 64) - 1 if self.max_split_size_bytes is None else self.max_split_size_bytes

    def divisions_for(self, size_bytes: int) -> int:
        """``AllocatorConfig::roundup_power2_divisions(size)``: the interval of size's power of two."""
        index = size_bytes.bit_length() - 1 - _ROUNDUP_START_LOG2
        index = min(max(index, 0), ROUNDUP_INTERVALS - 1)
        return self.roundup_power2_divisions[index]

    @classmethod
    def parse(cls, conf: str | None) -> AllocatorConfig:
        """Parse a ``PYTORCH_CUDA_ALLOC_CONF`` string (``None`` or empty: the defaults)."""
        return _Parser(conf or "").parse()

    def to_env(self) -> str:
        """The settings that differ from PyTorch's defaults, as ``PYTORCH_CUDA_ALLOC_CONF`` spells them ("" for
        the defaults); :meth:`parse` reads the string back to an equal config."""
        default = AllocatorConfig()
        parts = []
        large = ""
        if self.large_segment_size_bytes != default.large_segment_size_bytes:
            large = f"large_segment_size_mb:{self.large_segment_size_bytes >> 20}"
        # the large segment size is the floor the split options are checked against once it is parsed
        # (parseMaxSplitSize): first when they respect it, else last
        below = min(self.max_split_bytes, self.max_non_split_rounding_bytes) < self.large_segment_size_bytes
        if large and not below:
            parts.append(large)
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.max_split_size_bytes is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size_bytes >> 20}")
        if self.max_non_split_rounding_bytes != default.max_non_split_rounding_bytes:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding_bytes >> 20}")
        if self.roundup_power2_divisions != default.roundup_power2_divisions:
            parts.append(f"roundup_power2_divisions:{_divisions_text(self.roundup_power2_divisions)}")
        if self.garbage_collection_threshold:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold}")
        if self.backend is not default.backend:
            parts.append(f"backend:{self.backend.value}")
        if large and below:
            parts.append(large)
        return ",".join(parts)

    @classmethod
    def from_env(cls) -> AllocatorConfig:
        """The settings of this process's ``PYTORCH_CUDA_ALLOC_CONF`` (falling back to ``PYTORCH_ALLOC_CONF``)."""
        return cls.parse(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF")))


def _lex(conf: str) -> list[str]:
    tokens: list[str] = []
    buf: list[str] = []
    for ch in conf:
        if ch in ",:[]":
            if buf:
                tokens.append("".join(buf))
                buf = []
            tokens.append(ch)
        elif ch != " ":
            buf.append(ch)
    if buf:
        tokens.append("".join(buf))
    return tokens


def _divisions_text(divisions: tuple[int, ...]) -> str:
    """``roundup_power2_divisions`` as PyTorch reads it back: one value when every interval has it, else every
    interval spelled by its power of two in MiB (``[1:d,2:d,...,32768:d]``; a key's interval is its log2,
    capped at the last: ``parseRoundUpPower2Divisions``)."""
    if len(set(divisions)) == 1:
        return str(divisions[0])
    return "[" + ",".join(f"{1 << k}:{d}" for k, d in enumerate(divisions)) + "]"


def _is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


class _Parser:
    def __init__(self, conf: str) -> None:
        self.conf = conf
        self.tok = _lex(conf)
        self.i = 0

    def fail(self, why: str) -> AllocatorConfigError:
        return AllocatorConfigError(f"PYTORCH_CUDA_ALLOC_CONF={self.conf!r}: {why}")

    def expect(self, ch: str) -> None:
        self.i += 1
        if self.i >= len(self.tok) or self.tok[self.i] != ch:
            raise self.fail(f"expected {ch!r}")

    def value(self, name: str) -> str:
        self.expect(":")
        self.i += 1
        if self.i >= len(self.tok) or self.tok[self.i] in ",:[]":
            raise self.fail(f"expected a value for {name}")
        return self.tok[self.i]

    def integer(self, text: str, name: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise self.fail(f"{name}: {text!r} is not an integer") from None

    def parse(self) -> AllocatorConfig:
        max_split: int | None = None
        large_segment = LARGE_BUFFER_BYTES
        non_split = LARGE_BUFFER_BYTES
        divisions = [0] * ROUNDUP_INTERVALS
        gc = 0.0
        expandable = False
        backend = Backend.NATIVE
        while self.i < len(self.tok):
            key = self.tok[self.i]
            if key == "large_segment_size_mb":
                mb = self.integer(self.value(key), key)
                if mb <= MIN_LARGE_ALLOC_BYTES // MIB:
                    raise self.fail("large_segment_size_mb must be > 10 MB")
                large_segment = mb * MIB
            elif key == "max_split_size_mb":
                mb = self.integer(self.value(key), key)
                if mb < large_segment // MIB:
                    raise self.fail(f"max_split_size_mb too small, must be >= {large_segment // MIB}")
                max_split = mb * MIB
            elif key == "max_non_split_rounding_mb":
                mb = self.integer(self.value(key), key)
                if mb < large_segment // MIB:
                    raise self.fail(f"max_non_split_rounding_mb too small, must be >= {large_segment // MIB}")
                non_split = mb * MIB
            elif key == "garbage_collection_threshold":
                text = self.value(key)
                try:
                    gc = float(text)
                except ValueError:
                    raise self.fail(f"garbage_collection_threshold: {text!r} is not a number") from None
                if not 0.0 < gc < 1.0:
                    raise self.fail("garbage_collection_threshold must be in (0.0, 1.0)")
            elif key == "roundup_power2_divisions":
                divisions = self.divisions()
            elif key == "expandable_segments":
                expandable = self.boolean(key)
            elif key == "backend":
                text = self.value(key)
                if text not in (Backend.NATIVE.value, Backend.CUDA_MALLOC_ASYNC.value):
                    raise self.fail("unknown allocator backend, options are native and cudaMallocAsync")
                backend = Backend(text)
            elif key in _BOOL_OPTIONS:
                self.boolean(key)
            elif key == "pinned_num_register_threads":
                n = self.integer(self.value(key), key)
                if not _is_pow2(n):
                    raise self.fail("pinned_num_register_threads must be a power of 2")
            else:
                raise self.fail(f"unrecognized option {key!r}")
            if self.i + 1 < len(self.tok):
                self.expect(",")
            self.i += 1
        return AllocatorConfig(
            large_segment_size_bytes=large_segment,
            max_split_size_bytes=max_split,
            max_non_split_rounding_bytes=non_split,
            roundup_power2_divisions=tuple(divisions),
            garbage_collection_threshold=gc,
            expandable_segments=expandable,
            backend=backend,
        )

    def boolean(self, name: str) -> bool:
        text = self.value(name)
        if text not in ("True", "False"):
            raise self.fail(f"expected True or False for {name}")
        return text == "True"

    def divisions(self) -> list[int]:
        name = "roundup_power2_divisions"
        self.expect(":")
        self.i += 1
        if self.i >= len(self.tok):
            raise self.fail(f"expected a value for {name}")
        out = [0] * ROUNDUP_INTERVALS
        if self.tok[self.i] != "[":
            d = self.integer(self.tok[self.i], name)
            if not _is_pow2(d):
                raise self.fail("roundup_power2_divisions must be a power of 2")
            return [d] * ROUNDUP_INTERVALS
        first = True
        last_index = 0
        while True:
            self.i += 1
            if self.i >= len(self.tok):
                raise self.fail("unterminated roundup_power2_divisions list")
            if self.tok[self.i] == "]":
                return out
            interval = self.tok[self.i]
            d = self.integer(self.value(name), name)
            if d != 0 and not _is_pow2(d):
                raise self.fail("roundup_power2_divisions must be 0 or a power of 2")
            if interval == ">":
                # the intervals after the last one named (torch 2.13; torch <= 2.9 began at it: module doc)
                for k in range(last_index + 1, ROUNDUP_INTERVALS):
                    out[k] = d
            else:
                mb = self.integer(interval, name)
                if not _is_pow2(mb):
                    raise self.fail("roundup_power2_divisions intervals must be powers of 2 (MiB)")
                index = min(mb.bit_length() - 1, ROUNDUP_INTERVALS - 1)
                if first:
                    for k in range(index):
                        out[k] = d
                    first = False
                out[index] = d
                last_index = index
            if self.i + 1 < len(self.tok) and self.tok[self.i + 1] != "]":
                self.expect(",")

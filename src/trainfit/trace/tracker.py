"""Live-storage accounting for a traced training step, as the CUDA caching allocator would see it.

A ``TorchDispatchMode`` sits below autograd and autocast, so every tensor an operator creates passes
through it, including the ones autograd creates in backward and the casts autocast inserts. For each new
*storage* (views share one) we keep a record: size rounded up to 512 bytes (``kMinBlockSize`` in
``c10/cuda/CUDACachingAllocator.cpp``, the granularity ``torch.cuda.max_memory_allocated`` counts in),
the event number at which it appeared and the one at which its last reference died (a weakref callback on
the storage), and the context it was born in: phase, step, module, whether inside the loss/head region or
an activation-checkpoint recomputation. Every allocation and every free is one event, so "live bytes after
event e" is an exact timeline; phase and region peaks are maxima over slices of it.

Categories are assigned after the run, once each storage's fate is known. Explicit marks win (parameters →
weights or master weights, ``.grad`` → gradients, optimizer state → optimizer states, a ``_to_copy`` of a
parameter → autocast copies, model outputs → logits/loss). Otherwise a storage born in the head/loss region
is logits/loss; one born in the forward pass (or in a recomputation) that is still alive when that pass
ends is an activation, i.e. held for backward; everything else is a temporary. This is the
``torch.distributed._tools.mem_tracker.MemTracker`` idea (categories by reference type, 512-byte rounding)
with fate-based activation accounting and an event log instead of running snapshots, which makes the
breakdown at the peak exact rather than attributed on the fly.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from trainfit.cuda_facts import ALLOCATOR_BLOCK_BYTES, allocator_bytes
from trainfit.result import Component
from trainfit.trace.timeline import Interval as Interval  # re-exported: the tracker computes their peaks
from trainfit.trace.timeline import Peak as Peak

L = TypeVar("L")

#: Allocation granularity of the CUDA caching allocator (one fact in trainfit.cuda_facts).
ALLOC_GRANULARITY_BYTES = ALLOCATOR_BLOCK_BYTES

# Explicit kinds (set by marks); NONE means "decide by fate".
NONE, WEIGHTS, MASTER, GRAD, OPT, AUTOCAST, LOGITS, HOST, MERGED = range(9)
_KIND_COMPONENT = {
    WEIGHTS: Component.WEIGHTS,
    MASTER: Component.MASTER_WEIGHTS,
    GRAD: Component.GRADIENTS,
    OPT: Component.OPTIMIZER_STATES,
    AUTOCAST: Component.AUTOCAST_COPIES,
    LOGITS: Component.LOGITS_LOSS,
}

# Phases in which a storage can be born.
SETUP, FORWARD, BACKWARD, OPTIMIZER = "setup", "forward", "backward", "optimizer-step"

COMPONENTS: tuple[Component, ...] = tuple(Component)
_COMP_INDEX = {c: i for i, c in enumerate(COMPONENTS)}


rounded = allocator_bytes


@dataclass(slots=True)
class Record:
    """One storage's life."""

    nbytes: int
    alloc_t: int
    phase: str
    step: int  # the forward/backward pass (micro-step) counter of the runner
    head: bool
    recompute: int  # index into Tracker.recompute_ends, -1 if not born in a recomputation
    owner: str
    op: str
    kind: int = NONE
    free_t: int | None = None


class Tracker(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records every storage created while active (see module docstring)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.t = 0
        self.records: list[Record] = []
        self._info: Any = WeakIdKeyDictionary()
        self.phase = SETUP
        self.step = 0
        self.head_depth = 0
        self.bwd_head = False
        self.recompute = -1
        self.recompute_ends: list[int | None] = []
        self.module_stack: list[str] = []
        self.forward_end: dict[int, int] = {}  # pass -> event at which its forward ended
        self.accumulations: list[tuple[Record, Record]] = []
        self._merged = False
        self._frozen = False  # set by the first reader: no more ticks (:meth:`_freed`)
        self._to_copy = torch.ops.aten._to_copy.default
        self._add = torch.ops.aten.add.Tensor

    # -- bookkeeping -------------------------------------------------------------------------------
    def _tick(self) -> int:
        self.t += 1
        return self.t

    def _freed(self, rec: Record, _ref: object) -> None:
        # Once the run is read (:meth:`merge_inplace_accumulations`, which every reader calls first) its ticks are
        # final: a storage the garbage collector frees later — a fake tensor of this run in a reference cycle,
        # collected while another trace runs or while the readers themselves allocate — stays alive to the end
        # rather than taking a tick past the arrays the readers sized by ``t`` (an IndexError in
        # trace.events ``_raw_events``, benchmarks/reserve_agreement.py --savers, 2026-12-04).
        if not self._frozen:
            rec.free_t = self._tick()

    def _record(self, st: torch.UntypedStorage, op: str) -> Record | None:
        entry = self._info.get(st)
        if entry is not None:
            rec: Record = entry[0]
            return rec
        nbytes = rounded(st.nbytes())
        if nbytes == 0:
            return None
        rec = Record(
            nbytes=nbytes,
            alloc_t=self._tick(),
            phase=self.phase,
            step=self.step,
            head=self.head_depth > 0 or (self.phase == BACKWARD and self.bwd_head),
            recompute=self.recompute,
            owner=self.module_stack[-1] if self.module_stack else "",
            op=op,
        )
        self.records.append(rec)
        ref = weakref.ref(st, functools.partial(self._freed, rec))
        self._info[st] = (rec, ref)
        return rec

    def record_of(self, t: torch.Tensor) -> Record | None:
        entry = self._info.get(t.untyped_storage())
        return None if entry is None else entry[0]

    def mark(self, tensors: Iterable[torch.Tensor | None], kind: int, *, only_unmarked: bool = False) -> None:
        """Give storages an explicit kind (tracking them now if they were created outside the mode)."""
        for t in tensors:
            if t is None:
                continue
            rec = self._record(t.untyped_storage(), "external")
            if rec is not None and not (only_unmarked and rec.kind != NONE):
                rec.kind = kind

    # -- the dispatch hook -------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = func.__name__
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                rec = self._record(t.untyped_storage(), name)
                if rec is None or rec.alloc_t != self.t:
                    continue
                if func is self._to_copy and rec.kind == NONE:
                    src = self.record_of(args[0])
                    if src is not None and src.kind in (WEIGHTS, MASTER) and args[0].dtype != t.dtype:
                        rec.kind = AUTOCAST
                elif func is self._add and self.phase == BACKWARD and len(args) == 2 and not kwargs:
                    self._maybe_accumulation(rec, t, args)
        return out

    def _maybe_accumulation(self, rec: Record, out: torch.Tensor, args: Sequence[Any]) -> None:
        old, new = args  # InputBuffer computes ``old_var + var``
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)):
            return
        if old.shape != out.shape or new.shape != out.shape or old.dtype != out.dtype or new.dtype != out.dtype:
            return
        if old._is_view() or not old.is_contiguous():
            return
        r_old = self.record_of(old)
        if r_old is not None:
            self.accumulations.append((rec, r_old))

    def merge_inplace_accumulations(self) -> int:
        """Replay autograd's in-place gradient accumulation, which fake tensors do not get.

        When two gradients meet in autograd's ``InputBuffer`` (a residual join, a tensor read twice),
        ``accumulate`` in torch/csrc/autograd/input_buffer.cpp adds the new one into the buffered one in
        place if the buffer holds its last reference — unless tensors are subclass-like
        (``can_accumulate_inplace``), which FakeTensor is, and which every tensor is while any dispatch mode
        is active (``isTensorSubclassLike`` checks ``dispatch_mode_enabled()``; this also perturbs
        ``MemTracker``). So under the trace every join allocates ``old + new`` while both are alive. We find
        those adds (backward, same shape and dtype, a first operand that is a contiguous non-view tensor
        whose last reference dies right after) and let the result take over that operand's storage.
        Checked against real CPU runs measured by ``torch.profiler(profile_memory=True)``: gradients
        fresh from a kernel are accumulated in place (``add_``), while one that arrives as a view (a
        weight read through ``.t()``, e.g. a tied ``lm_head``) is added out of place. Returns how many
        were merged.
        """
        self._frozen = True
        if self._merged:
            return 0
        self._merged = True
        n = 0
        alias: dict[int, Record] = {}
        for out, r_old in self.accumulations:
            inp = alias.get(id(r_old), r_old)
            if inp.free_t is not None and out.alloc_t < inp.free_t <= out.alloc_t + 2 and inp.nbytes == out.nbytes:
                inp.free_t = out.free_t
                if out.kind != NONE:
                    inp.kind = out.kind
                out.kind = MERGED
                alias[id(out)] = inp
                n += 1
        return n

    # -- recompute regions -------------------------------------------------------------------------
    def begin_recompute(self) -> int:
        self.recompute_ends.append(None)
        self.recompute = len(self.recompute_ends) - 1
        return self.recompute

    def end_recompute(self, idx: int) -> None:
        self.recompute_ends[idx] = self.t
        self.recompute = -1

    # -- analysis ----------------------------------------------------------------------------------
    def component(self, rec: Record) -> Component | None:
        """Final category of a storage (``None``: not device memory, e.g. host-side optimizer steps)."""
        if rec.kind in (HOST, MERGED):
            return None
        if rec.kind != NONE:
            return _KIND_COMPONENT[rec.kind]
        if rec.head:
            return Component.LOGITS_LOSS
        if rec.phase == FORWARD:
            end = self.forward_end.get(rec.step)
            if end is None or rec.free_t is None or rec.free_t > end:
                return Component.ACTIVATIONS
            return Component.TEMPORARIES
        if rec.recompute >= 0:
            end = self.recompute_ends[rec.recompute]
            if end is None or rec.free_t is None or rec.free_t > end:
                return Component.ACTIVATIONS
        return Component.TEMPORARIES

    def _events(self) -> tuple[list[int], list[int]]:
        """Signed byte delta and component index of each event 1..t (index 0 is the empty start)."""
        self.merge_inplace_accumulations()
        n = self.t + 1
        delta = [0] * n
        comp = [0] * n
        for rec in self.records:
            c = self.component(rec)
            if c is None:
                continue
            ci = _COMP_INDEX[c]
            delta[rec.alloc_t] += rec.nbytes
            comp[rec.alloc_t] = ci
            if rec.free_t is not None:
                delta[rec.free_t] -= rec.nbytes
                comp[rec.free_t] = ci
        return delta, comp

    def peaks(self, intervals: Sequence[Interval[L]]) -> list[Peak[L]]:
        """The state of maximum live bytes inside each interval, with its breakdown by component."""
        delta, comp = self._events()
        totals = [0] * len(delta)
        run = 0
        for e, d in enumerate(delta):
            run += d
            totals[e] = run
        chosen: list[tuple[Interval[L], int]] = []
        for iv in intervals:
            lo, hi = max(0, iv.start), min(iv.end, len(totals) - 1)
            if hi < lo:
                continue
            best = max(range(lo, hi + 1), key=totals.__getitem__)
            chosen.append((iv, best))
        wanted = sorted({e for _, e in chosen})
        sums = [0] * len(COMPONENTS)
        snap: dict[int, list[int]] = {}
        w = 0
        for e, d in enumerate(delta):
            if w >= len(wanted):
                break
            sums[comp[e]] += d
            while w < len(wanted) and wanted[w] == e:
                snap[e] = list(sums)
                w += 1
        out: list[Peak[L]] = []
        for iv, e in chosen:
            parts = {c: snap[e][i] for i, c in enumerate(COMPONENTS)}
            out.append(Peak(label=iv.label, event=e, total_bytes=totals[e], components=parts))
        return out

    def live_at(self, event: int, predicate: Callable[[Record], bool] | None = None) -> list[Record]:
        """Records alive after ``event`` (optionally filtered)."""
        out = []
        for rec in self.records:
            alive = rec.alloc_t <= event and (rec.free_t is None or rec.free_t > event)
            if alive and (predicate is None or predicate(rec)):
                out.append(rec)
        return out


def storages_of(objs: Iterable[Any]) -> list[torch.Tensor]:
    """Tensors found in (possibly nested) containers."""
    return [t for t in tree_leaves(list(objs)) if isinstance(t, torch.Tensor)]

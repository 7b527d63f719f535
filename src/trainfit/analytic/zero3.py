"""DeepSpeed ZeRO-3's gathered parameters, moment by moment: a replay of its parameter coordinator. Torch-free.

Stage 3 keeps each parameter partitioned and all-gathers it whole before the module that owns it runs
(deepspeed/runtime/zero/partitioned_param_coordinator.py ``PartitionedParameterCoordinator``). What is
gathered at a moment is not a closed form of the depth: after the first step the coordinator has recorded
the order in which modules run (forward, then backward, with any recomputation) and, in every later step,

* **fetches** the module about to run — one coalesced all-gather into a flat buffer of W partitions, from
  which each parameter is copied whole (partition_parameters.py ``_all_gather_dtype``;
  ``AllGatherCoalescedHandle.wait``: ``torch.cat(partitions)``); the flat buffer lives as long as a handle
  to it is held, i.e. until the last of its parameters has been waited on;
* **prefetches** the next parameters of the recorded order that are not gathered, up to
  ``stage3_prefetch_bucket_size`` elements (the last one crossing it) and never past
  ``stage3_max_live_parameters`` gathered elements (``_fetch_sub_module_impl``);
* **releases** a module's parameters after it ran (``release_sub_module``) unless they are persistent
  (``ds_numel <= stage3_param_persistence_threshold``, partition_parameters.py ``_convert_to_deepspeed_param``),
  a prefetch scan already passed a later use of them, or they are used again within
  ``stage3_max_reuse_distance`` elements of the recorded order (``__params_to_release``) — which keeps the
  last layers gathered from the end of the forward into the backward.

A prefetch bucket larger than the model (DeepSpeed's default 5e7 elements on a small one) gathers every
partitioned parameter in the first module's prefetch, as one handle: its first wait copies them all out whole,
and its flat buffer stays until the last of them (the LM head) is fetched, so the forward holds the model twice
until the head (``FORWARD_FINAL_NORM``, the analytic model's moment inside the final norm; −5.7% in forward
against the trace before that moment existed, −0.3% with it).

With ZeRO-Infinity (``offload_param``) the partitions are the host's, and each fetch first copies the fetched
parameters' partitions to the device (the all-gather's input), freed once they are in the flat buffer: a
transient of 1/W of the flat buffer — as much again at one rank. The trace cannot show it (on DeepSpeed's CPU
accelerator ``.to(device)`` of a host tensor returns it); the replay follows DeepSpeed's source.

This module replays that algorithm on the module order of a Hugging Face decoder built from the parameter
inventory (embedding; per layer the input norm, q/k/v/o, the second norm, the MLP; final norm; head; the
backward in reverse, a checkpointed segment recomputed before its backward) and reads the gathered bytes at
the analytic model's moments. Checked against the real engine traced on fake tensors
(:mod:`trainfit.trace.deepspeed`).
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from trainfit._memo import Memo, spec_key
from trainfit.analytic.activations import input_grads_enabled
from trainfit.analytic.adapters import frozen_layers
from trainfit.analytic.model import MomentName
from trainfit.arch.params import inventory
from trainfit.arch.spec import ModelSpec
from trainfit.cuda_facts import allocator_bytes
from trainfit.strategy import Strategy

#: DeepSpeed's ``stage3_param_persistence_threshold`` default (deepspeed/runtime/zero/config.py).
PERSISTENCE_THRESHOLD = 100_000


@dataclass(frozen=True, slots=True)
class _Param:
    numel: int
    persist: bool


@dataclass(frozen=True, slots=True)
class _Step:
    """One entry of the recorded module order: the module's parameters (indices), and where it runs."""

    params: tuple[int, ...]
    where: str  # "fwd" | "head" | "bwd-head" | "bwd-norm" | "bwd-L<i>" | "rec-L<i>" | "bwd-embed" | ...
    forward: bool


Module = tuple[int, ...]  # the parameters (indices) a module holds itself


@dataclass(frozen=True, slots=True)
class _Block:
    """A container module (attention, MLP) and the modules it runs, in order."""

    children: list[Module]


def _module_key(name: str) -> str:
    return name.rsplit(".", 1)[0]


def _layer_rank(key: str) -> int:
    for i, prefix in enumerate(("norm1", "attn", "norm2", "mlp")):
        if key.startswith(prefix):
            return i
    return 4


def _backward_reach(spec: ModelSpec, strategy: Strategy) -> tuple[int, bool]:
    """(the layers at the bottom that run no backward, whether the embedding does). Fine-tuning: a module runs a
    backward (and DeepSpeed's pre-backward hook fetches it) only where its output requires grad
    (``_post_forward_module_hook`` wraps only such outputs): not the dead layers below the lowest trainable one under
    --freeze (adapters.FrozenLayers), nor a frozen embedding whose output needs no gradient (under an adapter, unless
    checkpointing turns input gradients on: activations.input_grads_enabled)."""
    fz = frozen_layers(spec, strategy)
    if fz is not None:
        return fz.dead, fz.stack_input_grad
    return 0, strategy.adapter is None or input_grads_enabled(strategy)


def module_order(spec: ModelSpec, strategy: Strategy) -> tuple[list[_Param], list[_Step]]:
    """(the parameters, the recorded module order of one training step), as DeepSpeed's coordinator
    records it for a Hugging Face decoder."""
    inv = inventory(spec)
    params: list[_Param] = []

    def add(numels: Sequence[int]) -> tuple[int, ...]:
        out = []
        for n in numels:
            params.append(_Param(n, n <= PERSISTENCE_THRESHOLD))
            out.append(len(params) - 1)
        return tuple(out)

    def modules(tensors: Sequence[object]) -> list[list[int]]:
        keys: dict[str, list[int]] = {}
        for t in tensors:
            keys.setdefault(_module_key(t.name), []).append(t.numel)  # type: ignore[attr-defined]
        return [keys[k] for k in keys]

    embed = [t for t in inv.model_tensors if t.name.startswith("embed")]
    tail = [t for t in inv.model_tensors if not t.name.startswith("embed")]
    embed_mods = [add(m) for m in modules(embed)]
    # Per layer, as units that run in order: the input norm, the attention block (its container, then its
    # linears), the second norm, the MLP block (its container, the first linear, the activation, the rest).
    # Every module that runs is one entry of the recorded order, containers with no parameters of their own
    # included (they fetch nothing, but they prefetch).
    layers: list[list[_Block | Module]] = []
    for g in inv.layers:
        keyed: dict[str, list[int]] = {}
        for t in g.tensors:
            keyed.setdefault(_module_key(t.name), []).append(t.numel)
        ordered = sorted(keyed, key=_layer_rank)
        for _ in range(g.count):
            units: list[_Block | Module] = []
            blocks: dict[int, _Block] = {}
            for k in ordered:
                rank = _layer_rank(k)
                if rank in (1, 3):
                    if rank not in blocks:
                        blocks[rank] = _Block([])
                        units.append(blocks[rank])
                    blocks[rank].children.append(add(keyed[k]))
                    if rank == 3 and len(blocks[rank].children) == 1:
                        blocks[rank].children.append(())  # the activation
                else:
                    units.append(add(keyed[k]))
            layers.append(units)
    tail_keys: dict[str, list[int]] = {}
    for t in tail:
        tail_keys.setdefault(_module_key(t.name), []).append(t.numel)
    norm_mods = [add(v) for k, v in tail_keys.items() if k != "lm_head"]
    head_mods = [add(v) for k, v in tail_keys.items() if k == "lm_head"]
    if not head_mods and spec.tie_word_embeddings and embed_mods:
        head_mods = [embed_mods[0]]  # the tied head runs the embedding's weight

    def forward_of(units: list[_Block | Module]) -> list[Module]:
        out: list[Module] = [()]  # the decoder layer
        for u in units:
            out += [(), *u.children] if isinstance(u, _Block) else [u]
        return out

    def backward_of(units: list[_Block | Module]) -> list[Module]:
        out: list[Module] = [()]
        for u in reversed(units):
            out += [(), *reversed(u.children)] if isinstance(u, _Block) else [u]
        return out

    # Forward: the root, the base model, the embedding, the rotary embedding, the layers, the norm, the head.
    order: list[_Step] = [_Step((), "fwd", True), _Step((), "fwd", True)]
    order += [_Step(m, "fwd", True) for m in embed_mods] + [_Step((), "fwd", True)]
    for i, layer in enumerate(layers):
        order += [_Step(m, f"fwd-L{i}", True) for m in forward_of(layer)]
    order += [_Step(m, "fwd-norm", True) for m in norm_mods]
    order += [_Step(m, "head", True) for m in head_mods]
    # Backward (hooks on each module's outputs): the root, the head, the base model, the norm, then each
    # layer from the top — the layer, then its units in reverse, a block's container before its children.
    order += [_Step((), "bwd-head", False)] + [_Step(m, "bwd-head", False) for m in reversed(head_mods)]
    order += [_Step((), "bwd-norm", False)] + [_Step(m, "bwd-norm", False) for m in reversed(norm_mods)]
    dead, embed_backward = _backward_reach(spec, strategy)
    segments = strategy.checkpoint_layout(len(layers)).segment_sizes
    if segments:
        bounds = []
        start = 0
        for size in segments:
            bounds.append((max(start, dead), start + size))
            start += size
        for lo, hi in reversed(bounds):
            for i in range(lo, hi):
                order += [_Step(m, f"rec-L{i}", True) for m in forward_of(layers[i])]
            for i in reversed(range(lo, hi)):
                order += [_Step(m, f"bwd-L{i}", False) for m in backward_of(layers[i])]
    else:
        for i in reversed(range(dead, len(layers))):
            order += [_Step(m, f"bwd-L{i}", False) for m in backward_of(layers[i])]
    if embed_backward:
        order += [_Step(m, "bwd-embed", False) for m in reversed(embed_mods)]
    return params, order


@dataclass(frozen=True, slots=True, kw_only=True)
class Zero3Fetch:
    """Gathered 16-bit parameters (whole copies and in-flight flat buffers), bytes, at the analytic moments."""

    at: dict[MomentName, int]
    peak_bytes: int  # the largest at any moment of the step
    # The step's allocations and frees in order, for the rank's event stream (analytic/rank_events.py):
    # (where, allocation id, bytes: > 0 an allocation, 0 the free of that id)
    events: tuple[tuple[str, int, int], ...] = ()


_REPLAYS: Memo[Zero3Fetch] = Memo(256)


def gathered_bytes(spec: ModelSpec, strategy: Strategy, dp: int, param_bytes: int) -> Zero3Fetch:
    """Replay the coordinator over one steady-state step (the trace is complete) and read what is gathered."""
    eo = strategy.engine
    segments = strategy.checkpoint_layout(spec.num_layers).segment_sizes
    key = (
        spec_key(spec),
        segments,
        eo.prefetch_bucket_size,
        eo.max_live_parameters,
        eo.max_reuse_distance,
        _backward_reach(spec, strategy),
        strategy.offload.parameters_on_host,
    )
    return _REPLAYS.get((*key, dp, param_bytes), lambda: _replay(spec, strategy, dp, param_bytes))


def _replay(spec: ModelSpec, strategy: Strategy, dp: int, param_bytes: int) -> Zero3Fetch:
    eo = strategy.engine
    params, order = module_order(spec, strategy)
    queue: deque[tuple[int, int]] = deque((p, s) for s, st in enumerate(order) for p in sorted(set(st.params)))
    recent: dict[int, int] = {}
    avail: set[int] = set()
    registry: dict[int, int] = {}  # param -> handle id (its flat buffer alive while any param refers to it)
    flats: dict[int, int] = {}  # handle id -> bytes
    handles = itertools.count(1)
    uses: dict[int, list[int]] = {}
    prefix = [0]  # elements of the modules before each step
    for j, st in enumerate(order):
        for q in st.params:
            uses.setdefault(q, []).append(j)
        prefix.append(prefix[-1] + sum(params[q].numel for q in st.params))
    live_numel = 0
    moments: list[tuple[str, int]] = []  # (where, live bytes) after each event
    held = [0]  # bytes of the whole copies of gathered, non-persistent parameters
    events: list[tuple[str, int, int]] = []
    ids = itertools.count(1)
    copy_id: dict[int, int] = {}  # param -> allocation id of its whole copy
    flat_id: dict[int, int] = {}  # handle -> allocation id of its flat buffer
    here = [""]  # the step being replayed
    # ZeRO-Infinity: the partitions are the host's; each fetch copies every parameter's partition to the device for
    # the all-gather's input (partition_parameters.py ``_all_gather_dtype``: ``torch.cat([p.ds_tensor.to(device)
    # ...], out=partitions[rank])``; one parameter: ``_allgather_param``, ``param.ds_tensor.to(device)``), freed once
    # it is in the flat buffer
    host_partitions = strategy.offload.parameters_on_host

    def whole(p: int) -> int:
        return allocator_bytes(params[p].numel * param_bytes)

    def live() -> int:
        return held[0] + sum(flats.values())

    # One rank (a partition world of 1): ``all_gather_coalesced`` gathers nothing (``_no_gather_coalesced``:
    # ``NoGatherHandle`` sets ``param.data = ds_tensor.to(device)``), so no flat buffer and no copy out of it — the
    # partition itself on the device, or under ZeRO-Infinity its copy from the host, held until the release
    single = dp == 1

    def make_available(p: int) -> None:
        if p not in avail:
            avail.add(p)
            if not params[p].persist and (host_partitions or not single):
                held[0] += whole(p)
                copy_id[p] = next(ids)
                events.append((here[0], copy_id[p], whole(p)))

    def gather(ps: Sequence[int]) -> None:
        nonlocal live_numel
        ps = [p for p in ps if p not in avail and p not in registry]
        if not ps:
            return
        if single:
            for p in ps:
                make_available(p)
            live_numel += sum(params[p].numel for p in ps)
            return
        hid = next(handles)
        part = sum(-(-params[p].numel // dp) for p in ps)
        flats[hid] = allocator_bytes(part * dp * param_bytes)
        flat_id[hid] = next(ids)
        events.append((here[0], flat_id[hid], flats[hid]))
        if host_partitions:
            copies = [(next(ids), allocator_bytes(-(-params[p].numel // dp) * param_bytes)) for p in ps]
            events.extend((here[0], i, n) for i, n in copies)
            moments.append((here[0], live() + sum(n for _, n in copies)))
            events.extend((here[0], i, 0) for i, _ in copies)
        for p in ps:
            registry[p] = hid
        live_numel += sum(params[p].numel for p in ps)

    def wait(p: int, where: str) -> None:
        hid = registry.pop(p, None)
        if hid is None:
            return
        for q, h in [*registry.items(), (p, hid)]:
            if h == hid:
                make_available(q)  # ``wait`` copies every parameter of the handle out of the flat buffer
        moments.append((where, live()))
        if hid not in registry.values():
            del flats[hid]
            events.append((where, flat_id.pop(hid), 0))

    for p, prm in enumerate(params):  # persistent parameters are whole from the start (counted as weights)
        if prm.persist:
            make_available(p)
    for s, st in enumerate(order):
        here[0] = st.where
        mine = sorted(set(st.params))
        gather([p for p in mine if not params[p].persist])
        moments.append((st.where, live()))
        for p in mine:
            wait(p, st.where)
        fresh = {p for p in mine if recent.get(p, -(10**10)) < s}
        popped: set[int] = set()
        while queue and len(popped) < len(fresh):
            q, used = queue.popleft()
            recent[q] = used
            popped.add(q)
        if eo.prefetch_bucket_size > 0:
            limit = min(eo.max_live_parameters - live_numel, eo.prefetch_bucket_size)
            ahead: list[int] = []
            got = 0
            while queue and got < limit:
                q, used = queue.popleft()
                recent[q] = max(recent.get(q, -(10**10)), used)
                if q not in avail and q not in registry and q not in ahead:
                    ahead.append(q)
                    got += params[q].numel
            gather(ahead)
        moments.append((st.where, live()))
        # release after the module ran (step id already advanced: s + 1)
        release = {p for p in mine if not params[p].persist and recent.get(p, -(10**10)) <= s + 1}
        # ``__params_to_release`` walks the order from s + 1 and stops once it has passed max_reuse_distance
        # elements: a module at j is seen iff prefix[j] - prefix[s + 1] < max_reuse_distance.
        for p in list(release):
            uses_p = uses[p]
            k = bisect.bisect_left(uses_p, s + 1)
            if k < len(uses_p) and prefix[uses_p[k]] - prefix[s + 1] < eo.max_reuse_distance:
                release.discard(p)
        for p in release:
            if p in avail:
                avail.discard(p)
                live_numel -= params[p].numel
                if p in copy_id:
                    held[0] -= whole(p)
                    events.append((st.where, copy_id.pop(p), 0))
        moments.append((st.where, live()))

    by_where: dict[str, int] = {}  # the most live bytes at each step (many moments per step)
    for w, b in moments:
        if b > by_where.get(w, -1):
            by_where[w] = b

    def worst(pred: str) -> int:
        return max((b for w, b in by_where.items() if w.startswith(pred)), default=0)

    layers = sum(g.count for g in inventory(spec).layers)
    top, bottom = f"L{layers - 1}", "L0"
    end_fwd = [b for w, b in moments if w == "head"][-1:] or [0]
    at = {
        MomentName.FORWARD_END: end_fwd[0],
        MomentName.FORWARD_LAST_SOFTMAX: worst(f"fwd-{top}"),
        MomentName.FORWARD_FINAL_NORM: worst("fwd-norm"),
        MomentName.BACKWARD_START: worst("bwd-head"),
        MomentName.BACKWARD_FINAL_NORM: worst("bwd-norm"),
        MomentName.BACKWARD_TOP_BLOCK: max(worst(f"bwd-{top}"), worst(f"rec-{top}")),
        MomentName.BACKWARD_BOTTOM_BLOCK: max(worst(f"bwd-{bottom}"), worst(f"rec-{bottom}")),
        MomentName.BACKWARD_EMBEDDING: worst("bwd-embed"),
    }
    at[MomentName.BACKWARD_TOP_SOFTMAX] = at[MomentName.BACKWARD_TOP_BLOCK]
    at[MomentName.BACKWARD_BOTTOM_SOFTMAX] = at[MomentName.BACKWARD_BOTTOM_BLOCK]
    # The end of the step (``reset_step``): what is still gathered or in flight goes.
    events += [("end", i, 0) for i in [*copy_id.values(), *flat_id.values()]]
    return Zero3Fetch(at=at, peak_bytes=max((b for _, b in moments), default=0), events=tuple(events))


__all__ = ["PERSISTENCE_THRESHOLD", "Zero3Fetch", "gathered_bytes", "module_order"]

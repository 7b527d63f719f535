"""Which FSDP2 wrapping a setup gets, read by the analytic model (:mod:`trainfit.analytic.parallel`,
:mod:`trainfit.analytic.rank_events`), the trace (:mod:`trainfit.trace.distributed`) and the FSDP2 export alike, so
that they model, trace and write the same run.

``--fsdp-wrap root``: ``fully_shard`` per decoder layer, then the root (the embeddings, final norm and head).
``units`` (torchtitan's ``apply_fsdp``; accelerate's ``fsdp2_prepare_model`` since PR #4015, 1.15): also the untied
token table, then [final norm, output embedding] (the tied table inside it), as units of their own before the root,
which keeps what is left. ``auto`` (the default): ``units`` where the analytic model has them
(:func:`units_unmodelled`), ``root`` elsewhere."""

from __future__ import annotations

from trainfit._memo import Memo, spec_key
from trainfit.arch.params import inventory
from trainfit.arch.spec import ModelKind, ModelSpec, ParamTensor
from trainfit.strategy import FsdpWrap, Strategy

__all__ = [
    "EMBEDDING_UNIT",
    "ROOT_UNIT",
    "TAIL_UNIT",
    "edge_units_fraction",
    "fsdp_unit",
    "gathered_once_fraction",
    "resolved_fsdp_wrap",
    "units_unmodelled",
    "untied_units",
]


def resolved_fsdp_wrap(spec: ModelSpec, strategy: Strategy) -> FsdpWrap:
    """The FSDP2 wrapping modelled: ``--fsdp-wrap root|units`` as asked; ``auto`` (the default) ``units`` —
    torchtitan's and accelerate 1.15's — where the analytic model has it (:func:`units_unmodelled`), else ``root``."""
    w = strategy.engine.fsdp_wrap
    if w is not FsdpWrap.AUTO:
        return w
    return FsdpWrap.ROOT if units_unmodelled(spec, strategy) else FsdpWrap.UNITS


def units_unmodelled(spec: ModelSpec, strategy: Strategy) -> str:
    """Why the analytic model does not have ``--fsdp-wrap units`` for this setup ("": it has it): a model other than a
    causal LM (whose head the units would not group as the trace does), tensor parallelism (2-D FSDP2×TP), or
    model-level tensors left in the root beside an untied table's unit."""
    return _units_unmodelled(spec, strategy.parallelism.tensor)


def gathered_once_fraction(spec: ModelSpec, wrap: FsdpWrap, tensor: int, *, reshard_after_forward: bool) -> float:
    """The share of the parameters (by elements) an FSDP2 micro-step all-gathers once, in forward only: every group
    without ``reshard_after_forward``; with it, the root's — FSDP2 never reshards the root after forward
    (torch/distributed/fsdp/_fully_shard/_fsdp_state.py ``_lazy_init``: the root's ``post_forward_mesh_info`` is
    None) — and under ``units`` the [final norm, head] unit's (built with ``reshard_after_forward=False``); the
    decoder layers and an untied table's unit are gathered again for backward. ``wrap``: ``--fsdp-wrap`` as asked
    (``auto`` resolved here as :func:`resolved_fsdp_wrap` does)."""
    if not reshard_after_forward:
        return 1.0
    return _ONCE.get((spec_key(spec), wrap, tensor), lambda: _gathered_once(spec, wrap, tensor))


#: The planner asks for every candidate's speed (the model's inventory summed each time otherwise).
_ONCE: Memo[float] = Memo(64)


def _gathered_once(spec: ModelSpec, wrap: FsdpWrap, tensor: int) -> float:
    if wrap is FsdpWrap.AUTO:
        wrap = FsdpWrap.ROOT if _units_unmodelled(spec, tensor) else FsdpWrap.UNITS
    inv = inventory(spec)
    total = sum(x.numel for x in inv.model_tensors) + sum(g.count * x.numel for g in inv.layers for x in g.tensors)
    if wrap is FsdpWrap.ROOT:
        once = sum(x.numel for x in inv.model_tensors)
    else:
        tied = spec.tie_word_embeddings and spec.kind.has_vocab_logits
        once = sum(x.numel for x in inv.model_tensors if tied or x.name != "embed_tokens.weight")
    return once / total if total else 0.0


def edge_units_fraction(spec: ModelSpec, tensor: int) -> float:
    """The share of the parameters (by elements) in the FSDP2 groups that gate a micro-step's ends, with ``auto``
    wrapping (as :func:`gathered_once_fraction` resolves it): the groups gathered before the first forward compute
    and reduce-scattered after the last backward compute, so that nothing hides either. The root's own
    parameters (its pre-forward all-gathers them before any module runs; its reduce-scatter runs in the final
    backward callback, torch/distributed/fsdp/_fully_shard/_fsdp_state.py ``_root_pre_forward``,
    ``_root_post_backward_final_callback``), the unit holding the input embedding under ``units`` (the untied
    table's unit, or the [final norm, head] unit holding a tied table: used first in forward and last in
    backward), and the first decoder layer (its all-gather is issued by its pre-forward hook after the embedding's
    lookup, and its reduce-scatter after its own backward, the last one) — an average layer's parameters."""
    return _EDGE.get((spec_key(spec), tensor), lambda: _edge_units(spec, tensor))


_EDGE: Memo[float] = Memo(64)


def _edge_units(spec: ModelSpec, tensor: int) -> float:
    inv = inventory(spec)
    layers = sum(g.params for g in inv.layers)
    n_layers = sum(g.count for g in inv.layers)
    total = sum(x.numel for x in inv.model_tensors) + layers
    if not total:
        return 0.0
    tied = spec.tie_word_embeddings and spec.kind.has_vocab_logits
    units = not _units_unmodelled(spec, tensor)
    outside = sum(
        x.numel
        for x in inv.model_tensors
        if not (
            units
            and not tied
            and (x.name.startswith("final_norm.") or (spec.kind.has_vocab_logits and x.name.startswith("lm_head.")))
        )
    )
    return (outside + (layers / n_layers if n_layers else 0)) / total


def _units_unmodelled(spec: ModelSpec, tensor: int) -> str:
    if spec.kind is not ModelKind.CAUSAL_LM:
        return f"a {spec.kind.value} model"
    if tensor > 1:
        return "tensor parallelism"
    tied = spec.tie_word_embeddings and spec.kind.has_vocab_logits
    names = [x.name for x in inventory(spec).model_tensors]
    if not tied and any(n != "embed_tokens.weight" and not n.startswith(("final_norm.", "lm_head.")) for n in names):
        return "model-level tensors left in the root beside an untied table's unit"
    return ""


#: FSDP2's groups of the model-level tensors (:func:`fsdp_unit`); a decoder layer's group is its index.
ROOT_UNIT, EMBEDDING_UNIT, TAIL_UNIT = -1, -2, -3


def untied_units(spec: ModelSpec, strategy: Strategy) -> bool:
    """Whether ``--fsdp-wrap units`` gives the token table a unit of its own: an untied table (a tied one is in
    the [final norm, head] unit, which is then what the root was: unsharded from the embedding's forward to the
    end of backward)."""
    tied = spec.tie_word_embeddings and spec.kind.has_vocab_logits
    return resolved_fsdp_wrap(spec, strategy) is FsdpWrap.UNITS and not tied


def fsdp_unit(spec: ModelSpec, strategy: Strategy, x: ParamTensor) -> int:
    """The FSDP2 group of the model-level tensor ``x``. ``--fsdp-wrap root``: the root. ``units`` (accelerate 1.15's
    ``fsdp2_prepare_model``, torchtitan's ``apply_fsdp``; trainfit.trace.distributed ``_wrap_fsdp``): the input
    embedding's table, untied, in a unit of its own; the final norm, the output embedding (``lm_head``; the table
    when tied to it) in one more; the rest (position embeddings, a classification head) in the root."""
    if resolved_fsdp_wrap(spec, strategy) is not FsdpWrap.UNITS:
        return ROOT_UNIT
    if x.name == "embed_tokens.weight":
        return EMBEDDING_UNIT if untied_units(spec, strategy) else TAIL_UNIT
    if x.name.startswith("final_norm.") or (spec.kind.has_vocab_logits and x.name.startswith("lm_head.")):
        return TAIL_UNIT
    return ROOT_UNIT

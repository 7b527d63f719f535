"""Hugging Face models for the trace: built from ``config.json`` on the meta device, cut to a few layers.

The full-depth model is built on ``meta`` (no memory, random init is free there) with the recipe's weight
dtype set as the default dtype during construction (``from_config(dtype=...)``), then materialised as fake
CPU tensors. To trace a 126-layer model at the cost of a few layers, we describe the layer stack as a
sequence of *blocks* — one layer, or one checkpointed segment under ``--checkpointing sqrt`` — each with a
structural signature (module classes, parameter shapes, and scalar attributes such as ``sliding_window``
or ``attention_type``). Runs of a repeating unit (one layer for Llama; a local/global pair for Gemma-2; the
MoE layers after DeepSeek's dense prefix; the checkpointed segments of a sqrt layout) can be traced at 2
and 3 repetitions and extrapolated exactly, because every quantity at a fixed moment of the step is
linear in the number of repetitions. Reduced models are deep copies of the full meta model with the
chosen layers; per-layer config lists (``layer_types``) are sliced to match.

Checkpointing goes through the model's own ``gradient_checkpointing_enable()`` (non-reentrant, the
transformers default) for ``full``. ``sqrt`` uses ``Strategy.checkpoint_layout`` (Chen et al. 2016,
§4.1): segments of ⌈L/⌈√L⌉⌉ layers covering every layer; a segment is one non-reentrant checkpoint region spanning
several decoder layers, opened at its first layer and closed after its last.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainfit.arch.spec import ModelKind, ModelSpec
from trainfit.errors import ConfigError, TrainfitError
from trainfit.strategy import Attention, Checkpointing, Strategy
from trainfit.trace import tracker as tk
from trainfit.trace._deps import require_transformers

_DROP_KEYS = ("auto_map", "quantization_config", "torch_dtype", "dtype", "transformers_version", "architectures")


def config_dict(spec: ModelSpec) -> dict[str, Any]:
    """The HF config for ``spec``: its own ``config.json`` or, for explicit models, a Llama config."""
    if spec.hf_config:
        cfg = {k: v for k, v in spec.hf_config.items() if k not in _DROP_KEYS}
        cfg.setdefault("model_type", spec.model_type)
        return cfg
    return {
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "tie_word_embeddings": spec.tie_word_embeddings,
    }


def _refusal_types() -> tuple[type[BaseException], ...]:
    """What transformers raises when it refuses a config or cannot build a module from it: its strict config
    dataclasses (huggingface_hub ``StrictDataclassError``: wrong types, failed ``validate_architecture``),
    ValueError/TypeError/KeyError/AttributeError from config classes and modules, AssertionError from torch
    layer constructors (an embedding's padding index outside the vocabulary)."""
    out: tuple[type[BaseException], ...] = (ValueError, TypeError, KeyError, AttributeError, AssertionError)
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # older huggingface_hub: no strict dataclasses
        return out
    return (*out, StrictDataclassError)


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception message on one line, cut to ``limit`` characters (transformers' can span many)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, KeyError):  # str(KeyError) is only the missing key
        text = f"unknown name {text} (KeyError)"
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings (unused config keys, missing defaults) would leak into the trace's output:
    errors only while configs and modules are built."""
    tf_logging = require_transformers().utils.logging
    level = tf_logging.get_verbosity()
    tf_logging.set_verbosity_error()
    try:
        yield
    finally:
        tf_logging.set_verbosity(level)


def hf_config(spec: ModelSpec) -> Any:
    tf = require_transformers()
    cfg = config_dict(spec)
    model_type = cfg.pop("model_type")
    try:
        with quiet_transformers():
            conf = tf.AutoConfig.for_model(model_type, **cfg)
    except _refusal_types() as exc:
        raise ConfigError(
            f"transformers refuses this '{model_type}' config: {_one_line(exc)}; fix the config"
        ) from None
    # As the user's run would: transformers builds a DynamicCache in training when config.use_cache is
    # true (gradient checkpointing turns it off), and its torch.cat copies k and v.
    conf.use_cache = spec.use_cache
    if not spec.kind.has_vocab_logits:  # a task head (trainfit.arch.heads)
        conf.num_labels = spec.num_labels
        # *ForSequenceClassification refuses batches > 1 without a pad token; no id in the batch is padding.
        if getattr(conf, "pad_token_id", None) is None:
            conf.pad_token_id = spec.vocab_size - 1
    return conf


def auto_class(spec: ModelSpec) -> Any:
    """The transformers auto class for ``spec``'s task head."""
    tf = require_transformers()
    return {
        ModelKind.CAUSAL_LM: tf.AutoModelForCausalLM,
        ModelKind.MASKED_LM: tf.AutoModelForMaskedLM,
        ModelKind.SEQ_CLS: tf.AutoModelForSequenceClassification,
        ModelKind.TOKEN_CLS: tf.AutoModelForTokenClassification,
        ModelKind.BASE: tf.AutoModel,
    }[spec.kind]


def loss_of(spec: ModelSpec) -> Callable[[Any, Any], torch.Tensor]:
    """The model's own loss; the headless model's assumed one (trainfit.arch.heads): ``last_hidden_state.mean()``."""
    if spec.kind is ModelKind.BASE:
        return lambda out, _batch: out.last_hidden_state.mean()
    return lambda out, _batch: out.loss


def build_meta(spec: ModelSpec, strategy: Strategy, weight_dtype: torch.dtype) -> tuple[torch.nn.Module, list[str]]:
    """The full-depth model on the meta device, in training mode. Returns (model, notes)."""
    require_transformers()
    conf = hf_config(spec)
    auto = auto_class(spec)
    attn = "eager" if strategy.attention is Attention.EAGER else "sdpa"
    notes: list[str] = []
    refusals = _refusal_types()

    def construct(implementation: str) -> torch.nn.Module:
        with quiet_transformers(), torch.device("meta"):
            built: torch.nn.Module = auto.from_config(conf, attn_implementation=implementation, dtype=weight_dtype)
        return built

    try:
        model = construct(attn)
    except refusals as exc:
        # A model without SDPA refuses attn_implementation="sdpa" with a ValueError: retry with eager, and
        # report the first refusal when eager fails too (the config itself is what transformers refuses).
        if attn != "sdpa" or not isinstance(exc, ValueError):
            raise ConfigError(f"transformers cannot build {spec.name}: {_one_line(exc)}; fix the config") from None
        try:
            model = construct("eager")
        except refusals:
            raise ConfigError(f"transformers cannot build {spec.name}: {_one_line(exc)}; fix the config") from None
        notes.append(f"{type(model).__name__} has no SDPA attention in transformers; traced with eager")
    model.train()
    return model, notes


def find_stack(model: torch.nn.Module, num_layers: int) -> tuple[str, torch.nn.ModuleList]:
    """The ModuleList of decoder/encoder layers (the first one of length ``num_layers``)."""
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == num_layers and num_layers > 0:
            kinds = {type(m).__name__ for m in mod}
            if len(kinds) <= 2:
                return name, mod
    raise TrainfitError(f"cannot find the {num_layers}-layer stack in {type(model).__name__}")


def head_of(model: torch.nn.Module) -> torch.nn.Module | None:
    """The root child that holds the output embeddings (``lm_head``, BERT's ``cls``)."""
    get = getattr(model, "get_output_embeddings", None)
    out: torch.nn.Module | None = get() if callable(get) else None
    if out is None:
        return None
    for _name, child in model.named_children():
        if child is out or any(m is out for m in child.modules()):
            return child
    return out


_SKIP_ATTR = ("idx", "index", "layer_id", "layer_number")


def _scalar_attrs(m: torch.nn.Module) -> tuple[tuple[str, Any], ...]:
    items: list[tuple[str, Any]] = []
    for k, v in vars(m).items():
        if k.startswith("_") or k == "training" or any(s in k for s in _SKIP_ATTR):
            continue
        if isinstance(v, (bool, int, float, str)) or v is None:
            items.append((k, v))
        elif isinstance(v, (tuple, list)) and all(isinstance(x, (bool, int, float, str)) for x in v):
            items.append((k, tuple(v)))
    return tuple(sorted(items))


def layer_signature(layer: torch.nn.Module) -> tuple[Any, ...]:
    """What makes two layers cost the same memory: structure, parameter shapes/dtypes, scalar settings."""
    return tuple(
        (
            name,
            type(m).__name__,
            _scalar_attrs(m),
            tuple((n, tuple(p.shape), str(p.dtype)) for n, p in m.named_parameters(recurse=False)),
            tuple((n, tuple(b.shape), str(b.dtype)) for n, b in m.named_buffers(recurse=False)),
        )
        for name, m in layer.named_modules()
    )


# -- checkpoint layout and runs -------------------------------------------------------------------------


def sqrt_layout(num_layers: int) -> list[int]:
    """Segment sizes under ``--checkpointing sqrt`` (``Strategy.checkpoint_layout``, shared with the
    analytic model: segments of ⌈L/⌈√L⌉⌉ layers covering every layer, the last one shorter)."""
    return list(Strategy(checkpointing=Checkpointing.SQRT).checkpoint_layout(num_layers).segment_sizes)


@dataclass(frozen=True)
class Block:
    """A run unit's element: one layer or one checkpointed segment."""

    checkpointed: bool
    layers: tuple[int, ...]  # layer indices in the full model


def blocks_for(num_layers: int, checkpointing: Checkpointing) -> list[Block]:
    if not checkpointing.whole_layers:  # selective: inside the layer (savers.py)
        return [Block(False, (i,)) for i in range(num_layers)]
    if checkpointing in (Checkpointing.FULL, Checkpointing.SAC):
        return [Block(True, (i,)) for i in range(num_layers)]
    out, i = [], 0
    for size in sqrt_layout(num_layers):
        out.append(Block(True, tuple(range(i, i + size))))
        i += size
    out += [Block(False, (j,)) for j in range(i, num_layers)]
    return out


@dataclass(frozen=True)
class Run:
    start: int  # first block
    period: int  # blocks per unit
    count: int  # repetitions of the unit


MAX_PERIOD = 8
MIN_EXTRAPOLATED_COUNT = 4


def find_runs(tokens: Sequence[Any]) -> list[Run]:
    """Greedy cover of ``tokens`` by repeated units (longest coverage first, shorter period on ties)."""
    runs, i, n = [], 0, len(tokens)
    while i < n:
        best_p, best_c = 1, 1
        for p in range(1, min(MAX_PERIOD, (n - i) // 2) + 1):
            c = 1
            while i + (c + 1) * p <= n and tokens[i + c * p : i + (c + 1) * p] == tokens[i : i + p]:
                c += 1
            if c >= 2 and c * p > best_p * best_c:
                best_p, best_c = p, c
        runs.append(Run(i, best_p, best_c))
        i += best_p * best_c
    return runs


@dataclass(frozen=True)
class Layout:
    """A (reduced or full) model as blocks, with the run each unit belongs to."""

    blocks: tuple[Block, ...]
    unit_run: tuple[int, ...]  # run index of each unit
    unit_blocks: tuple[tuple[int, int], ...]  # [first, last] block of each unit

    @property
    def layers(self) -> list[int]:
        return [i for b in self.blocks for i in b.layers]


def layout_for(blocks: Sequence[Block], runs: Sequence[Run], counts: Sequence[int]) -> Layout:
    """Keep ``counts[r]`` units of each run (the first ones)."""
    kept: list[Block] = []
    unit_run, unit_blocks = [], []
    for r, (run, c) in enumerate(zip(runs, counts, strict=True)):
        for u in range(c):
            first = len(kept)
            kept += blocks[run.start + u * run.period : run.start + (u + 1) * run.period]
            unit_run.append(r)
            unit_blocks.append((first, len(kept) - 1))
    return Layout(tuple(kept), tuple(unit_run), tuple(unit_blocks))


def reduced_model(meta: torch.nn.Module, stack_path: str, keep: Sequence[int], full_layers: int) -> torch.nn.Module:
    """A deep copy of ``meta`` whose layer stack holds only ``keep`` (indices into the full stack)."""
    parent_path, _, attr = stack_path.rpartition(".")
    parent = meta.get_submodule(parent_path) if parent_path else meta
    full = getattr(parent, attr)
    setattr(parent, attr, torch.nn.ModuleList([full[i] for i in keep]))
    try:
        model = copy.deepcopy(meta)
    finally:
        setattr(parent, attr, full)
    configs: list[Any] = [model.config]
    get_text = getattr(model.config, "get_text_config", None)
    if callable(get_text) and get_text() is not model.config:
        configs.append(get_text())
    for conf in configs:
        for key, value in list(vars(conf).items()):
            if isinstance(value, list) and len(value) == full_layers and key != "architectures":
                setattr(conf, key, [value[i] for i in keep])
        if getattr(conf, "num_hidden_layers", None) == full_layers:
            conf.num_hidden_layers = len(keep)
    model.train()
    return model


# -- checkpointing --------------------------------------------------------------------------------------


def _enable_hf_checkpointing(model: torch.nn.Module, kwargs: dict[str, Any] | None = None) -> None:
    fn: Any = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise TrainfitError(f"{type(model).__name__} does not support gradient checkpointing in transformers")
    with quiet_transformers():
        fn(kwargs) if kwargs else fn()


def install_checkpointing(
    model: torch.nn.Module,
    layers: Sequence[torch.nn.Module],
    blocks: Sequence[Block],
    tracker_box: list[tk.Tracker],
    *,
    sac: bool = False,
) -> None:
    """Checkpoint the stack as ``blocks`` say (positions in ``layers`` follow block order); ``sac``: each layer
    with torchtitan's per-op selective policy (trainfit.trace.savers ``sac_context_fn``)."""
    if not any(b.checkpointed for b in blocks):
        return
    if sac:
        from trainfit.trace.savers import sac_context_fn

        _enable_hf_checkpointing(model, {"use_reentrant": False, "context_fn": sac_context_fn()})
    else:
        _enable_hf_checkpointing(model)
    pos = 0
    for b in blocks:
        members = list(range(pos, pos + len(b.layers)))
        pos += len(b.layers)
        if not b.checkpointed:
            for i in members:
                plain: Any = layers[i]
                plain.gradient_checkpointing = False
            continue
        if len(members) == 1:
            layer: Any = layers[members[0]]
            layer._gradient_checkpointing_func = _tracked(layer._gradient_checkpointing_func, tracker_box)
            continue
        seg = _Segment(len(members), tracker_box)
        for j, i in enumerate(members):
            member: Any = layers[i]
            member.gradient_checkpointing = True
            member._gradient_checkpointing_func = functools.partial(seg.call, j)


def in_recompute(tracker_box: list[tk.Tracker], fn: Callable[..., Any], *a: Any, **k: Any) -> Any:
    tr = tracker_box[0] if tracker_box else None
    if tr is None or tr.phase != tk.BACKWARD:
        return fn(*a, **k)
    idx = tr.begin_recompute()
    try:
        return fn(*a, **k)
    finally:
        tr.end_recompute(idx)


def _tracked(checkpoint_fn: Callable[..., Any], tracker_box: list[tk.Tracker]) -> Callable[..., Any]:
    """HF's per-layer checkpoint function, marking the recomputation as such for the tracker."""

    def wrapped(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return checkpoint_fn(functools.partial(in_recompute, tracker_box, function), *args, **kwargs)

    return wrapped


class _Segment:
    """One non-reentrant checkpoint region spanning several consecutive decoder layers."""

    def __init__(self, size: int, tracker_box: list[tk.Tracker]):
        self.size = size
        self.tracker_box = tracker_box
        self.gen: Any = None
        self.calls: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self.last_out: Any = None

    @staticmethod
    def _hidden(out: Any) -> Any:
        return out[0] if isinstance(out, tuple) else out

    def _replay(self, calls: list[tuple[Callable[..., Any], tuple[Any, ...]]], h: torch.Tensor) -> None:
        for fn, rest in calls:
            h = self._hidden(fn(h, *rest))

    def call(self, j: int, function: Callable[..., Any], *args: Any) -> Any:
        from torch.utils.checkpoint import _checkpoint_without_reentrant_generator, noop_context_fn

        if not torch.is_grad_enabled():
            return function(*args)
        if j == 0:
            calls: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
            self.calls = calls
            replay = functools.partial(in_recompute, self.tracker_box, functools.partial(self._replay, calls))
            self.gen = _checkpoint_without_reentrant_generator(
                replay, True, noop_context_fn, "default", False, True, args[0]
            )
            next(self.gen)
        elif self._hidden(self.last_out) is not args[0]:
            raise TrainfitError(
                "sqrt checkpointing needs each layer to take the previous layer's output; "
                "use --checkpointing full for this model"
            )
        self.calls.append((function, tuple(args[1:])))
        out = function(*args)
        self.last_out = out
        if j == self.size - 1:
            with contextlib.suppress(StopIteration):
                next(self.gen)
            # The recomputation's closure keeps its own reference to the calls (their inputs live until
            # this segment's backward, as a checkpoint's do); holding them here too would keep the masks
            # and other arguments alive into the next step.
            self.gen, self.last_out, self.calls = None, None, []
        return out


@contextlib.contextmanager
def runtime_patches() -> Iterator[None]:
    """Answer transformers' data-dependent batch checks as a real unpadded, unpacked batch would, with
    transformers' log lines silenced while the steps run (they would leak into the trace's output).

    ``masking_utils.find_packed_sequence_indices`` cannot read position ids under fake tensors and then
    assumes packed sequences, which materialises a [b, 1, s, s] mask and rules out flash attention. Our
    batches hold one sequence per row, for which it returns ``None`` on real tensors.
    """
    tf = require_transformers()
    mu = tf.masking_utils
    orig = mu.find_packed_sequence_indices
    mu.find_packed_sequence_indices = lambda position_ids: None
    try:
        with quiet_transformers():  # e.g. "use_cache=True is incompatible with gradient checkpointing"
            yield
    finally:
        mu.find_packed_sequence_indices = orig


# -- batches --------------------------------------------------------------------------------------------


def batch_fn(
    spec: ModelSpec, micro_batch: int, seq_len: int, device: str = "cpu"
) -> Callable[[], dict[str, torch.Tensor]]:
    """Token ids and labels (values are irrelevant under fake tensors); no padding mask."""

    def make() -> dict[str, torch.Tensor]:
        ids = torch.zeros((micro_batch, seq_len), dtype=torch.long, device=device)
        if spec.kind is ModelKind.BASE:
            return {"input_ids": ids}
        shape = (micro_batch,) if spec.kind is ModelKind.SEQ_CLS else (micro_batch, seq_len)
        labels = torch.zeros(shape, dtype=torch.long, device=device)
        return {"input_ids": ids, "labels": labels}

    return make

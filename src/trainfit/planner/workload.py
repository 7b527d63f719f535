"""The plan's fixed inputs as the CLI spells them: the world (``--gpus`` or ``--nodes × --gpus-per-node``)
and the global batch (``--global-batch`` sequences or ``--tokens-per-step`` tokens; neither: 8 sequences per GPU
given, with no accumulation — the HF Trainer's defaults, transformers ``TrainingArguments.per_device_train_batch_size
= 8`` and ``gradient_accumulation_steps = 1``), held together with the sequence length as one value,
:class:`PlanWorkload`, and the search's numeric knobs, checked before any estimate runs (an estimate refuses a bad
headroom, and the search would read that as "nothing fits")."""

from __future__ import annotations

from dataclasses import dataclass

from trainfit.errors import ConfigError

__all__ = [
    "DEFAULT_SEQUENCES_PER_GPU",
    "PlanWorkload",
    "check_knobs",
    "host_memory_bytes",
    "parse_tokens",
    "resolve_world",
    "sequences_per_step",
]

#: Sequences per GPU and optimizer step when neither --global-batch nor --tokens-per-step is given: transformers
#: ``TrainingArguments.per_device_train_batch_size`` defaults to 8 (training_args.py), accumulation to 1.
DEFAULT_SEQUENCES_PER_GPU = 8

_SUFFIX = {"k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}


def parse_tokens(text: str, *, multiple_of: int = 1) -> int:
    """``2e6``, ``4_000_000``, or with a suffix k/M/G: ``4M`` is 4 000 000 when that is a multiple of
    ``multiple_of`` (the sequence length), else 4·2²⁰ = 4 194 304 when that is (Llama 3's "4M tokens" batch is
    512 sequences of 8192, Dubey et al. 2024 §3.4.1)."""
    t = text.strip().replace("_", "").lower()
    suffix = t[-1:] if t[-1:] in _SUFFIX else ""
    try:
        number = float(t[:-1] if suffix else t)
    except ValueError:
        raise ConfigError(f"--tokens-per-step expects a number such as 4M or 2e6, got '{text}'") from None
    options = [number * _SUFFIX[suffix], number * 2 ** (10 * ("kmgb".index(suffix) % 3 + 1))] if suffix else [number]
    for value in options:
        if value > 0 and value.is_integer() and int(value) % multiple_of == 0:
            return int(value)
    raise ConfigError(f"--tokens-per-step {text} is not a whole number of sequences of {multiple_of} tokens")


def resolve_world(*, gpus: int | None, nodes: int | None, gpus_per_node: int) -> int:
    if gpus_per_node < 1:
        raise ConfigError("--gpus-per-node must be positive")
    if gpus is not None and nodes is not None:
        if gpus != nodes * gpus_per_node:
            raise ConfigError(f"--gpus {gpus} is not --nodes {nodes} × --gpus-per-node {gpus_per_node}")
        return gpus
    if nodes is not None:
        if nodes < 1:
            raise ConfigError("--nodes must be positive")
        return nodes * gpus_per_node
    if gpus is not None and gpus < 1:
        raise ConfigError("--gpus must be positive")
    return gpus or 1


def sequences_per_step(*, global_batch: int | None, tokens_per_step: str | None, seq_len: int, world: int = 1) -> int:
    """Sequences per optimizer step over all GPUs; neither given: ``DEFAULT_SEQUENCES_PER_GPU`` × ``world``."""
    if seq_len < 1:
        raise ConfigError("--seq must be positive")
    if global_batch is not None and tokens_per_step is not None:
        raise ConfigError("give --global-batch or --tokens-per-step, not both")
    if tokens_per_step is not None:
        return parse_tokens(tokens_per_step, multiple_of=seq_len) // seq_len
    if global_batch is None:
        return DEFAULT_SEQUENCES_PER_GPU * world
    if global_batch < 1:
        raise ConfigError("--global-batch must be positive")
    return global_batch


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanWorkload:
    """The size of the run a plan is for, as ``trainfit plan`` takes it: ``--gpus`` (GPUs available) or ``--nodes`` ×
    ``--gpus-per-node``, ``--seq``, and ``--global-batch`` sequences or ``--tokens-per-step`` tokens (neither:
    :data:`DEFAULT_SEQUENCES_PER_GPU` per GPU). Built once — by the CLI and the web API's plan — and handed both to
    the baseline (:func:`trainfit.planner.api.plan_baseline`, what the run flags are laid over) and to the search
    (:func:`trainfit.planner.api.plan`), so the two cannot be given different sizes. Checked when built, with the
    one-line refusals of :func:`resolve_world` and :func:`sequences_per_step`."""

    gpus: int | None = None
    nodes: int | None = None
    gpus_per_node: int = 8
    seq: int = 2048
    global_batch: int | None = None
    tokens_per_step: str | None = None

    def __post_init__(self) -> None:
        self.sequences  # noqa: B018 - resolves the world and the batch: a bad size is refused here, in one line

    @property
    def world(self) -> int:
        """The GPUs the search may use (:func:`resolve_world`)."""
        return resolve_world(gpus=self.gpus, nodes=self.nodes, gpus_per_node=self.gpus_per_node)

    @property
    def sequences(self) -> int:
        """Sequences per optimizer step over all GPUs (:func:`sequences_per_step`)."""
        return sequences_per_step(
            global_batch=self.global_batch, tokens_per_step=self.tokens_per_step, seq_len=self.seq, world=self.world
        )

    @property
    def batch_given(self) -> bool:
        """Whether ``--global-batch`` or ``--tokens-per-step`` was given (else the HF Trainer's default per GPU)."""
        return self.global_batch is not None or self.tokens_per_step is not None


def check_knobs(*, headroom: float, top: int, price_per_gpu_hour: float, network_gbps: float) -> None:
    """One-line refusals of the numeric options (the estimate's own headroom rule, ``trainfit.estimate``)."""
    if not 0 <= headroom < 1:
        raise ConfigError(f"--headroom must be in [0, 1), got {headroom}")
    if top < 1:
        raise ConfigError(f"--top must be at least 1, got {top}")
    if not price_per_gpu_hour > 0:
        raise ConfigError(f"--price-per-gpu-hour must be positive, got {price_per_gpu_hour}")
    if not network_gbps > 0:
        raise ConfigError(f"--network-gbps must be positive, got {network_gbps}")


def host_memory_bytes(host_memory_gib: float | None) -> int | None:
    """``--host-memory-gib`` as bytes (None: host memory not limited); a finite positive number of GiB."""
    import math

    from trainfit.units import bytes_of_gib

    if host_memory_gib is None:
        return None
    if not math.isfinite(host_memory_gib) or host_memory_gib <= 0:
        raise ConfigError(f"--host-memory-gib must be positive, got {host_memory_gib:g}")
    return bytes_of_gib(host_memory_gib)

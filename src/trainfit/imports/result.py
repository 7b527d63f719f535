"""What an import returns: the Strategy, the batch shape the file fixed, and every setting it used or ignored.

An importer fills a :class:`Draft` in the vocabulary of ``trainfit estimate``'s flags (``precision``,
``batch``, ``grad_accum``, ``gpus``, ``sharding``, ``offload``, …: the names of
:data:`trainfit.cli.estimate.STRATEGY_FLAGS`) plus the DeepSpeed bucket settings that have no flag, so the CLI
can lay explicit flags over the file's values and build the Strategy exactly as it builds one from flags;
:meth:`Draft.finish` builds the same Strategy for library callers (a test holds the two equal).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from trainfit.errors import StrategyError
from trainfit.strategy import EngineOptions, MemorySavers, Offload, Parallelism, Strategy


class ConfigKind(StrEnum):
    DEEPSPEED = "deepspeed"  # a DeepSpeed config JSON (ds_config.json)
    ACCELERATE = "accelerate"  # an accelerate config YAML/JSON (what `accelerate config` writes)
    TRAINING_ARGS = "training-args"  # transformers TrainingArguments as JSON (args.to_json_string() or kwargs)


@dataclass(frozen=True, slots=True, kw_only=True)
class ImportedSetting:
    """One key of the file: where it is (dotted), its value as written (JSON text), and what trainfit made of it
    (the flag it became, or why it was ignored)."""

    key: str
    value: str
    meaning: str

    def as_dict(self) -> dict[str, str]:
        return {"key": self.key, "value": self.value, "meaning": self.meaning}


#: EngineOptions fields a file can set that have no ``trainfit estimate`` flag (DeepSpeed's ZeRO buckets).
ENGINE_EXTRAS = ("overlap_comm", "allgather_bucket_size", "prefetch_bucket_size")


@dataclass(frozen=True, slots=True, kw_only=True)
class ImportedRun:
    """The run a configuration file describes, as trainfit models it.

    ``flags``: the ``trainfit estimate`` flags the file fixed (name → value as the CLI declares it), applied
    over the CLI's own values unless a flag was given explicitly; ``engine_extras``: EngineOptions fields with no
    flag. ``micro_batch``/``grad_accum``/``world_size``/``seq_len`` are None when the file does not fix them.
    """

    source: str
    kind: ConfigKind
    strategy: Strategy
    flags: tuple[tuple[str, Any], ...]
    engine_extras: tuple[tuple[str, Any], ...]
    used: tuple[ImportedSetting, ...]
    ignored: tuple[ImportedSetting, ...]
    world_size: int | None
    micro_batch: int | None
    grad_accum: int | None
    seq_len: int | None

    def as_dict(self) -> dict[str, Any]:
        """The JSON view (``trainfit estimate --from ... --json`` puts it under ``"imported"``)."""
        return {
            "source": self.source,
            "kind": self.kind.value,
            "used": [s.as_dict() for s in self.used],
            "ignored": [s.as_dict() for s in self.ignored],
        }


def show(value: Any) -> str:
    """A value as the file wrote it (JSON), for :class:`ImportedSetting`."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def flag_text(name: str, value: Any) -> str:
    """``--sharding zero2``, ``--no-reshard-after-forward``: a flag as a user types it."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + flag[2:]
    if isinstance(value, float) and value.is_integer():
        value = f"{value:.0e}".replace("+0", "").replace("+", "")
    return f"{flag} {value}"


@dataclass(slots=True)
class Draft:
    """Mutable while an importer reads a file; :meth:`finish` freezes it into an :class:`ImportedRun`."""

    source: str
    kind: ConfigKind
    flags: dict[str, Any] = field(default_factory=dict)
    engine_extras: dict[str, Any] = field(default_factory=dict)
    used: list[ImportedSetting] = field(default_factory=list)
    ignored: list[ImportedSetting] = field(default_factory=list)

    def use(self, key: str, value: Any, flag: str, flag_value: Any, *, note: str = "") -> None:
        """``key`` (= ``value`` in the file) sets ``flag`` to ``flag_value``."""
        self.flags[flag] = flag_value
        meaning = flag_text(flag, flag_value) + (f" ({note})" if note else "")
        self.used.append(ImportedSetting(key=key, value=show(value), meaning=meaning))

    def use_extra(self, key: str, value: Any, name: str, extra: Any) -> None:
        """``key`` sets an EngineOptions field that has no flag."""
        self.engine_extras[name] = extra
        self.used.append(ImportedSetting(key=key, value=show(value), meaning=f"engine {name}={extra}"))

    def note(self, key: str, value: Any, meaning: str) -> None:
        """``key`` was read and agrees with a trainfit default, or decided something that is not one flag."""
        self.used.append(ImportedSetting(key=key, value=show(value), meaning=meaning))

    def ignore(self, key: str, value: Any, reason: str) -> None:
        self.ignored.append(ImportedSetting(key=key, value=show(value), meaning=reason))

    def absorb(self, other: ImportedRun, prefix: str) -> None:
        """Take a nested file's settings (a DeepSpeed config named by accelerate or TrainingArguments)."""
        self.flags.update(other.flags)
        self.engine_extras.update(other.engine_extras)
        for s in other.used:
            self.used.append(ImportedSetting(key=f"{prefix}{s.key}", value=s.value, meaning=s.meaning))
        for s in other.ignored:
            self.ignored.append(ImportedSetting(key=f"{prefix}{s.key}", value=s.value, meaning=s.meaning))

    def finish(
        self, *, seq_len: int | None = None, micro_batch: int | None = None, grad_accum: int | None = None
    ) -> ImportedRun:
        """The Strategy these flags stand for (the flags the file left unset at ``trainfit estimate``'s
        defaults; the sequence length, micro-batch and accumulation steps the keywords give, where the file
        has none, or the Strategy's defaults)."""
        f = self.flags
        unknown = set(f) - _BUILDABLE
        if unknown:  # a programming error in an importer, not a user's
            raise AssertionError(f"importer set flags it cannot build: {sorted(unknown)}")
        optimizer: Any = str(f.get("optimizer", "adamw"))  # strings are coerced to enums by Strategy
        paged = False
        if optimizer.startswith("paged-"):
            optimizer, paged = optimizer.removeprefix("paged-"), True
        seq = f.get("seq", seq_len)
        strategy = Strategy(
            precision=f.get("precision", "amp-bf16"),
            optimizer=optimizer,
            optimizer_impl=f.get("optimizer_impl", "fused"),
            checkpointing=f.get("checkpointing", "none"),
            micro_batch=f.get("batch", micro_batch or 1),
            grad_accum=f.get("grad_accum", grad_accum or 1),
            **({"seq_len": seq} if seq is not None else {}),
            parallelism=Parallelism.for_gpus(f.get("gpus", 1), gpus_per_node=f.get("gpus_per_node", 8)),
            sharding=f.get("sharding", "none"),
            offload=Offload.parse(f.get("offload", "none")),
            engine=EngineOptions(
                engine=f.get("engine", "auto"),
                reshard_after_forward=f.get("reshard_after_forward", True),
                sync_each_batch=f.get("sync_each_batch", True),
                bucket_cap_mb=f.get("bucket_cap_mb", 25),
                reduce_bucket_size=int(f.get("reduce_bucket_size", 5e8)),
                **self.engine_extras,
            ),
            savers=MemorySavers(paged_optimizer=paged, loss=f.get("loss", "standard")),
        )
        return ImportedRun(
            source=self.source,
            kind=self.kind,
            strategy=strategy,
            flags=tuple(f.items()),
            engine_extras=tuple(self.engine_extras.items()),
            used=tuple(self.used),
            ignored=tuple(self.ignored),
            world_size=f.get("gpus"),
            micro_batch=f.get("batch"),
            grad_accum=f.get("grad_accum"),
            seq_len=seq,
        )


#: The flags :meth:`Draft.finish` builds (a subset of ``trainfit estimate``'s STRATEGY_FLAGS).
_BUILDABLE = frozenset(
    {
        "precision", "optimizer", "optimizer_impl", "checkpointing", "batch", "grad_accum", "seq", "gpus",
        "gpus_per_node", "sharding", "offload", "engine", "reshard_after_forward", "sync_each_batch", "bucket_cap_mb",
        "reduce_bucket_size", "loss",
    }
)  # fmt: skip


def refuse(source: str, message: str) -> StrategyError:
    """A one-line refusal naming the file."""
    return StrategyError(f"{source}: {message}")

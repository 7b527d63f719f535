"""Imports: a user's real DeepSpeed, accelerate or TrainingArguments configuration as the trainfit run it
describes — the other direction of :mod:`trainfit.export`.

Each file is read by its own library (``DeepSpeedConfig``, accelerate's config loader and plugins,
``TrainingArguments``), imported lazily inside the functions: ``import trainfit.imports`` stays torch-free,
and ``trainfit estimate`` imports it only for ``--from``. The result (:class:`ImportedRun`) holds the
Strategy, the batch shape the file fixes, and every setting it used (with the flag it became) or ignored
(with why). Settings that change memory materially and cannot be represented are refused in one line
(``StrategyError``); settings that do not change memory are listed as ignored. The tables of what maps to
what are in docs/imports.md and in each module's docstring.

Modules: ``result`` (the typed result and its builder), ``deepspeed``, ``accelerate``, ``training_args``;
``_quiet`` keeps the engines' logging off stdout while they read the file (``--json`` prints only the JSON).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainfit.errors import ConfigError
from trainfit.imports._quiet import library_output_to_stderr
from trainfit.imports.accelerate import strategy_from_accelerate
from trainfit.imports.deepspeed import strategy_from_deepspeed
from trainfit.imports.result import ConfigKind, ImportedRun, ImportedSetting
from trainfit.imports.training_args import strategy_from_training_args

__all__ = [
    "ConfigKind",
    "ImportedRun",
    "ImportedSetting",
    "detect_kind",
    "import_config",
    "strategy_from_accelerate",
    "strategy_from_deepspeed",
    "strategy_from_training_args",
]

#: Keys that only one kind of file has at its top level.
_DEEPSPEED_KEYS = {"zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size", "fp16", "bf16"}
_ACCELERATE_KEYS = {"distributed_type", "compute_environment", "num_processes", "mixed_precision"}
_TRAINING_ARGS_KEYS = {"per_device_train_batch_size", "output_dir", "optim", "gradient_checkpointing"}


def detect_kind(path: Path) -> ConfigKind:
    """A file's kind: ``.yaml``/``.yml`` → accelerate; JSON by its keys (DeepSpeed's ``zero_optimization`` or
    batch keys, accelerate's ``distributed_type``, TrainingArguments' ``per_device_train_batch_size``…)."""
    if not path.is_file():
        raise ConfigError(f"no such file: {path}")
    if path.suffix.lower() in (".yaml", ".yml"):
        return ConfigKind.ACCELERATE
    from trainfit.imports.deepspeed import load_json

    keys = set(load_json(path, path.name))
    for kind, marks in (
        (ConfigKind.TRAINING_ARGS, _TRAINING_ARGS_KEYS),
        (ConfigKind.ACCELERATE, _ACCELERATE_KEYS),
        (ConfigKind.DEEPSPEED, _DEEPSPEED_KEYS),
    ):
        if keys & marks:
            return kind
    raise ConfigError(
        f"{path.name}: not a DeepSpeed config (zero_optimization, train_batch_size…), an accelerate config "
        "(distributed_type…) or TrainingArguments (per_device_train_batch_size…)"
    )


def import_config(
    path: str | Path,
    *,
    gpus: int | None = None,
    micro_batch: int | None = None,
    grad_accum: int | None = None,
    precision: str | None = None,
    seq_len: int | None = None,
    hidden_size: int | None = None,
) -> ImportedRun:
    """The run the file at ``path`` describes, whatever its kind (:func:`detect_kind`). The keywords answer what
    the file leaves ``"auto"`` or out (``trainfit estimate`` passes the flags given explicitly)."""
    p = Path(path)
    kind = detect_kind(p)
    kw: dict[str, Any] = {"seq_len": seq_len, "hidden_size": hidden_size}
    with library_output_to_stderr():  # the engines' import-time logging is not stdout's (``--json``): see _quiet
        if kind is ConfigKind.DEEPSPEED:
            return strategy_from_deepspeed(
                p, gpus=gpus, micro_batch=micro_batch, grad_accum=grad_accum, precision=precision, **kw
            )
        if kind is ConfigKind.ACCELERATE:
            return strategy_from_accelerate(p, micro_batch=micro_batch, grad_accum=grad_accum, **kw)
        return strategy_from_training_args(p, gpus=gpus, **kw)

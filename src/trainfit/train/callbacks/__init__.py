"""Attach a :class:`~trainfit.train.monitor.StabilityMonitor` to training frameworks.

* ``trainfit.train.callbacks.hf.StabilityCallback`` — a Hugging Face ``TrainerCallback``;
* ``trainfit.train.callbacks.lightning.StabilityCallback`` — a Lightning ``Callback``.

Each module imports its framework at import time, so import the one you use.
"""

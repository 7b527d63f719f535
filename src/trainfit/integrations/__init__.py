"""Integrations with training frameworks. ``hf``: :class:`~trainfit.integrations.hf.TrainfitCallback`, a
transformers ``TrainerCallback`` (importing ``trainfit.integrations.hf`` imports transformers; this package
does not)."""

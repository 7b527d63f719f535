"""Test-suite settings shared by every directory.

Hypothesis is derandomised: CI (a fresh clone, no example database) explores the same examples on every run, so
a pass or a failure is reproducible and a landing does not depend on the draw. Exploring new examples is a
deliberate act: ``pytest --hypothesis-profile=explore tests/analytic/test_properties.py`` (the two
counterexamples such a run found are kept as ``@example``s there).

Under pytest-xdist each worker runs torch with one intra-op thread (see below).

Large trace matrices run a pairwise covering subset by default (:func:`pairwise`): every pair of values of any two
axes still meets in some cell, and the rest are marked ``full_matrix`` and skipped (they show as skipped, with the
reason). ``TRAINFIT_FULL_MATRIX=1 pytest`` runs every cell: do it when you change what such a matrix tests. The
suite must stay under ~10 minutes on two cores (CI); the full products are what made it 15.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Iterable
from typing import Any

import pytest
from hypothesis import settings

# One intra-op thread per xdist worker: CI runs 2 workers on 2 cores, and torch's default (one thread per core)
# oversubscribes them — small real-tensor ops (the doctor's and TrainStep's CPU runs) were 10–30× slower with two
# threads fighting for a core. Set before torch is imported; a module that already imported it is told directly.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)

settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("ci")


FULL_MATRIX = os.environ.get("TRAINFIT_FULL_MATRIX") == "1"


def pairwise(cells: Iterable[Any]) -> list[Any]:
    """``cells`` (``pytest.param``s or plain value tuples), with every cell that adds no new pair of axis values
    — greedily, in the given order — marked ``full_matrix``. A cell's axes are its parameter values."""
    covered: set[tuple[int, Any, int, Any]] = set()
    out = []
    for cell in cells:
        param = cell if hasattr(cell, "values") and hasattr(cell, "marks") else pytest.param(*cell)
        pairs = {(i, repr(a), j, repr(b)) for (i, a), (j, b) in itertools.combinations(enumerate(param.values), 2)} or {
            (0, repr(param.values), 0, "")
        }
        if pairs <= covered:
            param = pytest.param(*param.values, id=param.id, marks=(*param.marks, pytest.mark.full_matrix))
        covered |= pairs
        out.append(param)
    return out


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if FULL_MATRIX:
        return
    skip = pytest.mark.skip(reason="full matrix only (TRAINFIT_FULL_MATRIX=1); the pairwise cells run")
    for item in items:
        if item.get_closest_marker("full_matrix") is not None:
            item.add_marker(skip)


@pytest.fixture
def transformers_release(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Pin the transformers release that version-dependent modelling reads (``arch.config.installed_transformers``):
    ``transformers_release((5, 24))``; ``None`` models an environment without transformers. Specs built afterwards
    follow it (the catalog caches configs, not specs)."""

    def pin(release: tuple[int, int] | None) -> None:
        monkeypatch.setattr("trainfit.arch.config.installed_transformers", lambda: release)

    return pin

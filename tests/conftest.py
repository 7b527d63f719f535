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

import importlib.abc
import importlib.machinery
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


class _ShmOpUncompiled(importlib.abc.MetaPathFinder):
    """DeepSpeed's ``TorchBackend`` (deepspeed/comm/torch.py ``build_shm_op``) JIT-compiles its CPU shared-memory
    all-reduce op (csrc/cpu/comm/shm*.cpp, ninja and c++) the first time a DeepSpeed trace sets up its
    communication layer. Only ``inference_all_reduce`` (DeepSpeed's inference TP layers) ever calls it: the traced
    ZeRO engines on the fake process group do not, so the traces are the same without it. The build is keyed by
    the sources' paths, so every fresh clone (CI) compiled it again: 1-2 minutes of one xdist worker (the first
    DeepSpeed test, ``tests/cli/test_estimate_distributed.py::test_trace_of_deepspeed_from_the_cli``, took 125 s).
    Here the builder's ``load`` returns None (DeepSpeed's own "no shm op" path) and nothing is compiled; the rest
    of ``build_shm_op`` runs as shipped, its probe of the compatible ops and the "built successfully" line it prints
    to stdout included (which the CLI test checks that ``--json`` keeps out of its output).

    Installed as an import hook, not by importing DeepSpeed here: the tests of its quiet import need it unimported
    (and importing it costs every worker seconds)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "deepspeed.comm.torch":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            module.build_shm_op = _without_compiling(module.build_shm_op)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def _without_compiling(build_shm_op: Any) -> Any:
    def build() -> Any:
        from deepspeed.accelerator import get_accelerator

        builder = get_accelerator().get_op_builder("ShareMemCommBuilder")
        if getattr(builder, "__name__", None) != "ShareMemCommBuilder":  # an accelerator without it
            return build_shm_op()
        load = builder.load
        builder.load = lambda self, verbose=False: None
        try:
            return build_shm_op()
        finally:
            builder.load = load

    return build


if not any(isinstance(f, _ShmOpUncompiled) for f in sys.meta_path):
    sys.meta_path.insert(0, _ShmOpUncompiled())

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

"""Test-suite settings shared by every directory.

Hypothesis is derandomised: CI (a fresh clone, no example database) explores the same examples on every run, so
a pass or a failure is reproducible and a landing does not depend on the draw. Exploring new examples is a
deliberate act: ``pytest --hypothesis-profile=explore tests/analytic/test_properties.py`` (the two
counterexamples such a run found are kept as ``@example``s there).

Under pytest-xdist each worker runs torch with one intra-op thread (see below).
"""

from __future__ import annotations

import os
import sys

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

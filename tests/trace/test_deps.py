"""The trace's import guards (trainfit.trace._deps)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("torch")

_PROBE = """
import sys
import kernels
calls = []
original = kernels.get_kernel
def recorder(*a, **k):
    calls.append(a)
    return original(*a, **k)
kernels.get_kernel = recorder
from trainfit.trace._deps import require_torch
require_torch()
import peft  # imports bitsandbytes' integration too
assert "bitsandbytes" in sys.modules
assert kernels.get_kernel is recorder, "kernels.get_kernel not restored"
print("hub kernels asked:", len(calls))
"""


def test_bitsandbytes_is_imported_without_asking_the_kernel_hub() -> None:
    """On a CPU with AVX512-BF16 (this machine's), bitsandbytes' import asks the Hugging Face kernel hub for a CPU
    4-bit GEMM: a network request, and, refused offline, a warning on the user's terminal before any output. The
    trace imports it first with the hub refused and the warning silenced, then puts ``kernels.get_kernel`` back.
    (Where the CPU lacks AVX512-BF16, bitsandbytes asks nothing and this test cannot tell the difference.)"""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("kernels")
    pytest.importorskip("peft")
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300, check=True)
    assert "hub kernels asked: 0" in out.stdout
    assert "gemm_4bit_forward" not in out.stderr and "kernels-community" not in out.stderr, out.stderr

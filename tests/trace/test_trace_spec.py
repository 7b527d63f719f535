"""``trace_spec`` end to end on tiny Hugging Face configs: report contents, what is emulated, laziness."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainfit.arch import count_params
from trainfit.result import Component, Method, Phase
from trainfit.strategy import Strategy

from .conftest import tiny_spec

pytest.importorskip("torch")
from trainfit.trace import trace_spec

C = Component


def test_report_contents() -> None:
    spec = tiny_spec("llama", num_hidden_layers=6)
    seen: list[float] = []
    r = trace_spec(spec, Strategy(micro_batch=2, seq_len=64), modules=True, progress=lambda _m, f: seen.append(f))
    assert r.method is Method.TRACE and r.model_name == spec.name
    assert r.params == count_params(spec)  # the real module has exactly the inventory's parameters
    assert [p.phase for p in r.phases] == list(Phase)
    assert r.extra["layers_traced"] == [1, 2] and r.extra["extrapolated"] is True
    rows = r.extra["modules"]
    assert rows and all(rows[i]["activation_bytes"] >= rows[i + 1]["activation_bytes"] for i in range(len(rows) - 1))
    assert any(row["module"].startswith("model.layers.*") and row["instances"] == 6 for row in rows)
    assert r.extra["sdpa_backends"] == {"flash": 2}  # 1 layer x 2 steps in the base trace
    json.dumps(dict(r.extra))
    assert seen and seen[-1] == 1.0 and seen == sorted(seen)
    assert r.peak_bytes == max(p.total_bytes for p in r.phases)


def test_autocast_copies_only_under_amp() -> None:
    spec = tiny_spec("llama", num_hidden_layers=2)
    s = dict(micro_batch=1, seq_len=32)
    amp = trace_spec(spec, Strategy(precision="amp-bf16", **s)).phase(Phase.FORWARD).components
    fp32 = trace_spec(spec, Strategy(precision="fp32", **s)).phase(Phase.FORWARD).components
    master = trace_spec(spec, Strategy(precision="master-bf16", **s)).phase(Phase.FORWARD).components
    # every matmul weight (all but norms and the embedding, which is gathered, not multiplied) once in bf16
    matmul_params = count_params(spec) - 64 * 256 - 64 * (2 * 2 + 1)
    assert amp[C.AUTOCAST_COPIES] == 2 * matmul_params
    assert fp32[C.AUTOCAST_COPIES] == master[C.AUTOCAST_COPIES] == 0
    n_tensors = 2 * 9 + 3  # per layer: 7 projections + 2 norms; embedding, lm_head, final norm
    assert 0 <= master[C.MASTER_WEIGHTS] - 4 * count_params(spec) < 512 * n_tensors  # 512-byte blocks


def test_eager_attention_saves_probabilities() -> None:
    spec = tiny_spec("llama", num_hidden_layers=2)
    b, s, heads = 2, 256, 4
    sdpa = trace_spec(spec, Strategy(micro_batch=b, seq_len=s)).phase(Phase.FORWARD).components
    eager = trace_spec(spec, Strategy(micro_batch=b, seq_len=s, attention="eager")).phase(Phase.FORWARD).components
    scores = b * heads * s * s
    # per layer at least: fp32 softmax output (saved by softmax backward) + bf16 probabilities for the matmul
    assert eager[C.ACTIVATIONS] - sdpa[C.ACTIVATIONS] >= 2 * scores * (4 + 2) * 0.9


def test_checkpointing_full_keeps_only_layer_inputs() -> None:
    spec = tiny_spec("llama", num_hidden_layers=4)
    st = dict(micro_batch=2, seq_len=128, precision="fp32")
    none = trace_spec(spec, Strategy(**st)).phase(Phase.FORWARD).components[C.ACTIVATIONS]
    full = trace_spec(spec, Strategy(checkpointing="full", **st)).phase(Phase.FORWARD).components[C.ACTIVATIONS]
    hidden = 2 * 128 * 64 * 4  # one fp32 residual-stream tensor
    assert full < none / 4
    assert full >= 4 * hidden  # each layer's checkpoint keeps its input


@pytest.mark.parametrize("checkpointing", ["none", "full", "sqrt"])
def test_nothing_from_the_forward_survives_into_the_optimizer_step(checkpointing: str) -> None:
    """Gemma-2's eager masks are inputs of every checkpointed layer; once backward is done, neither they
    nor anything else the forward made may still be alive (the sqrt segments once kept the last step's
    layer arguments)."""
    spec = tiny_spec("gemma2", num_hidden_layers=9)
    st = Strategy(micro_batch=2, seq_len=128, checkpointing=checkpointing)  # type: ignore[arg-type]
    step = trace_spec(spec, st, extrapolate=False).phase(Phase.OPTIMIZER_STEP)
    assert step.components.get(C.ACTIVATIONS, 0) == 0


@pytest.mark.parametrize("family", ["gpt2", "bert", "mixtral", "deepseek_v2", "gemma2", "qwen2"])
def test_families_trace(family: str) -> None:
    r = trace_spec(tiny_spec(family), Strategy(micro_batch=1, seq_len=32))
    assert r.peak_bytes > 0 and all(v >= 0 for p in r.phases for v in p.components.values())


IMPORT_CHECK = """
import sys
from trainfit import trace
import trainfit.trace
assert callable(trace), "from trainfit import trace must be callable"
assert "torch" not in sys.modules, "importing trainfit.trace must not import torch"
sys.modules["torch"] = None  # simulate an install without torch
from trainfit.errors import DependencyError
from trainfit.arch import load_model
from trainfit.strategy import Strategy
try:
    trainfit.trace.trace_spec(load_model("gpt2"), Strategy())
except DependencyError as e:
    assert "pip install" in str(e)
    print("OK")
"""


def test_lazy_import_and_dependency_error() -> None:
    res = subprocess.run([sys.executable, "-c", IMPORT_CHECK], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "OK"

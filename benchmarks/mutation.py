"""Mutation check: flip key formulas of the analytic model and show that the tests catch every flip.

Each mutation is a one-place text edit of a *copy* of ``src/trainfit`` in a temporary directory (the working
tree is never touched); the relevant test files then run in a subprocess with that copy first on
``PYTHONPATH``. A mutation is caught when those tests fail. The unmutated copy runs first and must pass.

Usage: python benchmarks/mutation.py            (all mutations; exit status 1 if one is not caught)
       python benchmarks/mutation.py --list     (names only)
       python benchmarks/mutation.py NAME ...   (some of them)

Issue 15 #20 listed the first four: each passed the whole suite before the independent checks in
tests/analytic/test_independent_*.py and test_sdpa_math.py existed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "trainfit"

STATES = "analytic/states.py"
ACTIVATIONS = "analytic/activations.py"
T_STATES = "tests/analytic/test_independent_states.py"
T_BACKWARD = "tests/analytic/test_independent_backward.py"
T_MATH = "tests/analytic/test_sdpa_math.py"
T_SAVED_MATH = "tests/analytic/test_saved_activations.py::test_sdpa_math_kernel_matches_autograd"


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    file: str  # relative to src/trainfit
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS = [
    Mutation(
        "sgd-momentum-states-zero",
        "SGD-momentum keeps no state",
        STATES,
        "    if opt is Optimizer.SGD:\n        return 0",
        "    if opt in (Optimizer.SGD, Optimizer.SGD_MOMENTUM):\n        return 0",
        (T_STATES,),
    ),
    Mutation(
        "lion-states-zero",
        "Lion keeps no state",
        STATES,
        "    if opt is Optimizer.SGD:\n        return 0",
        "    if opt in (Optimizer.SGD, Optimizer.LION):\n        return 0",
        (T_STATES,),
    ),
    Mutation(
        "fused-adamw-foreach-temp",
        "fused AdamW given foreach's list-sized sqrt buffer",
        STATES,
        "if opt is Optimizer.ADAMW and strategy.optimizer_impl is OptimizerImpl.FOREACH:",
        "if opt is Optimizer.ADAMW:",
        (T_STATES,),
    ),
    Mutation(
        "rmsnorm-backward-halved",
        "HF RMSNorm's backward temporaries halved",
        ACTIVATIONS,
        "norm = 20 * t * h if",
        "norm = 10 * t * h if",
        (T_BACKWARD,),
    ),
    Mutation(
        "adamw-8bit-step-temp",
        "bitsandbytes 8-bit AdamW given two fp32 copies of the largest tensor in step()",
        STATES,
        "    elif opt is Optimizer.LION:\n",
        "    elif opt is Optimizer.ADAMW_8BIT:\n        temp += 2 * _alloc(largest, 32)\n"
        "    elif opt is Optimizer.LION:\n",
        (T_STATES,),
    ),
    Mutation(
        "foreach-adamw-no-temp",
        "foreach AdamW without its sqrt(exp_avg_sq) list",
        STATES,
        "        temp += list_state  # foreach",
        "        temp += 0  # foreach",
        (T_STATES,),
    ),
    Mutation(
        "foreach-temp-unrounded",
        "foreach AdamW's list not rounded per tensor",
        STATES,
        "        list_state = sum(m * _alloc(t.numel, state_bits) for t, m in trained)",
        "        list_state = trainable_p * state_bits // 8",
        (T_STATES,),
    ),
    Mutation(
        "fused-step-counter-dropped",
        "fused AdamW's device step counters left out",
        STATES,
        "step = _alloc(1, 32) if impl is OptimizerImpl.FUSED else 0",
        "step = 0",
        (T_STATES,),
    ),
    Mutation(
        "lion-temp-fp32",
        "Lion's step temporaries always fp32",
        STATES,
        "temp += 2 * _alloc(largest, state_bits)  # exp_avg.clone()",
        "temp += 2 * _alloc(largest, 32)  # exp_avg.clone()",
        (T_STATES,),
    ),
    Mutation(
        "adafactor-16bit-copies",
        "Adafactor on 16-bit parameters without the fp32 grad and parameter copies",
        STATES,
        "temp += (2 if updated_bits == 32 else 4) * _alloc(largest, 32)",
        "temp += 2 * _alloc(largest, 32)",
        (T_STATES,),
    ),
    Mutation(
        "layernorm-backward-halved",
        "LayerNorm's backward temporaries halved",
        ACTIVATIONS,
        "else 2 * w.residual * t * h",
        "else w.residual * t * h",
        (T_BACKWARD,),
    ),
    Mutation(
        "sdpa-math-softmax-16bit",
        "SDPA math kernel's saved softmax in 2 bytes instead of fp32",
        ACTIVATIONS,
        'bytes=4 * b * nh * s * s,\n                    formula="4·b·heads·s² (fp32 output)"',
        'bytes=2 * b * nh * s * s,\n                    formula="4·b·heads·s² (fp32 output)"',
        (T_MATH, T_SAVED_MATH),
    ),
    Mutation(
        "sdpa-math-kv-not-expanded",
        "SDPA math kernel's k/v never expanded to every head",
        ACTIVATIONS,
        "            if spec.sdpa_gqa or b > 1:\n                heads = nh",
        "            if False:\n                heads = nh",
        (T_MATH, T_SAVED_MATH),
    ),
    Mutation(
        "sdpa-math-no-upcast",
        "SDPA math kernel keeps 16-bit q/k/v copies",
        ACTIVATIONS,
        "bytes=4 * t * (qd + full + full_v)",
        "bytes=a * t * (qd + full + full_v)",
        (T_MATH, T_SAVED_MATH),
    ),
]


def _copy_with(mutation: Mutation | None, into: Path) -> None:
    if into.exists():
        shutil.rmtree(into)
    shutil.copytree(PACKAGE, into, ignore=shutil.ignore_patterns("__pycache__"))
    if mutation is None:
        return
    path = into / mutation.file
    text = path.read_text()
    if text.count(mutation.old) != 1:
        raise SystemExit(
            f"{mutation.name}: the text to mutate occurs {text.count(mutation.old)} times in {mutation.file}"
        )
    path.write_text(text.replace(mutation.old, mutation.new))


def _run_tests(tests: tuple[str, ...], pythonpath: Path) -> tuple[int, str]:
    """pytest's exit status (0 passed, 1 some test failed; anything else is an error, not a catch) and the
    first failing test or the last line of output."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(pythonpath), str(ROOT)]), PYTHONDONTWRITEBYTECODE="1")
    check = subprocess.run(
        [sys.executable, "-c", "import trainfit; print(trainfit.__file__)"], env=env, capture_output=True, text=True
    )
    if not check.stdout.strip().startswith(str(pythonpath)):
        raise SystemExit(f"the mutated copy is not the trainfit imported: {check.stdout or check.stderr}")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-rf", *tests]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    failed = [ln.split(" - ")[0].removeprefix("FAILED ") for ln in lines if ln.startswith("FAILED ")]
    return proc.returncode, failed[0].split("/")[-1] if failed else (lines[-1] if lines else proc.stderr[-200:])


def main(argv: list[str]) -> int:
    if "--list" in argv:
        for m in MUTATIONS:
            print(f"{m.name:28} {m.what}")
        return 0
    chosen = [m for m in MUTATIONS if not argv or m.name in argv]
    unknown = set(argv) - {m.name for m in MUTATIONS}
    if unknown:
        raise SystemExit(f"unknown mutation(s): {', '.join(sorted(unknown))}")
    with tempfile.TemporaryDirectory(prefix="trainfit-mutation-") as tmp:
        pkg = Path(tmp) / "trainfit"
        every = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        _copy_with(None, pkg)
        t0 = time.perf_counter()
        rc, last = _run_tests(every, Path(tmp))
        print(f"baseline (no mutation): {'passes' if rc == 0 else 'FAILS'} — {last} ({time.perf_counter() - t0:.0f} s)")
        if rc != 0:
            print("the unmutated tests fail, so no mutation result means anything")
            return 1
        missed = []
        print("| mutation | what | caught by | s |\n|---|---|---|---:|")
        for m in chosen:
            _copy_with(m, pkg)
            t0 = time.perf_counter()
            rc, last = _run_tests(m.tests, Path(tmp))
            if rc != 1:  # passed (0), or broke the run itself (collection or import error): not a catch
                missed.append(m.name)
            verdict = last if rc == 1 else ("NOT CAUGHT" if rc == 0 else f"ERROR (pytest exit {rc}): {last}")
            print(f"| {m.name} | {m.what} | {verdict} | {time.perf_counter() - t0:.0f} |")
    print(
        f"\n{len(chosen) - len(missed)} of {len(chosen)} mutations caught"
        + (f"; missed: {', '.join(missed)}" if missed else "")
    )
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

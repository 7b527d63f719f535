"""Loading the user's factory: good and bad ``module:function`` targets raise DoctorError, not tracebacks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from trainfit.doctor import DoctorError, load_setup

CASES = Path(__file__).with_name("cases.py")


def test_loads_file_and_dotted_targets():
    by_file = load_setup(f"{CASES}:healthy")
    assert isinstance(by_file.model, torch.nn.Module)
    by_module = load_setup("tests.doctor.cases:tiny_gradients")
    assert callable(by_module.loss_fn)


@pytest.mark.parametrize(
    ("target", "match"),
    [
        ("no_colon_here", "expected 'file.py:function'"),
        ("missing_file.py:setup", "no such file"),
        (f"{CASES}:nope", "has no function 'nope'"),
        (f"{CASES}:raises", "raised RuntimeError: cannot build the model"),
        (f"{CASES}:wrong_shape", "must return"),
        ("trainfit_no_such_module:f", "cannot import module"),
    ],
)
def test_bad_targets(target, match):
    with pytest.raises(DoctorError, match=match):
        load_setup(target)


def test_module_target_is_found_in_the_current_directory(tmp_path, monkeypatch):
    """`trainfit doctor cases:healthy` run from the directory holding cases.py: the console script's sys.path
    does not contain the cwd, so the module was not found. It is now put first, as `python -m` does."""
    name = "trainfit_doctor_cwd_case"
    (tmp_path / f"{name}.py").write_text(
        "import torch\n"
        "from helper_next_to_it import WIDTH\n"  # a sibling imported at import time
        "def setup():\n"
        "    from helper_next_to_it import lr  # and one imported when the factory runs\n"
        "    model = torch.nn.Linear(WIDTH, 1)\n"
        "    batches = [(torch.ones(2, WIDTH), torch.ones(2, 1))]\n"
        "    return model, batches, lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(),"
        " lambda p: torch.optim.SGD(p, lr=lr())\n"
    )
    (tmp_path / "helper_next_to_it.py").write_text("WIDTH = 3\ndef lr():\n    return 0.1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    for mod in (name, "helper_next_to_it"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    setup = load_setup(f"{name}:setup")
    assert setup.model.in_features == 3
    assert str(tmp_path) not in sys.path  # only while importing and calling the factory

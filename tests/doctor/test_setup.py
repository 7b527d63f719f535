"""Loading the user's factory: good and bad ``module:function`` targets raise DoctorError, not tracebacks."""

from __future__ import annotations

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

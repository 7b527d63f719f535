"""Load the user's training setup from ``path/to/file.py:function`` or ``package.module:function``.

The factory takes no arguments and returns a :class:`DoctorSetup` or the 4-tuple
``(model, batches, loss_fn, make_optimizer)``: ``loss_fn(model, batch)`` returns a scalar loss and
``make_optimizer(params)`` builds a fresh optimizer (the doctor needs several, one per run, all from the
same initial weights).

For ``package.module:function`` the current directory is put first on ``sys.path`` while the module is
imported and the factory runs, as ``python -m`` does: ``trainfit doctor cases:setup`` finds ``./cases.py``
(the ``trainfit`` console script's ``sys.path`` starts with its own bin directory, not the cwd). For
``file.py:function`` the file's directory is, so that it can import its siblings.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainfit.doctor.findings import DoctorError


@dataclass(frozen=True, slots=True, kw_only=True)
class DoctorSetup:
    model: torch.nn.Module
    batches: Iterable[Any]
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    make_optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


def _is_file_spec(module_part: str) -> bool:
    return module_part.endswith(".py") or "/" in module_part or "\\" in module_part


@contextlib.contextmanager
def _on_sys_path(directory: str) -> Iterator[None]:
    """``directory`` first on ``sys.path`` for the duration (unless it is already there)."""
    if directory in sys.path:
        yield
        return
    sys.path.insert(0, directory)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(directory)


def _search_dir(spec: str) -> str:
    module_part = spec.rpartition(":")[0]
    if _is_file_spec(module_part):
        return str(Path(module_part).expanduser().resolve().parent)
    return os.getcwd()


def _import_target(spec: str) -> Callable[[], Any]:
    module_part, sep, func_name = spec.rpartition(":")
    if not sep or not module_part or not func_name:
        raise DoctorError(f"expected 'file.py:function' or 'package.module:function', got '{spec}'")
    if _is_file_spec(module_part):
        path = Path(module_part).expanduser().resolve()
        if not path.is_file():
            raise DoctorError(f"no such file: {module_part}")
        name = f"_trainfit_doctor_user_{abs(hash(str(path)))}"
        mod_spec = importlib.util.spec_from_file_location(name, path)
        if mod_spec is None or mod_spec.loader is None:
            raise DoctorError(f"cannot import {module_part}")
        module = importlib.util.module_from_spec(mod_spec)
        try:
            sys.modules[name] = module
            mod_spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(name, None)
            raise DoctorError(f"importing {module_part} failed: {type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(module_part)
        except ImportError as exc:
            raise DoctorError(f"cannot import module '{module_part}': {exc}") from exc
        except Exception as exc:
            raise DoctorError(f"importing {module_part} failed: {type(exc).__name__}: {exc}") from exc
    func = getattr(module, func_name, None)
    if func is None or not callable(func):
        raise DoctorError(f"'{module_part}' has no function '{func_name}'")
    return func  # type: ignore[no-any-return]


def coerce_setup(value: Any, origin: str = "the factory") -> DoctorSetup:
    """Accept a DoctorSetup or a (model, batches, loss_fn, make_optimizer) tuple; check the pieces."""
    if isinstance(value, DoctorSetup):
        setup = value
    elif isinstance(value, tuple | list) and len(value) == 4:
        model, batches, loss_fn, make_optimizer = value
        setup = DoctorSetup(model=model, batches=batches, loss_fn=loss_fn, make_optimizer=make_optimizer)
    else:
        raise DoctorError(
            f"{origin} must return (model, batches, loss_fn, make_optimizer) or a DoctorSetup, "
            f"got {type(value).__name__}"
        )
    if not isinstance(setup.model, torch.nn.Module):
        raise DoctorError(f"{origin}: model must be a torch.nn.Module, got {type(setup.model).__name__}")
    if not callable(setup.loss_fn) or not callable(setup.make_optimizer):
        raise DoctorError(f"{origin}: loss_fn and make_optimizer must be callables")
    try:
        iter(setup.batches)
    except TypeError:
        raise DoctorError(f"{origin}: batches must be iterable") from None
    return setup


def load_setup(spec: str) -> DoctorSetup:
    """Import ``spec`` ('file.py:function' or 'pkg.module:function'), call it and validate the result."""
    with _on_sys_path(_search_dir(spec)):
        func = _import_target(spec)
        try:
            value = func()
        except Exception as exc:
            raise DoctorError(f"{spec} raised {type(exc).__name__}: {exc}") from exc
    return coerce_setup(value, origin=spec)

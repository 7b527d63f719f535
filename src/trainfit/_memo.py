"""A small bounded memo for the pure functions the estimate calls many times with the same inputs.

The planner and the micro-batch search ask the analytic model about the same model and many related setups:
the parameter inventory of one ``ModelSpec``, the step quantities of one ``Strategy``, the allocator
simulation of one stream. Each is a pure function of its inputs, so its result is kept, least recently used
first out. ``ModelSpec`` holds its config dict and is not hashable: callers key it by ``repr`` (every field).
Results must be immutable (frozen dataclasses, tuples): callers share them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")

__all__ = ["Memo", "spec_key"]


class Memo(Generic[V]):
    """``memo.get(key, compute)``: the value for ``key``, computed once while it stays among the last ``size``."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._data: OrderedDict[Hashable, V] = OrderedDict()

    def get(self, key: Hashable, compute: Callable[[], V]) -> V:
        data = self._data
        if key in data:
            data.move_to_end(key)
            return data[key]
        value = data[key] = compute()
        if len(data) > self.size:
            data.popitem(last=False)
        return value

    def peek(self, key: Hashable) -> V | None:
        """The value kept for ``key`` (None: none), without computing one."""
        data = self._data
        if key in data:
            data.move_to_end(key)
            return data[key]
        return None

    def put(self, key: Hashable, value: V) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        if len(self._data) > self.size:
            self._data.popitem(last=False)

    def clear(self) -> None:
        self._data.clear()

    def __len__(self) -> int:
        return len(self._data)


#: ``repr`` of recently seen specs by identity (each entry holds its spec, so an id is not reused while cached).
_KEYS: OrderedDict[int, tuple[object, str]] = OrderedDict()


def spec_key(spec: object) -> str:
    """``repr(spec)`` (every field: the memo key of a ``ModelSpec``), computed once per spec object — a 70B
    spec's repr with its config dict costs tens of microseconds, and the planner asks thousands of times."""
    hit = _KEYS.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    key = repr(spec)
    _KEYS[id(spec)] = (spec, key)
    if len(_KEYS) > 64:
        _KEYS.popitem(last=False)
    return key

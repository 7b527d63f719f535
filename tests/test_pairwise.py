"""The suite's pairwise subset of large trace matrices (tests/conftest.py): the cells it keeps still meet every
pair of values of any two axes that the full product meets, and it marks the rest ``full_matrix``."""

from __future__ import annotations

import itertools

import pytest

from tests.conftest import pairwise


def _pairs(cells: list[tuple[object, ...]]) -> set[tuple[int, object, int, object]]:
    return {(i, a, j, b) for c in cells for (i, a), (j, b) in itertools.combinations(enumerate(c), 2)}


@pytest.mark.parametrize("sizes", [(2, 2, 2), (6, 4, 2, 2), (3, 5), (1, 4, 3)])
def test_kept_cells_cover_every_pair(sizes: tuple[int, ...]) -> None:
    full = list(itertools.product(*(range(n) for n in sizes)))
    params = pairwise(pytest.param(*c, id="-".join(map(str, c))) for c in full)
    kept = [tuple(p.values) for p in params if not any(m.name == "full_matrix" for m in p.marks)]
    assert [p.id for p in params] == ["-".join(map(str, c)) for c in full]  # same cells, same ids, same order
    assert _pairs(kept) == _pairs(full)
    if sum(n > 1 for n in sizes) > 2:
        assert len(kept) < len(full)  # a product of three or more real axes is thinned

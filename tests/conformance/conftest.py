"""The conformance suite runs every test once per available backend, with poisoned outputs.

Adding a backend to the registry adds it here: nothing in the tests names a backend.  Every result
buffer that a backend allocates through ``fastattn._arrays.empty_bhsd`` is filled with NaN first,
so an element a kernel forgets to write fails the comparison instead of passing by luck.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import fastattn
from fastattn import _arrays


def _backends() -> list[str]:
    return [name for name, status in fastattn.backends.available().items() if status.available]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", _backends())


@pytest.fixture(scope="session", autouse=True)
def poisoned_outputs() -> Iterator[None]:
    unpoisoned = _arrays.empty_bhsd

    def poisoned(xp: Any, shape: tuple[int, int, int, int], dtype: Any, layout: str) -> Any:
        result = unpoisoned(xp, shape, dtype, layout)
        result[...] = np.nan
        return result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_arrays, "empty_bhsd", poisoned)
        yield

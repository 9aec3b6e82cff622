"""NaN-filled result buffers: an element a backend never writes then fails every comparison."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from fastattn import _arrays


def poisoned_allocator() -> Callable[[Any, tuple[int, int, int, int], Any, str], Any]:
    """``_arrays.empty_bhsd`` whose results start as NaN; patch it over the original."""
    unpoisoned = _arrays.empty_bhsd

    def poisoned(xp: Any, shape: tuple[int, int, int, int], dtype: Any, layout: str) -> Any:
        result = unpoisoned(xp, shape, dtype, layout)
        result[...] = np.nan
        return result

    return poisoned

"""Results of the sharded calls are allocated NaN-filled, as the conformance suite's are."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fastattn import _arrays

from .._poison import poisoned_allocator


@pytest.fixture(autouse=True)
def poisoned_outputs() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_arrays, "empty_bhsd", poisoned_allocator())
        yield

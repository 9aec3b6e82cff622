"""A fresh random generator per test, seeded from the test's own name (reproducible per test)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A generator seeded from the test's node id."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))

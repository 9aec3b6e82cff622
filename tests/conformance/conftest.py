"""The conformance suite runs every test once per available backend, with poisoned outputs.

Adding a backend to the registry adds it here: nothing in the tests names a backend.  Every result
buffer that a backend allocates through ``fastattn._arrays.empty_bhsd`` is filled with NaN first,
so an element a kernel forgets to write fails the comparison instead of passing by luck (the ``cpu``
backend allocates its own results: tests/conftest.py poisons those, for every test).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import fastattn
from fastattn import _arrays

from .._poison import poisoned_allocator


def _backends(config: pytest.Config) -> list[str]:
    """The available backends, or those of ``--backends`` (each must be available)."""
    available = [name for name, status in fastattn.backends.available().items() if status.available]
    chosen = config.getoption("--backends")
    if chosen is None:
        return available
    names = [name.strip() for name in chosen.split(",") if name.strip()]
    missing = [name for name in names if name not in available]
    if missing or not names:
        raise pytest.UsageError(f"--backends: expected some of {available}, received {chosen!r}")
    return names


def _devices() -> list[str]:
    """"cpu", plus "cuda" where CuPy sees a device (the GPU runs of the suite)."""
    try:
        import cupy

        return ["cpu", "cuda"] if cupy.cuda.runtime.getDeviceCount() > 0 else ["cpu"]
    except Exception:  # CuPy missing, or no driver: host only
        return ["cpu"]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Tests taking ``backend`` and ``device`` run per (backend, device it serves); ``backend``
    alone means host arrays."""
    if "backend" not in metafunc.fixturenames:
        return
    if "device" in metafunc.fixturenames:
        pairs = [
            (name, device)
            for name in _backends(metafunc.config)
            for device in _devices()
            if device in fastattn.backends.get(name).devices
        ]
        metafunc.parametrize("backend,device", pairs, ids=[f"{name}-{device}" for name, device in pairs])
    else:
        metafunc.parametrize("backend", _backends(metafunc.config))


@pytest.fixture(scope="session", autouse=True)
def poisoned_outputs() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_arrays, "empty_bhsd", poisoned_allocator())
        yield

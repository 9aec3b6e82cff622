"""Test-wide settings: hypothesis runs without deadlines (the machine is shared and noisy),
``--backends`` narrows the conformance suite to some backends (CI's reruns: one ISA level, the
sanitized build), and the ``cpu`` backend's results start as NaN."""

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from fastattn._cpu import _flash

settings.register_profile(
    "fastattn",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile("fastattn")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backends",
        default=None,
        help="comma-separated backends the conformance suite runs on (default: every available one)",
    )


@pytest.fixture(scope="session", autouse=True)
def poisoned_cpu_results() -> Iterator[None]:
    """Every result the ``cpu`` backend allocates (outputs, lse, gradients) starts as NaN in every
    test, so an element its kernels never write fails the comparison: fresh pages from the OS are
    zero, and a reused block holds an earlier call's result, either of which can pass by luck."""
    previous = _flash.poison_results(True)
    yield
    _flash.poison_results(previous)

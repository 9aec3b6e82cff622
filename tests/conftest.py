"""Test-wide settings: hypothesis runs without deadlines (the machine is shared and noisy), and
``--backends`` narrows the conformance suite to some backends (CI's reruns: one ISA level, the
sanitized build)."""

import pytest
from hypothesis import HealthCheck, settings

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

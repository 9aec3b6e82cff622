"""Test-wide settings: hypothesis runs without deadlines (the machine is shared and noisy)."""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "fastattn",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile("fastattn")

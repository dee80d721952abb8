"""Test configuration: hypothesis profiles sized for CI."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile("dev", parent=settings.get_profile("ci"), max_examples=20)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

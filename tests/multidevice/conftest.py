"""Multi-device tests need 8 fake CPU devices (see tests/conftest.py)."""

import jax
import pytest

if jax.device_count() != 8:
    raise pytest.UsageError(
        f"tests/multidevice needs 8 devices; jax has {jax.device_count()}. Set "
        "XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/test_multidevice.py does)."
    )

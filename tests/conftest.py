"""Test configuration: hypothesis profiles sized for CI, where multi-device tests run, and which tests are slow.

Tests under ``tests/multidevice`` need 8 (fake) devices, which XLA only makes
when ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` is set before jax
is imported.  A normal run skips collecting them and ``test_multidevice.py``
runs them in a subprocess with the flag; a run with the flag set collects
them directly instead.

A test is marked ``slow`` where its recorded time (``tests/durations.json``,
written by ``tests/support/durations.py`` from a ``--durations=0`` report) is
at least 0.75 s: ``pytest -m "not slow"`` is the inner loop, and CI runs
every test.
"""

import os

# On a GPU each test process takes memory as it needs it: by default XLA takes 75% of the GPU per process, and the
# suite's test processes share one GPU.  Set before jax starts a backend (a value given outside is kept).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import chex
import jax
import pytest
from hypothesis import HealthCheck, settings

from jax_session_state.attention import _native
from tests.support import durations

settings.register_profile(
    "ci",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile("dev", parent=settings.get_profile("ci"), max_examples=20)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The float64 comparisons hold float32 results to float32 accuracy.  On a GPU, XLA multiplies float32 in TF32 by
# default; the suite asks for float32 there (the Pallas kernel sets its own precision, so is checked as it runs).
if jax.default_backend() == "gpu":
    jax.config.update("jax_default_matmul_precision", "float32")

MULTIDEVICE_FLAG = "--xla_force_host_platform_device_count=8"
collect_ignore = (
    ["test_multidevice.py"] if MULTIDEVICE_FLAG in os.environ.get("XLA_FLAGS", "") else ["multidevice"]
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks ``slow`` every test recorded at ``durations.SLOW_SECONDS`` or more."""
    seconds = durations.recorded()
    for item in items:
        if seconds.get(item.nodeid, 0.0) >= durations.SLOW_SECONDS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _fresh_trace_counts():
    """``chex.assert_max_traces`` counts per definition site for the whole process: each test counts its own."""
    chex.clear_trace_counter()


@pytest.fixture
def kernel_takes_every_step(monkeypatch):
    """The native kernel takes every float32 step, whichever path runs: for tests of how a step reaches it.

    A path declines steps of many query rows where the pure loop was
    measured faster (``_native.DECLINED_ROWS``: ``JSS_NATIVE_ISA=baseline``
    from 6 rows per kv head), a choice of speed that
    ``test_native_attention.py`` tests on its own.  Compiled programs are
    cleared before and after, so none traced with the other choice is reused.
    """
    jax.clear_caches()
    monkeypatch.setattr(_native, "DECLINED_ROWS", {})
    yield
    jax.clear_caches()

"""The device keys the tests expect, on whatever backend runs them (``"cpu:0"`` on CPU)."""

import jax

import jax_session_state as jss

DEVICE = jss.device_key(jax.devices()[0])
PINNED = jss.device_key(jax.devices()[0], "pinned_host")

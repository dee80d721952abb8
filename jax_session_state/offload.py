"""Parking's first import path, kept: its home is :mod:`jax_session_state.manager.offload`.

Example:
  >>> from jax_session_state import offload
  >>> from jax_session_state.manager import offload as home
  >>> offload.park is home.park
  True
"""

from jax_session_state.manager.offload import *  # noqa: F403
from jax_session_state.manager.offload import __all__  # noqa: F401

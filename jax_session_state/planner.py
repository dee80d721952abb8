"""The planner's first import path, kept: its home is :mod:`jax_session_state.manager.planner`.

Every name there is re-exported here: :func:`plan`, :class:`Plan`, the
actions (``Action`` is any one of them) and the usage records.

Example:
  >>> from jax_session_state import planner
  >>> from jax_session_state.manager import planner as home
  >>> planner.plan is home.plan
  True
"""

from jax_session_state.manager.planner import *  # noqa: F403
from jax_session_state.manager.planner import __all__  # noqa: F401

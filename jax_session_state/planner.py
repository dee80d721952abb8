"""The planner's first import path, kept: this module is :mod:`jax_session_state.manager.planner` itself.

``import jax_session_state.planner`` and ``from jax_session_state.planner
import plan`` go on working; the module object is the one in ``manager/``.
"""

import sys

from jax_session_state.manager import planner

sys.modules[__name__] = planner

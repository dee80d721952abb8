"""Parking's first import path, kept: this module is :mod:`jax_session_state.manager.offload` itself.

``import jax_session_state.offload`` and ``from jax_session_state.offload
import park`` go on working; the module object is the one in ``manager/``.
"""

import sys

from jax_session_state.manager import offload

sys.modules[__name__] = offload

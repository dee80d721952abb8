"""Content-addressed reuse: sessions that start from the same prompt or scene share its state.

Owns content keys (``_keys``: :func:`content_key`, chained :func:`page_keys`),
the shared-object table held in a manager (``_store``: :class:`SharedStore`,
single-flight encodes, stats), the donation helper that keeps shared objects
out of a donated step (``_donation``: :func:`donate_unshared`) and the paged
prefix index (``_prefix_index``: :class:`PrefixIndex`, over the page mapping of
``objects._page_sharing``).

May import: ``errors``, ``accounting``, ``base``, ``building_blocks``, ``objects``,
``session`` and ``manager`` (through a manager instance it is given).  Nothing
below it imports it.
"""

from jax_session_state.reuse._donation import donate_unshared
from jax_session_state.reuse._keys import content_key, page_keys
from jax_session_state.reuse._prefix_index import PrefixIndex
from jax_session_state.reuse._store import SharedKey, SharedStore

__all__ = ["PrefixIndex", "SharedKey", "SharedStore", "content_key", "donate_unshared", "page_keys"]

"""The kinds of session state, one module each, and the views attention reads from them.

Owns ``kv`` (``KVCache``: append mode or a sink + window ring), ``kv_views``
(the chunks written and the views read), ``encode_once``, ``fixed``,
``latent``, ``retrieval`` and ``paged`` (``PagedKVCache``), with private
helpers: ``_ring`` (ring slot arithmetic), ``_quantize`` (int8 / fp8 rows and
their scales), ``_items`` (the bookkeeping of item buffers), ``_pages``
(the free list, reference counts and page copies of ``PagedKVCache``) and
``_page_sharing`` (held pages mapped into a free slot, for prefix reuse).

May import: ``errors``, ``accounting``, ``sharding``, ``_core``, ``base`` and
``building_blocks``. Objects know nothing of sessions, attention, pools or the
manager.
"""

from jax_session_state.objects.encode_once import EncodeOnceKV
from jax_session_state.objects.fixed import FixedState
from jax_session_state.objects.kv import BranchKVView, KVCache, KVChunk, KVView
from jax_session_state.objects.latent import LatentBuffer, LatentView
from jax_session_state.objects.paged import PagedKVCache, PagedView
from jax_session_state.objects.retrieval import RetrievalStore, RetrievalView, Retrieved

__all__ = [
    "BranchKVView",
    "EncodeOnceKV",
    "FixedState",
    "KVCache",
    "KVChunk",
    "KVView",
    "LatentBuffer",
    "LatentView",
    "PagedKVCache",
    "PagedView",
    "RetrievalStore",
    "RetrievalView",
    "Retrieved",
]

"""The kinds of session state, one module each."""

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

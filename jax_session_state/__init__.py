"""jax_session_state: per-session state of autoregressive rollouts as immutable JAX pytrees."""

from jax_session_state import accounting, checkpoint, errors, manager, reuse, sharding
from jax_session_state.accounting import SeenStorages, device_bytes, device_key
from jax_session_state.attention import attend, attend_with_lse, merge_attention
from jax_session_state.base import StateObject, check, is_state_object
from jax_session_state.branches import Branches, Lane
from jax_session_state.building_blocks import Fill, ManagedOptions
from jax_session_state.errors import (
    BudgetExceededError,
    CapacityError,
    CheckpointError,
    DonatedError,
    NotDemotableError,
    NotEvictableError,
    NotResidentError,
    PayloadError,
    PayloadTypeError,
    ProcessDisagreementError,
    RecomputeGraphError,
    SessionAdmissionError,
    SessionCheckedOutError,
    SessionStateError,
    SessionStateLostError,
)
from jax_session_state.manager import Held, ManagerEvent, SessionStateManager
from jax_session_state.manager.parking import Parked
from jax_session_state.objects import (
    BranchKVView,
    EncodeOnceKV,
    FixedState,
    KVCache,
    KVChunk,
    KVView,
    LatentBuffer,
    LatentView,
    PagedKVCache,
    PagedView,
    RetrievalStore,
    RetrievalView,
    Retrieved,
)
from jax_session_state.pool import SessionPool
from jax_session_state.reports import Summary, summary
from jax_session_state.reuse import PrefixIndex, SharedStore, content_key, donate_unshared, page_keys
from jax_session_state.session import Session
from jax_session_state.sharding import ShardingRules, shard

__version__ = "0.1.0"

__all__ = [
    "BranchKVView",
    "Branches",
    "BudgetExceededError",
    "CapacityError",
    "CheckpointError",
    "DonatedError",
    "EncodeOnceKV",
    "Fill",
    "FixedState",
    "Held",
    "KVCache",
    "KVChunk",
    "KVView",
    "Lane",
    "LatentBuffer",
    "LatentView",
    "ManagedOptions",
    "ManagerEvent",
    "NotDemotableError",
    "NotEvictableError",
    "NotResidentError",
    "PagedKVCache",
    "PagedView",
    "Parked",
    "PayloadError",
    "PayloadTypeError",
    "PrefixIndex",
    "ProcessDisagreementError",
    "RecomputeGraphError",
    "RetrievalStore",
    "RetrievalView",
    "Retrieved",
    "SeenStorages",
    "Session",
    "SessionAdmissionError",
    "SessionCheckedOutError",
    "SessionPool",
    "SessionStateError",
    "SessionStateLostError",
    "SessionStateManager",
    "ShardingRules",
    "SharedStore",
    "StateObject",
    "Summary",
    "accounting",
    "attend",
    "attend_with_lse",
    "check",
    "checkpoint",
    "content_key",
    "device_bytes",
    "device_key",
    "donate_unshared",
    "errors",
    "is_state_object",
    "manager",
    "merge_attention",
    "page_keys",
    "reuse",
    "shard",
    "sharding",
    "summary",
]

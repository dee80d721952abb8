"""A user's own state-object kind, defined at module level, for the restore-trust tests.

Only the tests that check how a restore finds user kinds import this module,
each in a fresh process.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

import jax_session_state as jss
from jax_session_state.building_blocks import allocator, overwrite


class Totals(jss.StateObject, kw_only=True):
    """Per-row running totals; a staged value counts once committed."""

    batch: int = struct.field(pytree_node=False)

    total: jax.Array | None = None
    pending: jax.Array | None = None
    counts: jax.Array | None = None

    capacity = 1
    data_fields = ("total",)

    @classmethod
    @allocator()
    def allocate(cls, *, batch: int, **options) -> Totals:
        return cls._allocated(options, batch=batch)

    def _empty_storage(self):
        zeros = jnp.zeros((self.batch,), jnp.float32)
        return {"total": zeros, "pending": zeros.copy(), "counts": jnp.zeros((2,), jnp.int32)}

    @property
    def committed(self):
        return None if self.counts is None else self.counts[0]

    @property
    def staged(self):
        return None if self.counts is None else self.counts[1]

    def _stage(self, payload, operation):
        payload = jnp.asarray(payload, jnp.float32)
        return self.with_storage(pending=self.pending + payload, counts=self.counts.at[1].add(1)), False

    def _commit_staged(self, when=True):
        return self.with_storage(
            total=jnp.where(when, self.total + self.pending, self.total),
            pending=jnp.where(when, jnp.zeros_like(self.pending), self.pending),
            counts=jnp.where(when, jnp.stack([self.counts[0] + self.counts[1], 0]), self.counts),
        )

    def discard(self):
        self._require_resident("discard")
        return self.with_storage(pending=overwrite(self.pending, 0.0), counts=self.counts.at[1].set(0))

    def view(self, *, include_staged=True):
        self._require_resident("view")
        return self.total + self.pending if include_staged else self.total


def saved_values() -> np.ndarray:
    """The totals the tests save: random, never zeros."""
    return np.random.default_rng(7).normal(size=(3,)).astype(np.float32)

"""Fitting an example's Flax NNX model with optax: the loop the video examples share.

Example:
  >>> import jax, jax.numpy as jnp, optax
  >>> from flax import nnx
  >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  >>> def loss(params, key):  # a line through the origin, fresh points every step
  ...     x = jax.random.normal(key, (16, 2))
  ...     return jnp.mean((nnx.merge(graphdef, params)(x)[:, 0] - x @ jnp.array([2.0, -1.0])) ** 2)
  >>> graphdef, _ = nnx.split(model)
  >>> losses = fit(model, loss, optax.adam(0.1), 200, jax.random.key(0))
  >>> bool(losses[-1] < 1e-3 < losses[0])
  True
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import optax
from flax import nnx


def fit(model: nnx.Module, loss: Callable[[nnx.State, jax.Array], jax.Array], optimizer: optax.GradientTransformation,
        steps: int, key: jax.Array, *, on_step: Callable[[int], None] | None = None) -> list[float]:
    """Fits ``model``'s parameters in place: ``steps`` jitted, donated updates of ``loss(params, key_i)``.

    Step ``i`` draws its data from ``jax.random.fold_in(key, i)``; ``on_step(i)``
    is called after it (a progress bar). Returns every step's loss.
    """
    _, params = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def update(params, opt_state, key):
        value, grads = jax.value_and_grad(loss)(params, key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    opt_state = optimizer.init(params)
    losses = []
    for i in range(steps):
        params, opt_state, value = update(params, opt_state, jax.random.fold_in(key, i))
        losses.append(float(value))
        if on_step is not None:
            on_step(i)
    nnx.update(model, params)
    return losses

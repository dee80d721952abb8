"""A step whose in-place writes land only where a flag is set, so a pool step costs what it writes.

:meth:`SessionPool.map` must leave inactive slots bit for bit unchanged.
Selecting old against new over every leaf would read and write the whole
pool every step, and under donation XLA must copy each written buffer first
(the scatter that writes it in place and the select that reads its old value
both need it): on the world model's pool that doubled the peak memory of a
rollout.  Instead the step is traced once to a jaxpr and run with every
in-place write masked by the slot's ``live`` flag:

- ``dynamic_update_slice``: the update becomes the old window where not live
  (one slice read, fused into the write);
- ``scatter`` (any combiner) in fill-or-drop mode: its indices are pushed out
  of range where not live, so nothing lands;
- the native row writer of bfloat16 / float8 buffers on CPU
  (``_writes.write_rows``): its slots are pushed out of range the same way,
  and the per-platform ``cond`` around it (``lax.platform_dependent``) is
  made again with its branches masked;

and every output is tagged with the input it is that input written in place
(its *origin*).  An output whose origin is its own input leaf needs no
select; any other output (a counter recomputed, a carry replaced) is
selected against the old leaf by the caller -- those are small.

Nested ``jit`` calls are inlined so that writes inside them are masked too;
every other primitive (loops, other conditionals, custom rules, FFI calls)
runs as it is, and what it returns has no origin, so the caller's select
covers it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core

from jax_session_state._core import _writes

__all__ = ["run_masked"]

_SCATTERS = frozenset({"scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter-min",
                       "scatter_min", "scatter-max", "scatter_max"})
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call"})


def run_masked(fn: Callable[..., Any], live: jax.Array, *args: Any) -> tuple[Any, list[int | None]]:
    """``fn(*args)`` with its in-place writes landing only where ``live``.

    Args:
      fn: a pure function of pytrees.
      live: a boolean scalar (traced, e.g. one slot's flag under ``vmap``).
      *args: its arguments.

    Returns:
      ``fn``'s output, and for each leaf of it (in ``tree_leaves`` order)
      the index among ``tree_leaves(args)`` of the input it is, written in
      place by masked writes only -- or None when it is anything else.
    """
    leaves, tree = jax.tree_util.tree_flatten(args)
    closed, shape = jax.make_jaxpr(lambda *xs: fn(*jax.tree_util.tree_unflatten(tree, xs)), return_shape=True)(
        *leaves
    )
    outs, origins = _eval(closed.jaxpr, closed.consts, leaves, list(range(len(leaves))), live)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), outs), origins


def _eval(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], origins: Sequence[int | None],
          live: jax.Array) -> tuple[list[Any], list[int | None]]:
    env: dict[Any, Any] = {}
    origin: dict[Any, int] = {}

    def read(var: Any) -> Any:
        return var.val if isinstance(var, jex_core.Literal) else env[var]

    def origin_of(var: Any) -> int | None:
        return None if isinstance(var, jex_core.Literal) else origin.get(var)

    env.update(zip(jaxpr.constvars, consts))
    for var, value, source in zip(jaxpr.invars, args, origins):
        env[var] = value
        if source is not None:
            origin[var] = source
    for eqn in jaxpr.eqns:
        invals = [read(var) for var in eqn.invars]
        name = eqn.primitive.name
        out_origins: list[int | None] = [None] * len(eqn.outvars)
        if name == "dynamic_update_slice":
            operand, update, *starts = invals
            kept = lax.dynamic_slice(operand, starts, update.shape)
            outs = [lax.dynamic_update_slice(operand, jnp.where(live, update, kept), starts)]
            out_origins = [origin_of(eqn.invars[0])]
        elif name in _SCATTERS and eqn.params.get("mode") == lax.GatherScatterMode.FILL_OR_DROP:
            operand, indices, *rest = invals
            outside = jnp.asarray(max(operand.shape, default=0), indices.dtype)  # past every axis: dropped
            outs = [eqn.primitive.bind(operand, jnp.where(live, indices, outside), *rest, **eqn.params)]
            out_origins = [origin_of(eqn.invars[0])]
        elif _writes.is_native_write(eqn):
            operand, slots, rows = invals
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(operand, jnp.where(live, slots, -1), rows,
                                          **eqn.primitive.get_bind_params(eqn.params))
            out_origins = [origin_of(eqn.invars[0])]
        elif name == "cond" and eqn.params.get("branches_platforms"):
            outs, out_origins = _platform_cond(eqn, invals, [origin_of(v) for v in eqn.invars], live)
        elif name in _CALLS and "jaxpr" in eqn.params:
            inner = eqn.params["jaxpr"]
            inner_jaxpr, inner_consts = (inner.jaxpr, inner.consts) if hasattr(inner, "consts") else (inner, ())
            outs, out_origins = _eval(inner_jaxpr, inner_consts, invals, [origin_of(v) for v in eqn.invars], live)
        else:
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
            outs = list(outs) if eqn.primitive.multiple_results else [outs]
        for var, value, source in zip(eqn.outvars, outs, out_origins):
            env[var] = value
            if source is not None:
                origin[var] = source
    return [read(var) for var in jaxpr.outvars], [origin_of(var) for var in jaxpr.outvars]


def _platform_cond(eqn: Any, invals: list[Any], origins: list[int | None],
                   live: jax.Array) -> tuple[list[Any], list[int | None]]:
    """A ``lax.platform_dependent`` cond with every branch's writes masked; ``live`` becomes its last operand.

    An output keeps an origin only where every branch gives it the same one.
    """
    index, *operands = invals
    branch_origins = []

    def masked(branch: Any) -> Any:
        def run(*xs: Any) -> list[Any]:
            outs, out_origins = _eval(branch.jaxpr, branch.consts, xs[:-1], origins[1:], xs[-1])
            branch_origins.append(out_origins)
            return outs

        return jax.make_jaxpr(run)(*operands, live)

    branches = tuple(masked(branch) for branch in eqn.params["branches"])
    outs = eqn.primitive.bind(index, *operands, live, **{**eqn.params, "branches": branches})
    agreed = [o if all(b[i] == o for b in branch_origins) else None for i, o in enumerate(branch_origins[0])]
    return list(outs), agreed

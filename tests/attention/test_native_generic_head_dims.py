"""The native kernel at head dims without a build of their own, on every instruction-set path, against float64.

Few query rows (under four per kv head) read a dense cache's rows in place
where they are float32, or bfloat16 at a head dim the kernel is built for
(64, 128, 256); at any other head dim bfloat16 rows, like float16
ones, are widened into tile buffers of 64 rows, so valid lengths around and
well past one tile are read here.  Each path runs in a process of its own
(``JSS_NATIVE_ISA`` is read at import).
"""

import textwrap

import jax
import pytest

from jax_session_state._core import _library
from tests.support.native_paths import run_on_path

HEAD_DIMS = (8, 12, 20, 48)
LENGTHS = (1, 63, 64, 65, 70, 1000, 2048)
DTYPES = ("bfloat16", "float16", "float32")

GENERIC_HEAD_DIMS = textwrap.dedent(f"""
    import jax, jax.numpy as jnp, numpy as np
    import jax_session_state as jss
    from jax_session_state._core import _library
    from tests.support.attention_reference import append_view, randn, reference
    rng = np.random.default_rng(11)
    capacity, worst, calls = 2048, 0.0, set()
    for dim in {HEAD_DIMS}:
        for dtype in {DTYPES}:
            k, v = (np.asarray(jnp.asarray(randn(rng, 2, 2, capacity, dim), dtype)) for _ in range(2))
            q = randn(rng, 2, 1, 4, dim)  # two query rows per kv head
            f = jax.jit(lambda q, view: jss.attend_with_lse(q, view))
            for length in {LENGTHS}:
                lengths = np.asarray([length, capacity + 1 - length], np.int32)
                view = append_view(jnp.asarray(k), jnp.asarray(v), lengths)
                calls.add(f.lower(jnp.asarray(q), view).compile().as_text().count(_library.TARGET))
                out, _ = f(jnp.asarray(q), view)
                ref, _ = reference(q, k.astype(np.float64), v.astype(np.float64), lengths, view.positions)
                worst = max(worst, float(np.max(np.abs(out - ref)) / np.max(np.abs(ref))))
    print(_library.ISA, "|", sorted(calls), "|", worst)
""")


@pytest.mark.skipif(not _library.AVAILABLE or jax.default_backend() != "cpu",
                    reason=f"the native kernel runs on CPU only; here: {jax.default_backend()}, {_library.STATUS}")
@pytest.mark.parametrize("isa", ["baseline", "avx2", "avx512"])
def test_few_rows_at_any_head_dim_match_float64_on_every_path(isa):
    used, calls, worst = run_on_path(isa, GENERIC_HEAD_DIMS)[-1].split(" | ")
    assert used == isa and calls == "[1]"  # every case ran the kernel
    assert float(worst) < 1e-5

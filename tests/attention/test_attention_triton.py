"""The Pallas kernel as a GPU gets it: each view kind's Triton module compiled for sm_90 and sm_80, no GPU needed.

``test_attention_pallas.py`` beside it checks what the kernel computes (in Pallas' interpreter) and that it lowers to
one Triton call; this checks that Triton's compiler takes that call at the benchmark's shapes (head dim 128,
GQA 4, T = 1 and 16) with the kernel's settings, and that the machine code has what a kernel bound by memory
bandwidth needs: shared memory within one program's limit, no registers spilled to local memory, keys and values
streamed in 16-byte asynchronous copies, and tensor-core dots (a float32 cache's as three TF32 products each,
about float32's accuracy, in tiles small enough not to spill).
"""

import functools
import re
from unittest import mock

import jax.numpy as jnp
import numpy as np
import pytest

import jax_session_state as jss
from jax_session_state.attention import _pallas as _attention_pallas
from tests.support.attention_reference import VIEWS, lower, view_of
from tests.support.triton_compile import SHARED_MEMORY_PER_BLOCK, compile_for, triton_modules

pytest.importorskip("triton", reason="the triton package has no build for this platform")

HEAD_DIM, KV_HEADS, GROUP = 128, 2, 4
SIXTEEN_BYTE_COPY = re.compile(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10")
pallas_attend = functools.partial(jss.attend, implementation="pallas")


@functools.cache
def modules(kind, T, arch):
    """The Triton modules of ``attend(..., implementation="pallas")`` over a view of ``kind`` at T, lowered for a
    GPU of compute capability ``arch / 10``."""
    view, _, dtype = view_of(kind, np.random.default_rng(0), dim=HEAD_DIM, page_size=128, capacity=512, batch=2,
                             kv_heads=KV_HEADS)
    q = jnp.ones((2, T, GROUP * KV_HEADS, HEAD_DIM), dtype)
    with mock.patch.object(_attention_pallas, "compute_capability", lambda: arch / 10):
        # a fresh function, so jit traces it under this compute capability instead of reusing a trace
        return triton_modules(lower(lambda q, view: pallas_attend(q, view), "cuda", q, view))


@pytest.mark.parametrize("arch", sorted(SHARED_MEMORY_PER_BLOCK))
@pytest.mark.parametrize("T", [1, 16])
@pytest.mark.parametrize("kind", VIEWS)
def test_triton_compiles_the_kernel_for_the_gpu_without_spills(kind, T, arch, monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a fresh compile, not a cached one
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # multiplies and adds fused, as XLA's Triton does
    [module] = modules(kind, T, arch)
    assert ("f8E4M3FN" in module.text) == (kind.endswith("fp8") and arch >= 89)  # below 8.9: fp8 as its bytes
    if kind.endswith("float32"):  # each dot three TF32 products (about float32's accuracy), never one
        assert set(re.findall(r"inputPrecision = (\w+)", module.text)) == {"tf32x3"}
    compiled = compile_for(module, arch)
    assert 0 < compiled.shared_bytes <= SHARED_MEMORY_PER_BLOCK[arch], compiled.shared_bytes
    assert compiled.spilled_bytes == 0, (compiled.registers, compiled.spilled_bytes)
    assert SIXTEEN_BYTE_COPY.search(compiled.ptx)  # keys and values copied 16 bytes at a time, ahead of use
    # Hopper's warpgroup dots take tiles of 64 query rows (T = 16, GQA 4); a float32 cache's tiles hold 32.
    wide_tile = T > 1 and not kind.endswith("float32")
    assert ("wgmma.mma_async" if arch >= 90 and wide_tile else "mma.sync") in compiled.ptx

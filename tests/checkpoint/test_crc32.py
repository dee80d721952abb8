"""The CRC-32 under every checkpoint digest: the native fold gives zlib's values, on every length and alignment."""

import os
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest

import jax_session_state as jss
from jax_session_state._core import _crc32, _library

RNG = np.random.default_rng(7)

needs_fold = pytest.mark.skipif(_crc32.PATH != "pclmul", reason=f"the CRC runs on {_crc32.PATH} here")


@needs_fold
def test_the_fold_equals_zlib_on_every_short_length_alignment_and_start():
    buffer = RNG.integers(0, 256, 1200, dtype=np.uint8)
    wrong = [
        (offset, size, start)
        for offset in range(16)
        for size in range(0, 1100, 7 if offset else 1)  # every size where the fold's tail changes, at offset 0
        for start in (0, 0xFFFFFFFF, int(RNG.integers(2**32)))
        if _crc32.crc32(buffer[offset : offset + size], start) != zlib.crc32(buffer[offset : offset + size], start)
    ]
    assert wrong == []


@needs_fold
def test_the_fold_equals_zlib_on_large_buffers_and_continues_a_crc():
    data = RNG.integers(0, 256, (9 << 20) + 13, dtype=np.uint8)
    assert _crc32.crc32(data) == zlib.crc32(data)
    split = (3 << 20) + 5
    assert _crc32.crc32(data[split:], _crc32.crc32(data[:split])) == zlib.crc32(data)
    flipped = data.copy()
    flipped[RNG.integers(flipped.size)] ^= 1 << int(RNG.integers(8))
    assert _crc32.crc32(flipped) == zlib.crc32(flipped) != zlib.crc32(data)


def test_bytes_that_are_not_contiguous_uint8_are_refused():
    with pytest.raises(ValueError, match=r"contiguous uint8\[n\] bytes; got float32\[4\]"):
        _crc32.crc32(np.ones(4, np.float32))
    with pytest.raises(ValueError, match=r"got uint8\[5\]"):
        _crc32.crc32(np.arange(10, dtype=np.uint8)[::2])


RESTORE_ON_ZLIB = textwrap.dedent("""
    import sys
    import numpy as np
    import jax_session_state as jss
    from jax_session_state._core import _crc32
    state = jss.checkpoint.restore(sys.argv[1])
    print(_crc32.PATH, float(np.asarray(state["h"].view(), np.float64).sum()))
""")


def test_a_checkpoint_verified_by_the_fold_restores_where_zlib_checks_it(tmp_path):
    """The digests do not depend on which CRC computed them: saved on this path, restored on plain x86-64's."""
    values = RNG.standard_normal((3 << 18) + 3).astype(np.float32)  # 3 MiB: several CRC chunks and a tail
    session = jss.Session(objects={"h": jss.FixedState.allocate(shapes=values.shape).commit(values)})
    jss.checkpoint.save(tmp_path, session)
    env = {**os.environ, _library.ENV_ISA: "baseline"}
    done = subprocess.run([sys.executable, "-c", RESTORE_ON_ZLIB, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    path, total = done.stdout.split()
    assert path == "zlib"
    assert float(total) == pytest.approx(float(values.astype(np.float64).sum()), rel=1e-12)

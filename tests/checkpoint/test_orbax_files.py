"""The Orbax files under a checkpoint's ``arrays``: what the library writes, what it reads, what it returns."""

import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jax_session_state import checkpoint
from jax_session_state._core import _placement
from jax_session_state.checkpoint import _save_restore
from tests.checkpoint.test_checkpoint import assert_same, random_session


def test_a_save_writes_no_per_process_array_metadata_files(tmp_path):
    # Orbax's non-primary processes poll a quarter of a second for the folder of these files;
    # the manifest already records every shape and dtype, so the library writes none.
    arrays = checkpoint.save(tmp_path, random_session()) / "arrays"
    assert (arrays / "_METADATA").is_file()
    assert not (arrays / "array_metadatas").exists()


@pytest.mark.filterwarnings("ignore:Sharding info not provided")  # Orbax's, reading without a target
def test_arrays_written_with_orbax_array_metadata_files_restore_bit_for_bit(tmp_path):
    # Checkpoints saved before the library stopped writing them hold such files.
    session = random_session(seed=3)
    arrays = checkpoint.save(tmp_path / "ckpt", session) / "arrays"
    options = {"use_ocdbt": False, "use_compression": False}
    values = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**options)).restore(arrays)
    rewritten = tmp_path / "rewritten"
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**options)).save(rewritten, args=ocp.args.PyTreeSave(values))
    assert (rewritten / "array_metadatas").is_dir()
    shutil.rmtree(arrays)
    shutil.move(rewritten, arrays)
    assert_same(checkpoint.restore(tmp_path / "ckpt"), session)


def _wrapping_host_memory(values):
    """A committed jax array that wraps host memory, as Orbax's reads sometimes return."""
    host = _placement._aligned(values)  # 64-byte aligned: what jax.device_put wraps instead of copying on CPU
    x = jax.device_put(host, jax.devices()[0])
    assert x.unsafe_buffer_pointer() == host.ctypes.data  # wrapped, not copied
    return x


def test_restored_arrays_own_their_buffers_and_only_wrapped_ones_are_copied():
    values = np.random.default_rng(0).standard_normal((64, 33)).astype(np.float32)
    wrapped, owned = _wrapping_host_memory(values), jax.device_put(values, jax.devices()[0]) + 0
    owned_at = owned.unsafe_buffer_pointer()
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    entry = {"type": "jax"}
    finished = [_save_restore._finish(x, entry, None) for x in (wrapped, owned)]
    assert finished[1].unsafe_buffer_pointer() == owned_at  # a runtime-owned array is not copied
    assert all(x.committed for x in finished)
    read_as_numpy = _save_restore._finish(_placement._aligned(values), entry, device)  # made by jnp: uncommitted
    assert not read_as_numpy.committed
    step = jax.jit(lambda x: x.at[0, 0].add(1.0), donate_argnums=0)
    for x in (*finished, read_as_numpy):
        np.testing.assert_array_equal(np.asarray(x), values)
        at = x.unsafe_buffer_pointer()
        assert step(x).unsafe_buffer_pointer() == at  # the first donated step writes in place

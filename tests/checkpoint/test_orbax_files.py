"""The Orbax files under a checkpoint's ``arrays``: what the library writes, and what it still reads."""

import shutil

import orbax.checkpoint as ocp
import pytest

from jax_session_state import checkpoint
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

"""A checkpoint is data: restoring one never imports or evaluates what its manifest names, and allocates
nothing its manifest claims before checking it against the files on disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from collections import namedtuple
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_session_state as jss
from jax_session_state import checkpoint
from jax_session_state.checkpoint import _digest, _orbax_io

Pair = namedtuple("Pair", ["a", "b"])
"""A namedtuple in attrs, defined at module level as a checkpoint needs."""

REPO = Path(__file__).resolve().parents[2]


def random_session(seed=0):
    rng = np.random.default_rng(seed)
    kv = jss.KVCache.allocate(batch=2, kv_heads=2, head_dim=4, capacity=16)
    rows = jnp.asarray(rng.normal(size=(2, 2, 5, 2, 4)), jnp.float32)
    return jss.Session(
        objects={"kv": kv.append((rows[0], rows[1]))},
        attrs={"rng": jax.random.key(seed), "pair": Pair(jnp.asarray(rng.normal(size=3)), np.float32(rng.normal()))},
    )


def edit_manifest(root, edit):
    """Edits the newest manifest and signs it again: the digest detects damage, not edits."""
    path = next(Path(root).glob("ckpt-*")) / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    manifest.pop("digest")
    manifest["digest"] = _digest.manifest_digest(manifest)
    path.write_text(json.dumps(manifest))


@pytest.fixture
def marking_module(tmp_path, monkeypatch):
    """A module on ``sys.path`` whose import leaves a mark file; yields (its name, the mark's path)."""
    name = f"mark_{uuid.uuid4().hex}"
    mark = tmp_path / "imported"
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / f"{name}.py").write_text(
        textwrap.dedent(
            f"""
            import pathlib
            pathlib.Path({str(mark)!r}).write_text("imported")
            KVCache = Pair = object
            """
        )
    )
    monkeypatch.syspath_prepend(str(modules))
    yield name, mark
    assert name not in sys.modules


def key_entry(manifest):
    return next(k for k, e in manifest["arrays"].items() if e["type"] == "key")


def set_namedtuple(node, name):
    """Renames every namedtuple in a recorded structure."""
    if isinstance(node, dict):
        if "namedtuple" in node:
            node["namedtuple"] = name
        for value in node.values():
            set_namedtuple(value, name)
    elif isinstance(node, list):
        for value in node:
            set_namedtuple(value, name)


EDITS = {
    "object kind": (
        lambda m, mod: m["record"]["objects"]["kv"].update(kind=f"{mod}:KVCache"),
        "names the state-object kind 'mark_[0-9a-f]+:KVCache', which is not defined in this process.*"
        r"restore\(path, classes=\[TheKind\]\)",
    ),
    "namedtuple in attrs": (
        lambda m, mod: set_namedtuple(m["record"]["attrs"]["treedef"], f"{mod}:Pair"),
        "names the namedtuple 'mark_[0-9a-f]+:Pair', which is not defined in this process",
    ),
    "key implementation": (
        lambda m, mod: m["arrays"][key_entry(m)].update(impl=mod),
        "names PRNG key implementation 'mark_[0-9a-f]+', which is not one of JAX's",
    ),
    "array dtype": (
        lambda m, mod: m["arrays"]["0"].update(dtype=mod),
        "array '0' .*names dtype 'mark_[0-9a-f]+', which is not one a checkpoint holds",
    ),
    "spec dtype": (
        lambda m, mod: m["record"]["objects"]["kv"]["spec"].update(dtype={"dtype": mod}),
        "names dtype 'mark_[0-9a-f]+', which is not one a checkpoint holds",
    ),
}


@pytest.mark.parametrize("edit", EDITS)
def test_a_name_in_the_manifest_is_looked_up_never_imported(tmp_path, marking_module, edit):
    name, mark = marking_module
    root = tmp_path / "ckpt"
    saved = random_session(seed=1)
    checkpoint.save(root, saved)
    assert checkpoint.restore(root)["kv"].view().lengths.tolist() == [5, 5]  # as saved, it restores
    change, match = EDITS[edit]
    edit_manifest(root, lambda m: change(m, name))
    with pytest.raises(jss.CheckpointError, match=match):
        checkpoint.restore(root)
    assert not mark.exists(), "restore imported a module the manifest named"


def test_the_dtype_table_round_trips_every_dtype_it_names(tmp_path):
    """Every float8 / bfloat16 / int4 ... name the table holds restores as itself (saved by numpy attrs)."""
    from jax_session_state.checkpoint._claims import DTYPES

    rng = np.random.default_rng(0)
    attrs = {name: rng.integers(0, 2, size=(4, 3)).astype(dtype) for name, dtype in DTYPES.items()}
    checkpoint.save(tmp_path, jss.Session(objects={}, attrs=attrs))
    restored = checkpoint.restore(tmp_path).attrs
    for name, value in attrs.items():
        assert restored[name].dtype == value.dtype, name
        assert restored[name].shape == value.shape and restored[name].tobytes() == value.tobytes(), name


def test_a_manifest_claiming_2_to_the_40_elements_is_refused_before_anything_is_read(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    checkpoint.save(root, random_session(seed=2))
    capacity = 1 << 36  # batch 2, kv heads 2, head dim 4: k and v each 2**40 elements

    def claim_huge(manifest):
        manifest["record"]["objects"]["kv"]["spec"]["capacity"] = capacity
        for key in manifest["record"]["objects"]["kv"]["storage"][:2]:  # k and v, in their spec's shape
            manifest["arrays"][key]["shape"] = [2, 2, capacity, 4]

    edit_manifest(root, claim_huge)

    def no_read(*args, **kwargs):
        raise AssertionError("restore read (and allocated) arrays a manifest claimed before checking them")

    monkeypatch.setattr(_orbax_io, "read_arrays", no_read)
    with pytest.raises(jss.CheckpointError, match=r"its arrays claim 8796093\d+ bytes, but the files under .* hold"):
        checkpoint.restore(root)


def test_the_claimed_bytes_match_a_real_checkpoint_of_zeros_and_of_every_kind(tmp_path):
    """Arrays of zeros are written too (every chunk), so an honest checkpoint always passes the bytes check."""
    session = jss.Session(objects={
        "kv": jss.KVCache.allocate(batch=2, kv_heads=2, head_dim=64, capacity=2048),
        "ring": jss.KVCache.allocate(batch=1, kv_heads=1, head_dim=8, window=8, sink=2, max_staged=4, quantize="int8"),
        "pages": jss.PagedKVCache.allocate(max_slots=2, kv_heads=1, head_dim=8, page_size=4, num_pages=6),
    })
    checkpoint.save(tmp_path, session)
    restored = checkpoint.restore(tmp_path)
    for x, y in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(session), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_malformed_entry_is_refused_naming_it(tmp_path):
    checkpoint.save(tmp_path, random_session(seed=3))
    edit_manifest(tmp_path, lambda m: m["arrays"]["0"].update(shape=[2, -1]))
    with pytest.raises(jss.CheckpointError, match=r"array '0' has shape \[2, -1\], not a list of sizes >= 0"):
        checkpoint.restore(tmp_path)


def test_restore_refuses_classes_that_are_neither_kinds_nor_namedtuples(tmp_path):
    checkpoint.save(tmp_path, random_session(seed=4))
    with pytest.raises(jss.PayloadTypeError, match=r"restore\(classes=\.\.\.\) takes StateObject subclasses"):
        checkpoint.restore(tmp_path, classes=[dict])


USER_PROCESS = """
import sys
import numpy as np
import jax_session_state as jss

path, stage = sys.argv[1], sys.argv[2]
if stage == "save":
    from tests.checkpoint.user_kind import Totals, saved_values
    session = jss.Session(objects={"totals": Totals.allocate(batch=3).append(saved_values())})
    jss.checkpoint.save(path, session)
    sys.exit(0)
try:
    jss.checkpoint.restore(path)
except jss.CheckpointError as error:
    print("REFUSED", error)
assert "tests.checkpoint.user_kind" not in sys.modules, "the restore imported the user's module"
from tests.checkpoint.user_kind import Totals, saved_values  # the documented fix: import it first
restored = jss.checkpoint.restore(path)
np.testing.assert_array_equal(np.asarray(restored["totals"].view()), saved_values())
assert type(restored["totals"]) is Totals
given = jss.checkpoint.restore(path, classes=[Totals])
np.testing.assert_array_equal(np.asarray(given["totals"].view()), saved_values())
print("RESTORED")
"""


def test_a_user_kind_restores_once_its_module_is_imported_and_is_refused_before(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    run = lambda stage: subprocess.run(  # noqa: E731
        [sys.executable, "-c", USER_PROCESS, str(tmp_path), stage], env=env, cwd=REPO,
        capture_output=True, text=True, timeout=120,
    )
    saved = run("save")
    assert saved.returncode == 0, saved.stderr
    restored = run("restore")
    assert restored.returncode == 0, restored.stderr
    assert (
        "the checkpoint names the state-object kind 'tests.checkpoint.user_kind:Totals', which is not "
        "defined in this process"
    ) in restored.stdout
    assert "Import the module that defines it ('tests.checkpoint.user_kind') before restoring" in restored.stdout
    assert restored.stdout.rstrip().endswith("RESTORED")


def test_a_kind_saved_from_a_script_restores_when_its_class_is_passed(tmp_path):
    """A class saved as ``__main__:Totals`` is found by its qualified name among the classes given."""
    from tests.checkpoint import user_kind

    checkpoint.save(tmp_path, jss.Session(objects={"totals": user_kind.Totals.allocate(batch=3).append(
        user_kind.saved_values())}))
    edit_manifest(tmp_path, lambda m: m["record"]["objects"]["totals"].update(kind="__main__:Totals"))
    with pytest.raises(jss.CheckpointError, match="'__main__:Totals', which is not defined in this process"):
        checkpoint.restore(tmp_path)
    restored = checkpoint.restore(tmp_path, classes=[user_kind.Totals])
    np.testing.assert_array_equal(np.asarray(restored["totals"].view()), user_kind.saved_values())


@pytest.mark.parametrize("dtype", ["uint4", "float8_e4m3"])
def test_a_dtype_the_table_does_not_hold_is_refused_at_save_before_writing(tmp_path, dtype):
    if not hasattr(jnp, dtype):
        pytest.skip(f"this ml_dtypes has no {dtype}")
    with pytest.raises(jss.CheckpointError, match=f"attrs\\['x'\\]: cannot save an array of dtype {dtype}"):
        checkpoint.save(tmp_path, jss.Session(objects={}, attrs={"x": np.zeros(3, getattr(jnp, dtype))}))
    assert not any(tmp_path.iterdir())


def test_a_checkpoint_written_by_an_earlier_commit_of_this_format_restores_bit_for_bit(tmp_path):
    """``data/format5`` was written by an earlier commit: a change that alters the format must bump its version."""
    from tests.checkpoint.test_checkpoint import host_leaves  # also defines the checkpoint's Carry namedtuple

    data = Path(__file__).parent / "data" / "format5"
    restored = checkpoint.restore(data / "checkpoint")
    leaves = host_leaves(restored)
    expected = np.load(data / "expected.npz")
    kinds = (data / "expected.txt").read_text().splitlines()
    assert [f"{t} {dt}" for t, dt, _ in leaves] == kinds
    for i, (_, _, value) in enumerate(leaves):
        assert np.asarray(value).tobytes() == expected[f"arr_{i}"].tobytes(), kinds[i]
    assert type(restored["carry"].view()).__module__ == "tests.checkpoint.test_checkpoint"

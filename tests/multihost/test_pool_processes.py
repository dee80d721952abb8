"""A SessionPool whose slot axis is split over 4 JAX processes (2 fake CPU devices each), stepped in one call.

The children (``tests/multihost/_child.py``, role ``pool_step``) allocate the
pool with ``sharding=NamedSharding(mesh, P("data"))`` over all 8 devices,
insert 7 sessions at different points of their rollouts, and step every slot
with one jitted, donated ``SessionPool.map``; here each session is stepped
alone in one process and compared slot by slot.
"""

import json

import jax
import numpy as np

from tests.multihost import _launch, _scenario as sc


def test_pool_sharded_over_four_processes_steps_like_each_session_alone(tmp_path):
    _launch.run("pool_step", 4, tmp_path, timeout=180)
    got = np.load(tmp_path / "pool_step.npz")
    assert got["active"].tolist() == [True] * sc.POOL_LIVE + [False] * (sc.POOL_SLOTS - sc.POOL_LIVE)
    for slot in range(sc.POOL_SLOTS):
        if slot < sc.POOL_LIVE:
            session, out = sc.step(sc.pool_session(slot), *sc.pool_inputs(slot))
        else:  # the empty slot keeps the template and returns zeros
            session = sc.new_session()
            out = np.zeros_like(got["out"][slot])
        np.testing.assert_allclose(got["out"][slot], np.asarray(out), atol=1e-5, rtol=0)
        for i, leaf in enumerate(jax.tree_util.tree_leaves(session)):
            np.testing.assert_allclose(got[f"leaf{i}"][slot], np.asarray(leaf), atol=1e-5, rtol=0, err_msg=f"{slot}")
    held = [json.loads((tmp_path / f"pool_step-{i}.json").read_text())["slots_held"] for i in range(4)]
    assert held == [[0, 1], [2, 3], [4, 5], [6, 7]]  # each process holds its own slots' shards only
    by_device = [json.loads((tmp_path / f"pool_step-{i}.json").read_text())["by_device"] for i in range(4)]
    devices = [key for found in by_device for key in found]
    assert len(devices) == len(set(devices)) == 8  # each process counts its own 2 devices' shards only
    assert len({n for found in by_device for n in found.values()}) == 1, by_device  # one slot's bytes each

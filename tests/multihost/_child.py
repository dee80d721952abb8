"""One process of a multi-host test: ``python -m tests.multihost._child ROLE NUM_PROCESSES PROCESS_ID PORT WORKDIR``.

The parent (tests/multihost/_launch.py) sets ``XLA_FLAGS`` to give each
process its fake CPU devices before jax is imported.  With more than one
process the child joins the others through ``jax.distributed.initialize`` on
a localhost coordinator, with gloo CPU collectives.  Each role writes what
the parent checks into WORKDIR (``<role>-<process>.json``, and arrays in
``<role>.npz`` from process 0); a failed check raises, and the parent shows
every process's output.
"""

import json
import os
import signal
import sys
from pathlib import Path

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def roll_and_save(work, rules):
    """Roll out sharded, report bytes, save from every process and restore onto the same processes."""
    import jax_session_state as jss
    from tests.multihost import _scenario as sc

    session, outs = sc.rolled_out(rules)
    by_device = session.nbytes_by_device()
    objects = {name: obj.nbytes_by_device() for name, obj in session.objects.items()}
    saved = sc.host_leaves(session)
    jss.checkpoint.save(work / "ckpt", session)
    restored = jss.checkpoint.restore(work / "ckpt", shardings=rules)
    assert restored["kv"].k.sharding == session["kv"].k.sharding, restored["kv"].k.sharding
    for x, y in zip(sc.host_leaves(restored), saved, strict=True):
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), "restored bits differ"
    restored, _ = sc.run(restored, *sc.inputs(99, rules))  # a restored session steps on, donated
    arrays = {f"out{i}": x for i, x in enumerate(sc.host_leaves(outs))}
    arrays.update({f"leaf{i}": x for i, x in enumerate(saved)})
    return {"by_device": by_device, "objects": objects, **host_side_reads(session)}, arrays


def host_side_reads(session):
    """jss.shard of a session made on one device (attrs included); fill, summary, describe and a manager's stats and
    events of sessions that span every process, each read by this process alone."""
    import numpy as np

    import jax_session_state as jss
    from tests.multihost import _scenario as sc

    me, found = jax.process_index(), {}
    rows = sc.rows_session()  # on this process's first device; the same values on every process
    placed = jss.shard(rows, sc.make_rules(axes=sc.ROW_AXES))
    rng = placed.attrs["rng"]
    assert not rng.is_fully_addressable and rng.sharding.is_fully_replicated, rng.sharding
    for name, local in (("k", rows["kv"].k), ("committed", rows["kv"].committed)):
        spanning = getattr(placed["kv"], name)
        assert not spanning.is_fully_addressable, name
        assert np.array_equal(sc.host_leaves(spanning)[0], np.asarray(local)), f"{name} placed other values"
    key_data = jax.random.key_data(rng).addressable_shards[0].data
    assert np.array_equal(np.asarray(key_data), np.asarray(jax.random.key_data(rows.attrs["rng"])))
    found["rows_fill"] = placed["kv"].fill()._asdict()  # rows on other processes: None
    found["rows_summary"] = str(jss.summary(placed))
    found["summary"] = str(jss.summary(session))
    found["describe"] = {name: obj.describe() for name, obj in session.objects.items()}
    events = []
    one = sc.new_session(sc.make_rules()).nbytes_by_device()
    manager = jss.SessionStateManager(
        byte_budget={key: n + 64 for key, n in one.items()}, evict_when_full=True, park_memory_kind=None,
        agreement_timeout=30, on_event=events.append,
    )
    manager.create("a", jax.tree_util.tree_map(lambda x: x.copy(), session))
    manager.create("b", sc.new_session(sc.make_rules()))  # no room for both: "a" is preempted, on every process
    found["stats"] = {k: v for k, v in manager.stats().items() if isinstance(v, (int, float, dict))}
    found["events"] = [(e.kind, e.session_id, e.bytes_by_device) for e in events]
    found["manager_summary"] = str(jss.summary(manager))
    found["process"] = me
    return found


class _Injected(RuntimeError):
    """The fault a test makes one process raise."""


def _failing(module, name, victim, *, kill=False, error=None):
    """Patches ``module.name`` so that process ``victim`` raises in it (``error``, or an injected RuntimeError), or,
    with ``kill``, is killed after it runs."""
    original = getattr(module, name)

    def patched(*args, **kwargs):
        if jax.process_index() != victim:
            return original(*args, **kwargs)
        if not kill:
            raise error or _Injected(f"injected into {name} on process {victim}")
        result = original(*args, **kwargs)
        print(f"process {victim}: {name} done, killing myself", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(module, name, patched)
    return lambda: setattr(module, name, original)


def save_faults(work, rules):
    """The primary cannot start a save or write its manifest; the last process fails inside its write, its digests
    and its restore check, then is killed mid-save.

    Every process must raise CheckpointError (the one that failed: its own error) at once for the errors and within
    the timeout for the kill, leaving the previous checkpoint (roll_and_save's) the newest, restorable bit for bit,
    and no partial directory.
    """
    import time

    import jax_session_state as jss
    from jax_session_state.checkpoint import _atomic, _manifest, _orbax_io, _pieces
    from tests.multihost import _scenario as sc

    victim, report = jax.process_count() - 1, {}
    session, _ = sc.rolled_out(rules, steps=sc.STEPS + 2)
    leaves = _saved_leaves(work)
    _check_restores(work / "ckpt", rules, leaves)  # every process compiled and arrived: the timed faults start together

    def attempt(what, call):
        started = time.perf_counter()
        try:
            call()
            report[what] = None
        except (jss.CheckpointError, _Injected) as error:
            report[what] = f"{type(error).__name__}: {error}"
        report[f"{what}_s"] = time.perf_counter() - started
        (work / f"save_faults-{jax.process_index()}.json").write_text(json.dumps(report))

    faults = (("begin", _atomic, "begin", 0), ("manifest", _manifest, "write", 0),  # what only the primary does
              ("write", _orbax_io, "write_arrays", victim), ("digests", _pieces, "local_digests", victim))
    for fault, module, name, process in faults:
        full = OSError(28, "No space left on device") if process == 0 else None
        undo = _failing(module, name, process, error=full)
        attempt(fault, lambda: jss.checkpoint.save(work / "ckpt", session, timeout=sc.FAULT_TIMEOUT_S))
        undo()
        _check_restores(work / "ckpt", rules, leaves)  # every process is done with the failed save by then
        report[f"{fault}_left"] = sorted(p.name for p in (work / "ckpt").iterdir())
    undo = _failing(_pieces, "array_digests", victim)  # the restore's check of the pieces this process holds
    attempt("check", lambda: jss.checkpoint.restore(work / "ckpt", shardings=rules, timeout=sc.FAULT_TIMEOUT_S))
    undo()

    _failing(_orbax_io, "write_arrays", victim, kill=True)
    attempt("killed", lambda: jss.checkpoint.save(work / "ckpt", session, timeout=sc.FAULT_TIMEOUT_S))
    report["killed_left"] = sorted(p.name for p in (work / "ckpt").iterdir())
    (work / f"save_faults-{jax.process_index()}.json").write_text(json.dumps(report))
    print(f"process {jax.process_index()}: save_faults done", flush=True)
    os._exit(0)  # the runtime's shutdown would wait for the killed process


def _saved_leaves(work):
    import numpy as np

    expected = np.load(work / "roll_and_save.npz")
    return [expected[f"leaf{i}"] for i in range(len([f for f in expected.files if f.startswith("leaf")]))]


def _check_restores(path, rules, expected):
    import jax_session_state as jss
    from tests.multihost import _scenario as sc

    restored = jss.checkpoint.restore(path, shardings=rules)
    for x, y in zip(sc.host_leaves(restored), expected, strict=True):
        assert x.tobytes() == y.tobytes(), f"{path}: restored bits differ"
    assert len(restored["kv"].k.sharding.device_set) == jax.device_count()
    return restored


def restore_one(work, rules):
    """One process with every device: restore what several saved (after a killed save), then save."""
    import jax_session_state as jss

    names = sorted(p.name for p in (work / "ckpt").iterdir())
    restored = _check_restores(work / "ckpt", rules, _saved_leaves(work))
    jss.checkpoint.save(work / "from_one", restored)
    return {"names": names}, {}


def restore_many(work, rules):
    """Several processes: restore the N-process and the 1-process checkpoint; refuse the damaged copies and one whose
    files vanish as the last process reads them."""
    import shutil

    import jax_session_state as jss
    from jax_session_state.checkpoint import _orbax_io
    from tests.multihost import _scenario as sc

    leaves = _saved_leaves(work)
    _check_restores(work / "ckpt", rules, leaves)
    _check_restores(work / "from_one", rules, leaves)
    read = _orbax_io.read_arrays

    def vanishing(directory, *args):
        """On the last process, the K array's files of the ``vanishing`` copy are deleted as the read begins."""
        if directory.parents[1].name == "vanishing" and jax.process_index() == jax.process_count() - 1:
            manifest = json.loads((directory.parent / "manifest.json").read_text())
            (key,) = [k for k, e in manifest["arrays"].items() if e["where"] == "kv.['k']"]
            shutil.rmtree(directory / key)
        return read(directory, *args)

    _orbax_io.read_arrays = vanishing
    errors = {}
    for damaged in sorted([*work.glob("damaged-*"), work / "vanishing"]):
        try:
            jss.checkpoint.restore(damaged, shardings=rules, timeout=sc.FAULT_TIMEOUT_S)
        except jss.CheckpointError as error:
            errors[damaged.name] = str(error)
    return {"errors": errors}, {}


def pool_step(work, rules):
    """A pool whose slot axis is split over every process's devices, stepped in one donated call."""
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    import jax_session_state as jss
    from tests.multihost import _scenario as sc

    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    slot_axis = NamedSharding(mesh, PartitionSpec("data"))
    pool = jss.SessionPool.allocate(sc.new_session(), slots=sc.POOL_SLOTS, sharding=slot_axis)
    insert = jax.jit(jss.SessionPool.insert, donate_argnums=0)
    for slot in range(sc.POOL_LIVE):
        pool = insert(pool, slot, sc.replicated(sc.pool_session(slot), mesh))
    per_slot = [np.stack(x) for x in zip(*(map(np.asarray, sc.pool_inputs(i)) for i in range(sc.POOL_SLOTS)))]
    per_slot = [sc.global_array(x, slot_axis) for x in per_slot]
    step = jax.jit(jss.SessionPool.map, static_argnums=1, donate_argnums=0)
    before = pool
    pool, out = step(pool, sc.step, *per_slot)
    pool.check()
    assert before.sessions["kv"].k.is_deleted(), "the pool was not donated"
    assert pool.sessions["kv"].k.sharding == slot_axis, pool.sessions["kv"].k.sharding
    held = sorted({shard.index[0].start for shard in pool.sessions["kv"].k.addressable_shards})
    step(jax.tree_util.tree_map(lambda x: x.copy(), pool), sc.step, *per_slot)  # a second step: no recompile
    assert step._cache_size() == 1, f"the pool step compiled {step._cache_size()} times"
    arrays = {f"leaf{i}": x for i, x in enumerate(sc.host_leaves(pool.sessions))}
    arrays["out"] = sc.host_leaves(out)[0]
    arrays["active"] = sc.host_leaves(pool.active)[0]
    return {"slots_held": held, "by_device": pool.nbytes_by_device()}, arrays


def managers_agree(work, rules):
    """One manager per process: the same calls agree silently, different ones raise on both, a missing one times out."""
    import time

    import jax_session_state as jss
    from tests.multihost import _scenario as sc

    me, report = jax.process_index(), {}
    manager = jss.SessionStateManager(park_memory_kind=None, agreement_timeout=30)  # the same calls: no error
    manager.create("a", sc.new_session(rules))
    manager.create("b", sc.new_session(rules))
    started = time.perf_counter()
    for i in range(5):
        manager.put("a", sc.run(manager.get("a"), *sc.inputs(i, rules))[0])
    report["put_s"] = (time.perf_counter() - started) / 5
    seq = manager._agreement._seq
    manager.create("local", sc.new_session())  # on this process's devices: no exchange
    manager.put("local", sc.run(manager.get("local"), *sc.inputs(0))[0])
    report["agreed"], report["local_exchanges"] = seq, manager._agreement._seq - seq

    one = sc.new_session(rules).nbytes_by_device()  # process 0 has room for one session, process 1 for all
    budget = {key: nbytes + (10 if me == 0 else 10**9) for key, nbytes in one.items()}
    manager = jss.SessionStateManager(byte_budget=budget, park_memory_kind=None, agreement_timeout=30)
    manager.create("a", sc.new_session(rules))
    try:
        manager.create("b", sc.new_session(rules))  # process 0's planner preempts "a"; process 1's does nothing
        report["disagreement"] = None
    except jss.ProcessDisagreementError as error:
        report["disagreement"] = str(error)
    report["held_after"] = sorted(manager.held())

    manager = jss.SessionStateManager(park_memory_kind=None, agreement_timeout=2)
    started = time.perf_counter()
    if me == 0:  # process 1 never makes this call
        try:
            manager.create("a", sc.new_session(rules))
            report["timeout"] = None
        except jss.ProcessDisagreementError as error:
            report["timeout"] = str(error)
    report["timeout_s"] = time.perf_counter() - started
    return report, {}


ROLES = {f.__name__: f for f in (roll_and_save, save_faults, restore_one, restore_many, pool_step, managers_agree)}


def main() -> None:
    role, processes, process_id, port, work = sys.argv[1:6]
    if int(processes) > 1:
        jax.distributed.initialize(
            coordinator_address=f"localhost:{port}", num_processes=int(processes), process_id=int(process_id)
        )
    import numpy as np

    from tests.multihost import _scenario as sc

    work = Path(work)
    report, arrays = ROLES[role](work, sc.make_rules())
    (work / f"{role}-{process_id}.json").write_text(json.dumps(report))
    if jax.process_index() == 0 and arrays:
        np.savez(work / f"{role}.npz", **arrays)
    print(f"process {process_id}: {role} done", flush=True)


if __name__ == "__main__":
    main()

"""Sharded session state on 8 fake CPU devices: a donated step, bytes per device, checkpoint throughput.

Measures, in one run:

- a jitted, donated ``KVCache.append`` + ``jss.attend`` step on a cache
  sharded over kv-heads (8 ways), against the same step on one device; the
  compiled step must move no data between devices and write in place;
- bytes per device of that session: each must be total / 8 (bar: within 1%);
- checkpoint save and restore of a 1 GiB head-sharded session with
  ``jax_session_state.checkpoint`` against numpy on the same arrays in the
  same directory: ``numpy.save`` of the jax arrays into new files, flushed
  to disk (``fsync``) as a checkpoint's are, and ``numpy.load`` +
  ``device_put`` back onto the same sharding (bar:
  throughput ratio >= 0.5); also against numpy on host copies alone, and raw
  Orbax with other options, to show what mattered.

Run:  python -m benchmarks.sharded [--full] [--out PATH]  (checkpoints go under $TMPDIR)
"""

from __future__ import annotations

import os

# XLA_FLAGS must be set before jax is imported.
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()

import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import AxisType

import jax_session_state as jss
from benchmarks._common import cli, interleaved, with_lengths

HEADS, HEAD_DIM, CHUNK = 8, 64, 16
MIB = 1 << 20


def step_benchmark(capacity: int, *, rounds: int) -> tuple[list[dict], jss.Session]:
    """A donated append + attention step, sharded 8 ways over heads and on one device."""
    mesh = jax.make_mesh((8,), ("model",), axis_types=(AxisType.Auto,))
    rules = jss.ShardingRules(mesh, {"kv_heads": "model", "heads": "model"})
    rng = np.random.default_rng(0)
    prefix, batch = capacity // 2, 2
    rows = jnp.asarray(rng.normal(size=(batch, prefix, HEADS, HEAD_DIM)), jnp.float32)
    chunk = jss.KVChunk(*(jnp.asarray(rng.normal(size=(batch, CHUNK, HEADS, HEAD_DIM)), jnp.float32) for _ in range(2)))
    q = jnp.asarray(rng.normal(size=(batch, CHUNK, HEADS, HEAD_DIM)), jnp.float32)
    traces = []

    def step(kv: jss.KVCache, chunk: jss.KVChunk, q: jax.Array) -> tuple[jss.KVCache, jax.Array]:
        traces.append(None)
        kv = kv.append(chunk)
        out = jss.attend(q, kv.view())
        return with_lengths(kv, kv.committed - CHUNK), out  # rewind: every call writes the same rows

    jitted = jax.jit(step, donate_argnums=0)
    states = {}
    for name, sharding in (("sharded over 8 devices", rules), ("one device", None)):
        kv = jss.KVCache.allocate(batch=batch, kv_heads=HEADS, head_dim=HEAD_DIM, capacity=capacity, sharding=sharding)
        q_placed = q if sharding is None else jax.device_put(q, jax.sharding.NamedSharding(
            mesh, rules.partition_spec((None, None, "heads", None), q.shape)))
        states[name] = [jax.jit(lambda kv, r: kv.append((r, r)), donate_argnums=0)(kv, rows), q_placed]
    sharded = states["sharded over 8 devices"]
    hlo = jitted.lower(sharded[0], chunk, sharded[1]).compile().as_text()
    collectives = len(re.findall(r"\b(?:all-gather|all-to-all|collective-permute|all-reduce)[-a-z]*\(", hlo))
    pointers = [s.data.unsafe_buffer_pointer() for s in sharded[0].k.addressable_shards]

    def call(name: str) -> Callable[[], None]:
        def run() -> None:
            state = states[name]
            state[0], out = jitted(state[0], chunk, state[1])
            out.block_until_ready()

        return run

    for name in states:
        for _ in range(3):
            call(name)()
    traces_after_warmup = len(traces)
    times = interleaved({name: call(name) for name in states}, rounds=rounds, repeat=20)
    in_place = [s.data.unsafe_buffer_pointer() for s in sharded[0].k.addressable_shards] == pointers
    rows_out = [
        {"measure": f"append {CHUNK} + attention, cap {capacity}, {name} (ms/step)", "value": t * 1e3}
        for name, t in times.items()
    ]
    rows_out += [
        {"measure": "sharded step: collectives in the compiled step", "value": collectives, "bar": "= 0",
         "holds": collectives == 0},
        {"measure": "sharded step: donated shards written in place", "value": in_place, "bar": "yes",
         "holds": in_place},
        {"measure": "step compiles once per placement", "value": traces_after_warmup, "bar": "= 2",
         "holds": len(traces) == 2},
    ]
    session = jss.Session(objects={"kv": sharded[0]}, attrs={"rng": jax.random.key(0)})
    return rows_out, jss.shard(session, rules)


def bytes_per_device(session: jss.Session) -> list[dict]:
    by_device = session.nbytes_by_device()
    total = sum(by_device.values())
    worst = max(abs(b - total / 8) / (total / 8) for b in by_device.values())
    return [
        {"measure": f"bytes per device: {len(by_device)} devices, total {total / MIB:.2f} MiB",
         "value": total / 8 / MIB},
        {"measure": "bytes per device: worst deviation from total / 8 (%)", "value": 100 * worst, "bar": "≤ 1",
         "holds": worst <= 0.01},
    ]


def gib_session() -> tuple[jss.Session, jss.ShardingRules]:
    """A 1 GiB session: a full KV cache sharded over heads, random K/V, plus an RNG key."""
    mesh = jax.make_mesh((8,), ("model",), axis_types=(AxisType.Auto,))
    rules = jss.ShardingRules(mesh, {"kv_heads": "model"})
    kv = jss.KVCache.allocate(batch=4, kv_heads=HEADS, head_dim=HEAD_DIM, capacity=1 << 16, sharding=rules)
    normal = jax.jit(lambda key: jax.random.normal(key, kv.k.shape), out_shardings=kv.k.sharding)
    keys = jax.random.split(jax.random.key(1), 2)
    kv = with_lengths(kv.with_storage(k=normal(keys[0]), v=normal(keys[1])), kv.capacity)
    return jss.shard(jss.Session(objects={"kv": kv}, attrs={"rng": jax.random.key(2)}), rules), rules


def session_arrays(session: jss.Session) -> dict[str, jax.Array]:
    """Every array of a session, RNG keys as their key data: what the library saves."""
    return {
        str(i): jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        for i, x in enumerate(jax.tree_util.tree_leaves(session))
    }


def measured(candidates: dict[str, tuple[Callable[[], object], Callable[[], None]]], rounds: int) -> dict[str, float]:
    """Median seconds of each ``run`` over rounds; each ``cleanup`` runs untimed after.

    The order rotates each round, so no candidate always follows the same one
    (whose freed memory the next one pays to fault back in), and each starts
    from a quiet disk (``os.sync``, untimed), so none pays for another's writeback.
    """
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    names = list(candidates)
    for i in range(rounds):
        for name in names[i % len(names):] + names[: i % len(names)]:
            run, cleanup = candidates[name]
            os.sync()
            start = time.perf_counter()
            jax.block_until_ready(run())
            samples[name].append(time.perf_counter() - start)
            cleanup()
    return {name: statistics.median(times) for name, times in samples.items()}


ORBAX_VARIANTS = {
    "Orbax defaults (OCDBT, compressed)": ({}, None),
    "Orbax OCDBT, uncompressed": ({"use_compression": False}, None),
    "Orbax plain zarr, uncompressed": ({"use_ocdbt": False, "use_compression": False}, None),
    "Orbax plain zarr, uncompressed, 16 MiB chunks (the library's)": (
        {"use_ocdbt": False, "use_compression": False}, 16 * MIB),
    "Orbax plain zarr, uncompressed, no pinned-host copy": (
        {"use_ocdbt": False, "use_compression": False, "enable_pinned_host_transfer": False}, None),
}
SAME_ARRAYS = {"save": "numpy.save of the jax arrays", "restore": "numpy.load + device_put"}
HOST_ONLY = {"save": "numpy.save of host copies", "restore": "numpy.load"}


def checkpoint_benchmark(directory: Path, *, rounds: int) -> list[dict]:
    session, rules = gib_session()
    arrays = session_arrays(session)
    total = sum(x.nbytes for x in arrays.values())
    host = {name: np.asarray(x) for name, x in arrays.items()}  # numpy saves what is already on the host

    def np_save(source: dict, folder: str) -> tuple[Callable[[], None], Callable[[], None]]:
        """numpy.save into new files, each flushed to disk as a checkpoint's are; removing them is not timed."""
        path = directory / folder

        def save() -> None:
            path.mkdir()
            for name, x in source.items():
                with open(path / f"{name}.npy", "wb") as f:
                    np.save(f, x)
                    f.flush()
                    os.fsync(f.fileno())

        return save, lambda: shutil.rmtree(path)

    def np_load() -> list[np.ndarray]:
        return [np.load(directory / "numpy" / f"{name}.npy") for name in host]

    def np_load_placed() -> list[jax.Array]:
        return [jax.device_put(x, arrays[name].sharding) for name, x in zip(host, np_load())]

    def orbax(index: int, options: dict, chunk: int | None) -> tuple[Callable, Callable, Callable]:
        checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**options))
        path = directory / f"orbax-{index}"
        save_args = {name: ocp.SaveArgs(chunk_byte_size=chunk) for name in arrays}
        target = {name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for name, x in arrays.items()}
        restore_args = {name: ocp.ArrayRestoreArgs(sharding=x.sharding) for name, x in arrays.items()}
        return (
            lambda: checkpointer.save(path, args=ocp.args.PyTreeSave(arrays, save_args=save_args)),
            lambda: checkpointer.restore(path, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args)),
            lambda: shutil.rmtree(path),
        )

    library = directory / "library"
    jss.checkpoint.save(library, session)
    np_save(host, "numpy")[0]()
    nothing = lambda: None  # noqa: E731
    variants = {name: orbax(i, *spec) for i, (name, spec) in enumerate(ORBAX_VARIANTS.items())}
    saves = measured(
        {
            SAME_ARRAYS["save"]: np_save(arrays, "numpy-of-jax"),
            HOST_ONLY["save"]: np_save(host, "numpy-of-host"),
            "jss.checkpoint.save": (lambda: jss.checkpoint.save(library, session), nothing),
        }
        | {name: (save, cleanup) for name, (save, _, cleanup) in variants.items()},
        rounds,
    )
    for save, _, _ in variants.values():
        save()
    restores = measured(
        {
            SAME_ARRAYS["restore"]: (np_load_placed, nothing),
            HOST_ONLY["restore"]: (np_load, nothing),
            "jss.checkpoint.restore": (lambda: jss.checkpoint.restore(library, shardings=rules), nothing),
        }
        | {name: (restore, nothing) for name, (_, restore, _) in variants.items()},
        rounds,
    )
    restored = jss.checkpoint.restore(library, shardings=rules)
    exact = all(np.array_equal(np.asarray(x), host[name]) for name, x in session_arrays(restored).items())

    rows = []
    for what, times in (("save", saves), ("restore", restores)):
        for name, seconds in times.items():
            row = {
                "measure": f"{what} {total / MIB:.0f} MiB: {name} (MB/s)",
                "value": total / seconds / 1e6,
                "ratio": times[SAME_ARRAYS[what]] / seconds,
                "ratio to host-only numpy": times[HOST_ONLY[what]] / seconds,
            }
            rows.append(row)
            if name.startswith("jss."):  # the bar, as its own row: the runner's table shows a bar row's ratio
                rows.append({"measure": f"{what} {total / MIB:.0f} MiB: {name} / numpy, same arrays (throughput)",
                             "value": row["ratio"], "bar": "≥ 0.5", "holds": row["ratio"] >= 0.5})
    rows.append({"measure": "restored session equals the saved one bit for bit", "value": exact, "bar": "yes",
                 "holds": exact})
    return rows


def run(*, full: bool) -> list[dict]:
    """Every part at the quick sizes, or the large ones; checkpoints go to a temporary directory."""
    if jax.device_count() != 8:
        raise SystemExit(f"needs 8 devices; jax has {jax.device_count()} (was jax imported before XLA_FLAGS was set?)")
    step_rows, session = step_benchmark(32768 if full else 4096, rounds=15 if full else 7)
    directory = Path(tempfile.mkdtemp(prefix="jss-bench-"))
    try:
        checkpoint_rows = checkpoint_benchmark(directory, rounds=9 if full else 5)
    finally:
        shutil.rmtree(directory)
    return step_rows + bytes_per_device(session) + checkpoint_rows


if __name__ == "__main__":
    cli("sharded", run, __doc__, columns=["measure", "value", "ratio", "ratio to host-only numpy", "bar", "holds"])

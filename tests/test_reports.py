"""summary(): every object, its kind, fill and bytes per device, in text, rich and HTML."""

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rich.console import Console

import jax_session_state as jss
from tests.support.devices import DEVICE


def make_session():
    session = jss.Session(
        objects={
            "kv": jss.KVCache.allocate(batch=2, kv_heads=2, head_dim=4, window=8, sink=2, max_staged=4),
            "prompt": jss.FixedState.allocate(shapes=(2, 3)),
            "cond": jss.EncodeOnceKV.allocate(batch=2, kv_heads=2, head_dim=4, capacity=4, recompute_source="prompt"),
            "frames": jss.LatentBuffer.allocate(capacity=3, item_shape=(5,), ring=True, max_staged=1),
            "bank": jss.RetrievalStore.allocate(capacity=6, key_dim=4, value_shapes=(2,)),
        },
        attrs={"rng": jax.random.key(0)},
    )
    rows = jnp.ones((2, 3, 2, 4))
    return session.append(kv=(rows, rows), frames=jnp.ones((2, 5))).stage(kv=(rows[:, :1], rows[:, :1]))


def test_rows_describe_every_object():
    session = make_session()
    table = jss.summary(session)
    by_name = {row["name"]: row for row in table.rows}
    assert set(by_name) == {"kv", "prompt", "cond", "frames", "bank", "attrs"}
    assert by_name["kv"]["kind"] == "KVCache" and by_name["kv"]["committed"] == [3, 3]
    assert by_name["kv"]["staged"] == [1, 1] and by_name["kv"]["capacity"] == 10  # sink 2 + window 8 visible
    assert by_name["kv"]["margin"] == 4  # the ring's staging slots
    assert by_name["frames"]["committed"] == 2 and by_name["cond"]["recompute"] == "prompt"
    assert (by_name["frames"]["capacity"], by_name["frames"]["margin"]) == (3, 1)
    assert (by_name["cond"]["committed"], by_name["cond"]["staged"]) == ([0, 0], [0, 0])
    assert (by_name["prompt"]["committed"], by_name["prompt"]["capacity"]) == (1, 1)
    for name, obj in session.objects.items():
        assert by_name[name][DEVICE] == obj.nbytes
    assert sum(row.get(DEVICE, 0) for row in table.rows) == session.nbytes
    text = str(table)
    for name in session.objects:
        assert name in text
    assert by_name["kv"]["shapes"] == "[2, 2, 14, 4]" and DEVICE in text.splitlines()[0]
    assert by_name["frames"]["shapes"] == "[4, 5]" and by_name["bank"]["shapes"].startswith("[6, 4]")


def test_the_printed_table_reads_without_a_glossary():
    """A ring that has seen more than it keeps says both; staging slots join the capacity; bytes have units."""
    ring = jss.KVCache.allocate(batch=1, kv_heads=2, head_dim=8, window=512, sink=16, max_staged=16)
    rows = jnp.asarray(np.random.default_rng(0).normal(size=(1, 16, 2, 8)), jnp.float32)
    for _ in range(300):  # 4800 positions seen, 528 kept
        ring = ring.append((rows, rows))
    frames = jss.LatentBuffer.allocate(capacity=2, item_shape=(4,), ring=True, max_staged=8)
    text = str(jss.summary(jss.Session(objects={"kv": ring, "frames": frames})))
    header, _, frames_line, kv_line = text.splitlines()
    assert "margin" not in header and header.rstrip().endswith("cpu:0 bytes")
    assert "[528 of 4800 seen]" in kv_line and "528 + 16 staging" in kv_line
    assert f"{ring.nbytes / 1024:.1f} KiB" in kv_line
    assert "2 + 8 staging" in frames_line and frames_line.rstrip().endswith(f"{frames.nbytes} B")


def test_non_resident_objects_are_shown():
    session = make_session()
    session = session.with_objects(cond=session["cond"].evict()[0])
    row = next(r for r in jss.summary(session).rows if r["name"] == "cond")
    assert row["resident"] is False and DEVICE not in row


def test_many_sessions_share_one_byte_count():
    session = make_session()
    table = jss.summary({"a": session, "b": session})  # the same buffers twice: counted once
    assert table.columns[0] == "session"
    assert sum(row.get(DEVICE, 0) for row in table.rows) == session.nbytes


def test_rich_and_html():
    table = jss.summary(make_session())
    buffer = io.StringIO()
    Console(file=buffer, width=250, color_system=None).print(table)
    assert "KVCache" in buffer.getvalue() and "EncodeOnceKV" in buffer.getvalue()
    html = table._repr_html_()
    assert html.startswith("<table>") and html.count("<tr>") == len(table.rows) + 1


def test_rejects_other_things():
    with pytest.raises(jss.PayloadTypeError, match="takes a state object"):
        jss.summary(3)

"""A save from several processes whose primary fails: every process raises, none waits, nothing is left behind.

Two real processes on this machine, joined as in ``tests/multihost`` (a
localhost coordinator, gloo CPU collectives, 2 fake CPU devices each), save
the session ``tests/multihost/_scenario.py`` rolls out, sharded over both.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.multihost import _launch

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    process, port, work = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process)
    import jax_session_state as jss
    from jax_session_state.checkpoint import _atomic, _manifest
    from tests.multihost import _scenario as sc

    session, _ = sc.rolled_out(sc.make_rules(), steps=1)
    jss.checkpoint.save(work / "ckpt", session)

    def fails(*args, **kwargs):
        raise OSError(28, "No space left on device")

    outcomes = {}
    for name, module, attribute in (("manifest", _manifest, "write"), ("begin", _atomic, "begin")):
        original = getattr(module, attribute)
        if process == 0:  # only the primary writes the manifest and starts a save
            setattr(module, attribute, fails)
        try:
            jss.checkpoint.save(work / "ckpt", session)
            outcomes[name] = "saved"
        except Exception as error:
            outcomes[name] = f"{type(error).__name__}: {error}"
        setattr(module, attribute, original)
    (work / f"outcomes-{process}.json").write_text(json.dumps(outcomes))
    """
)


def test_when_the_primary_cannot_write_or_start_a_save_every_process_raises(tmp_path):
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)
    env = {**os.environ, "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=2".strip(),
           "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    port = _launch.free_port()
    children = [
        subprocess.Popen([sys.executable, "-c", CHILD, str(i), str(port), str(tmp_path)], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]
    try:
        logs = [child.communicate(timeout=240)[0] for child in children]
    finally:
        for child in children:
            child.kill()  # after a timeout: a process that waits for a primary that gave up
    assert [child.returncode for child in children] == [0, 0], "\n".join(logs)[-10_000:]
    primary, other = (json.loads((tmp_path / f"outcomes-{i}.json").read_text()) for i in range(2))
    assert primary == {"manifest": "OSError: [Errno 28] No space left on device",
                       "begin": "OSError: [Errno 28] No space left on device"}
    assert other["manifest"].startswith("CheckpointError: the primary process could not write the manifest of ")
    assert other["begin"].startswith("CheckpointError: the primary process could not start a checkpoint in ")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["ckpt-000001"]  # no partial left behind

"""The scale-out guide's multi-host recipe, as printed, runs on 2 processes and prints a summary on each."""

import re
from pathlib import Path

from tests.multihost import _launch
from tests.test_docs import titled_program

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "scale-out.md"


def test_the_multi_host_recipe_of_the_guide_runs_and_prints_what_each_process_holds(tmp_path):
    program = tmp_path / "rollout.py"
    program.write_text(titled_program(GUIDE.read_text(), "rollout.py"))
    job = _launch.Job("rollout", 2, tmp_path, program=program, arguments=("--path", str(tmp_path / "ckpt")),
                      timeout=180)
    codes = job.wait()
    assert codes == [0, 0], f"exit codes {codes}\n{job.outputs()}"
    for i in range(2):
        lines = (tmp_path / f"rollout-{i}.log").read_text().splitlines()
        header = next(n for n, line in enumerate(lines) if line.startswith("process  name"))
        columns = lines[header].split()
        assert len([c for c in columns if re.fullmatch(r"cpu:\d+", c)]) == 2, lines[header]  # its own 2 devices
        kv, attrs = lines[header + 2].split(), lines[header + 3].split()
        assert kv[:5] == [f"{i}", "of", "2", "kv", "KVCache"], kv
        assert kv[5:13] == ["[1,", "8,", "4096,", "64]", "float32", "[64]", "[0]", "4096"], kv
        shards = 2 * (1 * 2 * 4096 * 64 * 4)  # K and V: 2 of the 8 heads on each of the 4 devices
        assert shards == 4 << 20 and kv[-4:] == ["4.0", "MiB", "4.0", "MiB"], kv  # and the small counts, replicated
        assert attrs[3:6] == ["attrs", "attrs", "rng"], attrs
        assert f"process {i}: 1 session held, {16 * 4} tokens restored" in lines, lines[-5:]
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["ckpt-000001"]

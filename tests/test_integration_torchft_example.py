"""examples/torchft_diloco.py, the documented SparseDiLoCo example, runs as written against the
real lighthouse (3 replica processes on loopback) and learns: each replica's loss falls, the
replicas end with the same weights, and the DiLoCo user's Nesterov momentum is served capped
over error feedback, in one log line. The README's and docs/fault-tolerance.md's SparseDiLoCo
snippets are lines of it."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "torchft_diloco.py")


@pytest.mark.slow
def test_the_documented_example_learns(tmp_path):
    pytest.importorskip("torchft")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, EXAMPLE, "--syncs", "16", "--timeout", "240"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in out, out[-3000:]
    losses = re.findall(r"replica \d: loss ([0-9.]+) -> ([0-9.]+) after 16 syncs", proc.stdout)
    assert len(losses) == 3, out[-3000:]
    assert all(float(last) < 0.8 * float(first) for first, last in losses), losses
    assert "the replicas agree and the loss fell" in proc.stdout
    # the outer momentum line, once per replica
    assert out.count("the outer SGD's momentum 0.9 served as 0.5 (Nesterov kept)") == 3, \
        out[-3000:]


def test_the_sparse_diloco_snippet_of_the_docs_is_lines_of_the_example():
    """docs/fault-tolerance.md's snippet (the README's is checked by tests/test_readme.py)."""
    from test_readme import snippets_of
    with open(os.path.join(ROOT, "docs", "fault-tolerance.md")) as f:
        snippets = snippets_of(f.read())
    assert [path for path, _ in snippets] == ["examples/torchft_diloco.py"]
    assert snippets[0][1] == [], snippets

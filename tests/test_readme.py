"""The README's first example runs as written, on 2 gloo ranks (so it cannot rot)."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from teardown_loop import first_example  # noqa: E402  (one home: the loop runs it too)


def test_first_example_is_complete_python():
    code = first_example()
    compile(code, "first_example.py", "exec")
    for name in ("import torch", "SparseAllreduce", "init_process_group", "reduce_gradients"):
        assert name in code


@pytest.mark.slow
def test_first_example_runs_on_two_gloo_ranks(tmp_path):
    path = tmp_path / "first_example.py"
    path.write_text(first_example())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", str(path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 3, out[-3000:]
    assert losses[-1] < losses[0], losses                  # it trains
    assert "sent" in proc.stdout and "Traceback" not in out, out[-3000:]
    # the example ends with oktopk_triton.shutdown(exit_code=0): no gloo teardown abort
    assert proc.returncode == 0, out[-3000:]


@pytest.mark.slow
def test_digits_example_runs_on_two_gloo_ranks():
    """examples/train_digits.py (the README points to it) trains and exits with status 0."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    script = os.path.join(ROOT, "examples", "train_digits.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", script, "oktopk", "0.05", "2"], env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    accs = [float(x) for x in re.findall(r"test acc ([0-9.]+)%", proc.stdout)]
    assert len(accs) == 2 and accs[-1] > 50.0, out[-3000:]
    assert proc.returncode == 0 and "Traceback" not in out, out[-3000:]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_in_the_docs_resolves():
    """README.md and docs/*.md: each relative link names a file of the repository (relative to
    the file holding it), and each #anchor a heading of its target."""
    docs = ["README.md"] + [os.path.join("docs", f) for f in sorted(os.listdir(
        os.path.join(ROOT, "docs"))) if f.endswith(".md")]
    broken = []
    for doc in docs:
        text = open(os.path.join(ROOT, doc)).read()
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), target or
                                                 os.path.basename(doc)))
            if not os.path.exists(path):
                broken.append(f"{doc}: {target}")
            elif anchor and path.endswith(".md"):
                heads = {_anchor(h) for h in re.findall(r"^#+ (.+)$", open(path).read(), re.M)}
                if anchor not in heads:
                    broken.append(f"{doc}: {target}#{anchor}")
    assert not broken, broken

"""Every example in examples/ runs under torchrun on 2 gloo ranks and ends with status 0 (they end
with ``oktopk_triton.shutdown(exit_code=0)``: no gloo teardown abort). Those that save can be
run again: a second run in the same directory resumes where the first stopped (each run trains 2
epochs more than the checkpoint holds: the second run's count is twice the first's; checked on
the Accelerate example), or saves over the first run's files. The digits example saves nothing:
one run."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cwd, script, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", os.path.join(ROOT, "examples", script),
                           *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in out, out[-3000:]
    return proc.stdout


@pytest.mark.slow
# The examples resume through the same package code as the integration tests, which resume each
# framework bit for bit (tests/test_integration_*.py): one example runs twice to check an
# example's own resume; the slower two (Lightning's and the Trainer's start-up, some 25 s a
# run on the 2-core machine) run once.
@pytest.mark.parametrize("script,package,runs", [
    ("accelerate_sparse.py", "accelerate", 2),
    ("lightning_sparse.py", "lightning", 1),
    ("trainer_sparse.py", "transformers", 1)])
def test_resumable_example_runs_again_and_resumes(tmp_path, script, package, runs):
    pytest.importorskip(package)
    iters = []
    for i in range(runs):
        out = _run(tmp_path, script)
        m = re.search(r"loss ([0-9.]+) after (\d+) iterations; ([0-9.]+) MB sent", out)
        assert m, out[-3000:]
        assert ("(resumed)" in out) == (i > 0), out[-3000:]
        iters.append(int(m.group(2)))
    # each run trains as many steps as the first, continuing the state's count
    assert iters == [iters[0] * (i + 1) for i in range(runs)], iters


@pytest.mark.slow
def test_fsdp_example_runs_twice(tmp_path):
    pytest.importorskip("torch.distributed.fsdp")
    for _ in range(2):
        out = _run(tmp_path, "fsdp_hsdp_sparse.py")
        assert out.count("across replicas") == 3, out[-3000:]
        assert sorted(os.listdir(tmp_path / "out" / "fsdp-sparse")) == [
            "oktopk-rank0-of2.pt", "oktopk-rank1-of2.pt"]


@pytest.mark.slow
def test_digits_example_trains(tmp_path):
    pytest.importorskip("sklearn")
    out = _run(tmp_path, "train_digits.py", "oktopk", "0.05", "2")
    accs = [float(x) for x in re.findall(r"test acc ([0-9.]+)%", out)]
    assert len(accs) == 2 and accs[-1] > 50.0, out[-3000:]          # it trains
    assert os.listdir(tmp_path) == []                               # and leaves nothing behind


def test_every_example_ends_with_shutdown():
    """The last statement each example runs is ``oktopk_triton.shutdown(exit_code=0)``."""
    import ast
    names = sorted(f for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".py"))
    assert len(names) >= 5
    for name in names:
        tree = ast.parse(open(os.path.join(ROOT, "examples", name)).read())
        last = tree.body[-1]
        if isinstance(last, ast.If):                          # if __name__ == "__main__":
            last = last.body[-1]
        assert ast.unparse(last) == "oktopk_triton.shutdown(exit_code=0)", name

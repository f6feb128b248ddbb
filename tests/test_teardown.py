"""``oktopk_triton.shutdown``: a rank ends after a barrier, with its group destroyed and its
output flushed, and leaves with the exit code it was given."""
import os
import subprocess
import sys
import textwrap


def _run(tmp_path, code, *launcher):
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(code))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, *launcher, str(path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)


def test_shutdown_without_a_group_flushes_and_exits_with_the_code(tmp_path):
    p = _run(tmp_path, """
        import sys
        from oktopk_triton import shutdown
        print("buffered line", end="")          # no newline: only a flush writes it
        sys.stderr.write("err line")
        shutdown(exit_code=3)
        print("never")
    """)
    assert p.returncode == 3
    assert p.stdout == "buffered line" and p.stderr.endswith("err line")


def test_shutdown_ends_two_gloo_ranks_cleanly(tmp_path):
    p = _run(tmp_path, """
        import torch, torch.distributed as dist
        from oktopk_triton import shutdown
        dist.init_process_group("gloo")
        t = torch.ones(3) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        shutdown()                               # barrier, destroy, gc; the script goes on
        assert not dist.is_initialized()
        print(f"rank done {t.tolist()}", flush=True)
        shutdown(exit_code=0)                    # no group left: only the exit
    """, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("rank done [3.0, 3.0, 3.0]") == 2

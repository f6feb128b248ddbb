"""bench/ranks.run_group: the ranks a launch starts never outlive it, whether it finishes, times
out, or is sent SIGTERM (train's driver used subprocess.run, whose timeout killed torchrun alone
and left its ranks running)."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from oktopk_triton.bench.ranks import run_group

# a stand-in for torchrun: starts a "rank" that sleeps, says the rank's pid (written whole, by
# a rename) before it sleeps itself, so the pid is on disk before the launcher can exit
LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, time
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    with open(sys.argv[1] + ".part", "w") as f:
        f.write(str(rank.pid))
    os.replace(sys.argv[1] + ".part", sys.argv[1])
    time.sleep(float(sys.argv[2]))
""")


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _rank_pid(path, timeout=30.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError("the stand-in rank did not start")


def _gone(pid: int, timeout=15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _running(pid):
        time.sleep(0.05)
    return not _running(pid)


def test_a_finished_launch_ends_its_leftover_ranks(tmp_path):
    pidfile = tmp_path / "rank.pid"
    assert run_group([sys.executable, "-c", LAUNCHER, str(pidfile), "1"]) == 0
    assert _gone(_rank_pid(pidfile))


def test_a_timed_out_launch_ends_every_rank(tmp_path):
    pidfile = tmp_path / "rank.pid"
    with pytest.raises(subprocess.TimeoutExpired):
        run_group([sys.executable, "-c", LAUNCHER, str(pidfile), "300"], timeout=8)
    # 8 s: long enough for the launcher's interpreter to start its rank under a loaded machine
    assert pidfile.exists(), "the stand-in launcher did not start its rank within 8 s"
    assert _gone(int(pidfile.read_text()))


def test_sigterm_to_the_driver_ends_every_rank(tmp_path):
    pidfile = tmp_path / "rank.pid"
    driver = (f"from oktopk_triton.bench.ranks import run_group; import sys; "
              f"run_group([sys.executable, '-c', {LAUNCHER!r}, {str(pidfile)!r}, '300'])")
    p = subprocess.Popen([sys.executable, "-c", driver])
    rank = _rank_pid(pidfile)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 128 + signal.SIGTERM
    assert _gone(rank)
    assert os.path.exists(pidfile)

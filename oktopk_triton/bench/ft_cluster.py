"""A torchft cluster on one machine, for the fault tests and ``oktopk-bench faults``: the
``torchft_lighthouse`` on loopback and replica processes (:mod:`oktopk_triton.bench.ft_replica`),
each started, waited for and killed by pid, every wait bounded.

    with Lighthouse(min_replicas=2) as lh:
        reps = [Replica(cfg(i, lh.address)) for i in range(3)]
        results = [r.result(timeout=120) for r in reps]
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from .ranks import free_port

__all__ = ["Lighthouse", "Replica", "lighthouse_binary", "ClusterError", "wait_file",
           "wait_ready", "wait_for"]


class ClusterError(RuntimeError):
    """A replica failed, timed out, or the lighthouse could not start."""


def lighthouse_binary() -> str:
    """The ``torchft_lighthouse`` that torchft's wheel installs (next to this Python first)."""
    here = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    found = here if os.path.exists(here) else shutil.which("torchft_lighthouse")
    if found is None:
        raise ClusterError("torchft_lighthouse not found: pip install \"oktopk-triton[torchft]\"")
    return found


class Lighthouse:
    """``torchft_lighthouse`` on 127.0.0.1 (a free port), stopped by pid on exit.

    ``join_timeout_ms`` must exceed the replicas' collective ``timeout`` (5 s): after a failed
    sync, one replica may see the failure at once and another only after ``timeout``; a
    shorter join timeout forms the next quorum without the later one, which is then left to
    wait alone if the others finish."""

    def __init__(self, min_replicas: int = 1, join_timeout_ms: int = 10000,
                 quorum_tick_ms: int = 50, heartbeat_timeout_ms: int = 2000) -> None:
        self.port = free_port()
        self.address = f"http://127.0.0.1:{self.port}"
        self._cmd = [lighthouse_binary(), "--min_replicas", str(min_replicas),
                     "--quorum_tick_ms", str(quorum_tick_ms),
                     "--join_timeout_ms", str(join_timeout_ms),
                     "--heartbeat_timeout_ms", str(heartbeat_timeout_ms),
                     "--bind", f"127.0.0.1:{self.port}"]
        self.proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "Lighthouse":
        self.proc = subprocess.Popen(self._cmd, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        import socket
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:      # bounded: until it accepts connections
            if self.proc.poll() is not None:
                raise ClusterError(f"torchft_lighthouse exited with {self.proc.returncode}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.05)
        self.__exit__()
        raise ClusterError("torchft_lighthouse did not start within 60 s")

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


class _Forked:
    """A replica forked from this process (already holding torch and torchft: no start-up
    cost), with the part of ``subprocess.Popen`` the harness uses. Fork only from a
    single-threaded harness (``oktopk_triton.bench.ft_soak``)."""

    def __init__(self, config: Dict[str, Any], log: str) -> None:
        pid = os.fork()
        if pid == 0:                                      # the child: run the replica, exit
            code = 1
            try:
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                from .ft_replica import main
                code = main([json.dumps(config)])
            finally:
                os._exit(code)
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"replica pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode


class Replica:
    """One replica group of one process: ``python -m oktopk_triton.bench.ft_replica CONFIG``
    (``fork=True``: forked from this process instead). ``config`` is a dict (see that module);
    the result is the dict it writes."""

    def __init__(self, config: Dict[str, Any], workdir: Optional[str] = None,
                 fork: bool = False) -> None:
        self.workdir = workdir or tempfile.mkdtemp(prefix="oktopk-ft-")
        self.config = dict(config)
        self.config.setdefault("result", os.path.join(
            self.workdir, f"replica{config['replica']}-{os.getpid()}-{time.monotonic_ns()}.json"))
        self.log = self.config["result"] + ".log"
        if fork:
            self.proc: Any = _Forked(self.config, self.log)
            return
        env = dict(os.environ, RUST_LOG="error", OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "oktopk_triton.bench.ft_replica",
                 json.dumps(self.config)], stdout=log, stderr=subprocess.STDOUT, env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL by pid (the test's or the demo's fault), and reap it."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def progress(self) -> int:
        """The replica's last committed sync count, from its progress file (0 before)."""
        try:
            with open(self.config["result"] + ".progress") as f:
                return int(f.read().strip() or 0)
        except (OSError, ValueError):
            return 0

    def ready(self) -> bool:
        """Whether the replica's Manager is up (it wrote ``result.ready``)."""
        return os.path.exists(self.config["result"] + ".ready")

    def tail(self, lines: int = 15) -> str:
        try:
            with open(self.log) as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def result(self, timeout: float) -> Dict[str, Any]:
        """Wait (bounded) for the replica to exit; its result dict, with ``returncode``. A
        replica that does not exit in time is killed and :class:`ClusterError` raised."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise ClusterError(f"replica {self.config['replica']} did not finish within "
                               f"{timeout:.0f} s; its log ends:\n{self.tail()}")
        res: Dict[str, Any] = {"returncode": self.proc.returncode, "log": self.tail()}
        if os.path.exists(self.config["result"]):
            with open(self.config["result"]) as f:
                res.update(json.load(f))
        return res


def wait_file(replica: Replica, suffix: str, what: str, timeout: float) -> None:
    """Wait (bounded) until ``replica`` writes ``result + suffix`` (``what`` names the moment
    in the error when it does not, or exits first)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(replica.config["result"] + suffix):
        if replica.proc.poll() is not None:
            raise ClusterError(f"replica {replica.config['replica']} exited early:\n"
                               f"{replica.tail()}")
        if time.monotonic() > deadline:
            raise ClusterError(f"replica {replica.config['replica']} did not {what} within "
                               f"{timeout:.0f} s")
        time.sleep(0.02)


def wait_ready(replica: Replica, timeout: float) -> None:
    """Wait (bounded) until ``replica``'s Manager is up."""
    wait_file(replica, ".ready", "start its Manager", timeout)


def wait_for(replicas: List[Replica], who: int, syncs: int, timeout: float) -> None:
    """Wait (bounded) until replica ``who`` has committed ``syncs`` syncs."""
    deadline = time.monotonic() + timeout
    while replicas[who].progress() < syncs:
        if replicas[who].proc.poll() is not None:
            raise ClusterError(f"replica {who} exited early:\n{replicas[who].tail()}")
        if time.monotonic() > deadline:
            raise ClusterError(f"replica {who} did not reach sync {syncs} within {timeout:.0f} s")
        time.sleep(0.05)

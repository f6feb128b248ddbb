"""The one place that launches ranks: what every multi-process benchmark (``oktopk-bench
collectives``, ``ddp``, ``train``) and the tests' ``run_gloo`` / ``run_nccl`` share.

* **Spawning** (:class:`Ranks`): P ``torch.multiprocessing`` *spawn* processes (or, with
  ``start_method="forkserver"``, processes forked from a server that imported torch once; each
  gets the caller's environment of the moment), each running
  ``target(rank, P, port, send, *args)`` through :func:`_entry`; ``send(kind, payload)`` puts a
  message for the parent. A target that returns adds ``("done", its value)``; one that raises
  adds ``("fatal", (exception type name, traceback))`` and exits 1. The parent reads messages
  with :meth:`Ranks.get`, which also reports a rank that died without a last message
  (``"died"``) and a passed deadline (``"timeout"``).
* **Per-rank entry** (:func:`init_rank`): the GPU placement and its environment, then the
  process group on a TCP rendezvous (``port``) or torchrun's environment (``port=None``).
* **Communicators** (:func:`make_comm`): ``torch`` (:class:`TorchCommunicator` on the default
  group) or ``cupy`` (:class:`NcclCommunicator`, bootstrapped through the default group).
* **GPU placement** (:func:`placement`): rank r on ``cuda:(r % GPUs)``; ranks that share a GPU
  each claim their own ``NCCL_HOSTID`` (NCCL refuses two ranks of one communicator on one GPU
  of one host, and seeing P hosts talks over loopback sockets), and need the CUDA MPS daemon to
  run at once rather than time-sliced (:func:`detect_mps`, :func:`mps_warning`).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import queue as _queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable, Dict, Iterator, List, Mapping, NoReturn, Optional, Tuple

__all__ = ["Ranks", "init_rank", "make_comm", "placement", "ranks_share_gpu", "detect_mps",
           "mps_warning", "free_port", "environ", "exit_rank", "run_group", "kill_group"]


# -- GPU placement and MPS -------------------------------------------------------------------------
def ranks_share_gpu(P: int, ngpu: int) -> bool:
    return ngpu > 0 and P > ngpu


def placement(rank: int, P: int, ngpu: int) -> Tuple[int, Dict[str, str]]:
    """(GPU index, environment to set before NCCL initialises) of ``rank`` among ``P``."""
    if ngpu < 1:
        raise RuntimeError("nccl: no CUDA GPU")
    env = {"NCCL_HOSTID": f"oktopk-rank{rank}"} if ranks_share_gpu(P, ngpu) else {}
    return rank % ngpu, env


_MPS_DEFAULT_PIPE = "/tmp/nvidia-mps"


def detect_mps(env=None, run=None, exists=None) -> Dict[str, Any]:
    """Whether the CUDA MPS control daemon serves this environment's processes.

    Active when its pipe directory (``CUDA_MPS_PIPE_DIRECTORY``, default /tmp/nvidia-mps) holds
    the ``control`` pipe and ``echo get_server_list | nvidia-cuda-mps-control`` answers. Without
    that command, a running ``nvidia-cuda-mps-server`` in ``nvidia-smi`` counts. ``run`` and
    ``exists`` replace ``subprocess.run`` and ``os.path.exists`` (tests)."""
    env = dict(os.environ if env is None else env)
    run = subprocess.run if run is None else run
    exists = os.path.exists if exists is None else exists
    pipe = env.get("CUDA_MPS_PIPE_DIRECTORY") or _MPS_DEFAULT_PIPE
    info: Dict[str, Any] = {"active": False, "pipe_directory": pipe,
                            "control_pipe": exists(os.path.join(pipe, "control")),
                            "servers": None, "detail": ""}
    try:
        r = run(["nvidia-cuda-mps-control"], input="get_server_list\n", capture_output=True,
                text=True, timeout=10, env=env)
    except FileNotFoundError:
        info["detail"] = "nvidia-cuda-mps-control not found"
    except subprocess.TimeoutExpired:
        info["detail"] = "nvidia-cuda-mps-control did not answer in 10 s"
    else:
        text = f"{r.stdout or ''}{r.stderr or ''}".strip()
        refused = any(w in text.lower() for w in ("cannot find", "not running", "failed",
                                                  "error", "no such"))
        if r.returncode == 0 and not refused and info["control_pipe"]:
            info["active"] = True
            info["servers"] = [x for x in (r.stdout or "").split() if x.isdigit()]
            info["detail"] = f"control daemon answers on {pipe}"
        else:
            info["detail"] = (f"nvidia-cuda-mps-control: rc={r.returncode}, "
                              f"control pipe {'present' if info['control_pipe'] else 'absent'}"
                              + (f": {text[:200]}" if text else ""))
        return info
    try:
        r = run(["nvidia-smi", "-q"], capture_output=True, text=True, timeout=20, env=env)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return info
    if r.returncode == 0 and "nvidia-cuda-mps-server" in (r.stdout or ""):
        info["active"] = True
        info["detail"] += "; nvidia-smi lists nvidia-cuda-mps-server"
    return info


def mps_warning(P: int, ngpu: int, mps: Dict[str, Any]) -> Optional[str]:
    """The loud warning when ranks share a GPU without MPS (None otherwise)."""
    if not ranks_share_gpu(P, ngpu) or mps.get("active"):
        return None
    return (f"{P} ranks share {ngpu} GPU(s) and the CUDA MPS daemon is NOT active "
            f"({mps.get('detail') or 'not detected'}): the ranks are time-sliced on the GPU, a "
            "spinning NCCL kernel of one rank holds it while the others wait, and step times "
            "are not those of a cluster (measured on an H100, P=4: a 4-byte allreduce 18 ms "
            "time-sliced, 0.05 ms with MPS). Start MPS first: export "
            "CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log; mkdir -p "
            "both; nvidia-cuda-mps-control -d")


def warn_loudly(text: str) -> None:
    bar = "!" * 78
    print(f"\n{bar}\nWARNING: {text}\n{bar}\n", file=sys.stderr, flush=True)


# -- one rank --------------------------------------------------------------------------------------
def init_rank(rank: int, P: int, port: Optional[int], *, gpu: bool = False, ngpu: int = 0,
              group: str = "gloo", timeout: float = 300.0, threads: int = 1,
              bind_device: bool = False):
    """This process as rank ``rank`` of ``P``: on a GPU (``gpu``) its :func:`placement` (its
    environment set first), else the CPU with ``threads`` intra-op threads; then the ``group``
    process group (gloo or nccl) on ``tcp://127.0.0.1:port``, or on torchrun's environment when
    ``port`` is None (``bind_device``: the NCCL group binds the rank's GPU at once). Returns
    the device."""
    import torch
    import torch.distributed as dist
    if gpu:
        index, env = placement(rank, P, ngpu or torch.cuda.device_count())
        os.environ.update(env)
        dev = torch.device("cuda", index)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(max(1, int(threads)))
    kw: Dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout)}
    if port is not None:
        kw.update(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P)
    if bind_device and group == "nccl":
        kw["device_id"] = dev
    dist.init_process_group(group, **kw)
    return dev


def make_comm(kind: str, device, timeout: Optional[float] = None):
    """The communicator of this rank on the default group: ``torch`` (TorchCommunicator, on
    ``device``) or ``cupy`` (NcclCommunicator on ``device``)."""
    if kind == "cupy":
        from ..comm.nccl import NcclCommunicator
        kw = {} if timeout is None else {"timeout": timeout}
        return NcclCommunicator.from_torch_distributed(device=device, **kw)
    from ..comm.torch_dist import TorchCommunicator
    comm = TorchCommunicator(timeout=timeout)
    comm.device = device
    return comm


# -- processes -------------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def environ(changes: Dict[str, Optional[str]]) -> Iterator[None]:
    """Set the environment variables in ``changes`` (``None``: unset) for the block, e.g. while
    spawned children start and read them; restore the previous values afterwards."""
    saved = {k: os.environ.get(k) for k in changes}
    try:
        _apply(changes)
        yield
    finally:
        _apply(saved)


def _apply(values: Dict[str, Optional[str]]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def run_group(cmd: List[str], env: Optional[Dict[str, str]] = None,
              timeout: Optional[float] = None) -> int:
    """Run ``cmd`` (torchrun and the ranks it starts) in a process group of its own and wait:
    its exit status, or ``subprocess.TimeoutExpired`` after ``timeout`` seconds. However the wait
    ends (done, timed out, Ctrl-C, a SIGTERM to this process, an exception) every process left
    in the group is ended (:func:`kill_group`), so no rank outlives its launcher. (Killing
    torchrun alone, as ``subprocess.run``'s timeout does, left its 4 ranks running.)"""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    previous = _sigterm_raises()
    try:
        return proc.wait(timeout=timeout)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        kill_group(proc.pid)


def _sigterm_raises():
    """In the main thread: make SIGTERM raise ``SystemExit(143)`` (so ``finally`` blocks run)
    and return the handler it replaced; elsewhere ``None`` (only the main thread may set one)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):  # noqa: ARG001
        raise SystemExit(128 + signum)
    return signal.signal(signal.SIGTERM, handler)


def kill_group(pgid: int, grace: float = 5.0) -> None:
    """SIGTERM to every process of group ``pgid``, SIGKILL to what is left after ``grace``
    seconds; returns once the group is empty (or after a second grace period)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.waitpid(-pgid, os.WNOHANG)     # reap our own child, if it is in the group
            except ChildProcessError:
                pass
            if not _group_alive(pgid):
                return
            time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is still running (zombies do not count)."""
    for pid in (d for d in os.listdir("/proc") if d.isdigit()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def exit_rank(q: Any, code: int) -> NoReturn:
    """End a rank process: flush its message queue and stdio, then ``os._exit(code)``, skipping
    the process-group teardown, which can block on a dead peer."""
    try:
        q.close()
        q.join_thread()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class _Environment:
    """The caller's environment for a forked rank, put in place while the rank unpickles its
    arguments: it comes first, so it is in place before the target's modules are imported (they
    may read it at import, as the kernels read ``TRITON_INTERPRET``)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)

    def __reduce__(self):
        return _put_environment, (self.env,)


def _put_environment(env: Dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)


def _entry(_env: None, rank: int, P: int, port: int, target: Callable, args: tuple, q) -> None:
    """One rank process: ``target`` with a ``send`` for its messages; its return value or its
    exception is the last message. (``_env`` is ``None`` once unpickled: :class:`_Environment`.)"""
    code = 0

    def send(kind: str, payload: Any = None) -> None:
        q.put((rank, kind, payload))

    try:
        send("done", target(rank, P, port, send, *args))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        code = 1
        try:
            send("fatal", (type(exc).__name__, traceback.format_exc()))
        except Exception:  # noqa: BLE001
            pass
    finally:
        exit_rank(q, code)


class Ranks:
    """P rank processes of ``target`` (see the module doc), started with ``env`` set around the
    spawning (the children read it when they import torch); stop them with :meth:`stop`.
    ``start_method="forkserver"`` forks them from a server that imported torch once (started
    with the ``env`` of the first call: torch read it then); each rank takes the caller's
    environment of the moment before it runs ``target``."""

    def __init__(self, P: int, target: Callable, args: tuple = (), *, name: str = "rank",
                 env: Optional[Dict[str, Optional[str]]] = None,
                 start_method: str = "spawn") -> None:
        import torch.multiprocessing as mp
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            ctx.set_forkserver_preload(["torch"])
        self.P, self.q = P, ctx.Queue()
        self.port = free_port()
        self.finished = [False] * P      # the rank sent its last message, or died
        self.procs: List[Any] = []
        with environ(env or {}):
            env_now = _Environment(os.environ) if start_method == "forkserver" else None
            for r in range(P):
                p = ctx.Process(target=_entry, args=(env_now, r, P, self.port, target, args,
                                                     self.q),
                                name=f"{name}{r}", daemon=True)
                try:
                    p.start()
                except BaseException:
                    self.stop(0.0)          # e.g. target or args not picklable
                    raise
                self.procs.append(p)

    def get(self, deadline: float, poll: float = 0.5) -> Tuple[Optional[int], str, Any]:
        """The next ``(rank, kind, payload)``; ``(rank, "died", text)`` for a rank that exited
        without a last message (what it sent before exiting comes first), ``(None, "timeout",
        None)`` once ``time.monotonic()`` passes ``deadline``."""
        while True:
            try:
                return self._take(self.q.get(timeout=poll))
            except _queue.Empty:
                pass
            dead = [r for r, p in enumerate(self.procs)
                    if not self.finished[r] and p.exitcode is not None]
            if dead:
                try:
                    return self._take(self.q.get(timeout=1.0))
                except _queue.Empty:
                    r = dead[0]
                    self.finished[r] = True
                    return r, "died", (f"rank {r} exited with code {self.procs[r].exitcode} "
                                       f"without reporting")
            if time.monotonic() > deadline:
                return None, "timeout", None

    def _take(self, item):
        if item[1] in ("done", "fatal"):
            self.finished[item[0]] = True
        return item

    def pending(self) -> List[int]:
        return [r for r in range(self.P) if not self.finished[r]]

    def drain(self, seconds: float) -> List[Tuple[int, str, Any]]:
        """Messages already on the way (up to ``seconds``), e.g. after a failure."""
        out, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                out.append(self._take(self.q.get(timeout=min(0.5, seconds))))
            except _queue.Empty:
                break
        return out

    def stop(self, wait: float = 5.0) -> None:
        """Join the processes for ``wait`` seconds, kill what is left, close the queue."""
        for p in self.procs:
            p.join(timeout=wait)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        self.q.close()
        try:
            self.q.join_thread()
        except Exception:  # noqa: BLE001
            pass

"""NcclCommunicator without a GPU: a fake ``cupy`` in ``sys.modules`` records what cupy's
``NcclCommunicator`` received, for both forms of the NCCL unique id (cupy >= 14: ``bytes``; older
cupy: a tuple of 128 signed chars), and plays a lost peer for the watchdog
(``check_async_error`` raising, a primitive that never completes)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import types

import pytest
import torch

from distutil import run_gloo
from oktopk_triton.comm import CommAborted, CommTimeout
from oktopk_triton.comm import nccl as nccl_mod
from oktopk_triton.comm.nccl import NcclCommunicator, unique_id_bytes


# ---------------------------------------------------------------------------------------------
# the fake cupy (module level: also installed in gloo child processes)
# ---------------------------------------------------------------------------------------------
class FakeNcclError(RuntimeError):
    pass


def make_fake_cupy(form: str) -> types.ModuleType:
    """A ``cupy`` with ``cupy.cuda.nccl`` whose unique id and ``NcclCommunicator`` behave like
    cupy's: ``form="bytes"`` (cupy 14: ``get_unique_id()`` gives bytes, the constructor wants
    bytes) or ``"tuple"`` (older cupy on x86: a tuple of 128 signed chars, and a tuple wanted,
    each element converted to a C char). ``nccl.constructed`` lists what constructors got."""
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.constructed = []
    nccl.generated = []
    nccl.form = form

    def get_unique_id():
        raw = os.urandom(128)
        uid = raw if form == "bytes" else tuple(b - 256 if b > 127 else b for b in raw)
        nccl.generated.append(uid)
        return uid

    class NcclCommunicator:
        def __init__(self, ndev, commId, rank):
            want = bytes if form == "bytes" else tuple
            if not isinstance(commId, want):  # Cython's argument type check
                raise TypeError(f"Argument 'commId' has incorrect type (expected "
                                f"{want.__name__}, got {type(commId).__name__})")
            assert len(commId) == 128
            if form == "tuple":
                for v in commId:  # assignment to a (signed) C char
                    if not -128 <= v <= 127:
                        raise OverflowError("value too large to convert to char")
            self.args = (ndev, commId, rank)
            self.aborted = False
            self.destroyed = False
            self.async_error = None
            self.async_checks = 0
            nccl.constructed.append(self)

        def check_async_error(self):
            self.async_checks += 1
            if self.async_error is not None:
                raise FakeNcclError(self.async_error)

        def abort(self):
            self.aborted = True

        def destroy(self):
            self.destroyed = True

    nccl.get_unique_id = get_unique_id
    nccl.NcclCommunicator = NcclCommunicator
    nccl.NcclError = FakeNcclError
    nccl.get_version = lambda: 22809
    cuda = types.ModuleType("cupy.cuda")
    cuda.nccl = nccl

    class Device:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    cuda.Device = Device
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda
    cupy.__version__ = "14.2.0" if form == "bytes" else "13.6.0"
    return cupy


def install_fake_cupy(form: str, modules=None) -> types.ModuleType:
    cupy = make_fake_cupy(form)
    modules = sys.modules if modules is None else modules
    modules["cupy"] = cupy
    modules["cupy.cuda"] = cupy.cuda
    modules["cupy.cuda.nccl"] = cupy.cuda.nccl
    return cupy.cuda.nccl


@pytest.fixture(params=["bytes", "tuple"])
def fake_nccl(request, monkeypatch):
    nccl = make_fake_cupy(request.param)
    monkeypatch.setitem(sys.modules, "cupy", nccl)
    monkeypatch.setitem(sys.modules, "cupy.cuda", nccl.cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", nccl.cuda.nccl)
    return nccl.cuda.nccl


# ---------------------------------------------------------------------------------------------
# the unique id, in both forms
# ---------------------------------------------------------------------------------------------
def test_constructs_with_either_cupy_unique_id_form(fake_nccl):
    """Fails on the code before this change with the bytes-form cupy (cupy 14): it turned the
    id into a tuple of ints, which cupy 14 refuses (TypeError: expected bytes, got tuple)."""
    uid = NcclCommunicator.get_unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128  # the transport form
    comm = NcclCommunicator(1, 4, uid, device="cuda:0", timeout=None)
    (made,) = fake_nccl.constructed
    ndev, got, rank = made.args
    assert (ndev, rank) == (4, 1)
    assert type(got) is (bytes if fake_nccl.form == "bytes" else tuple)
    assert got == fake_nccl.generated[0]  # exactly the id cupy made, in cupy's own form
    assert comm.rank == 1 and comm.world_size == 4 and comm.device == torch.device("cuda", 0)
    # cupy's own form, handed over unchanged, works too
    NcclCommunicator(2, 4, fake_nccl.get_unique_id(), device="cuda:0", timeout=None)
    assert fake_nccl.constructed[1].args[1] == fake_nccl.generated[1]
    comm.close()
    assert made.destroyed


def test_unique_id_bytes_round_trips_signed_and_unsigned_chars():
    raw = bytes(range(128))[::-1]
    signed = tuple(b - 256 if b > 127 else b for b in raw)
    assert unique_id_bytes(raw) == raw
    assert unique_id_bytes(signed) == raw
    assert unique_id_bytes(list(raw)) == raw  # unsigned chars (ARM)
    assert nccl_mod._unique_id_forms(raw)[0] == raw
    assert set(nccl_mod._unique_id_forms(raw)[1:]) == {signed, tuple(raw)}
    with pytest.raises(ValueError):
        unique_id_bytes(b"\0" * 127)
    with pytest.raises(ValueError):
        unique_id_bytes((300,) + (0,) * 127)


def test_unsigned_char_cupy_gets_the_unsigned_tuple(monkeypatch):
    """A cupy built where char is unsigned (ARM) refuses negative values: the next form goes."""
    nccl = install_fake_cupy("tuple", modules={})
    seen = []

    class Unsigned(nccl.NcclCommunicator):
        def __init__(self, ndev, commId, rank):
            seen.append(commId)
            if isinstance(commId, tuple) and any(v < 0 for v in commId):
                raise OverflowError("can't convert negative value to char")
            if isinstance(commId, tuple):
                commId = tuple(v - 256 if v > 127 else v for v in commId)
            super().__init__(ndev, commId, rank)

    nccl.NcclCommunicator = Unsigned
    raw = bytes(range(256))[:128][::-1]
    made = nccl_mod._new_nccl_comm(nccl, 2, raw, 0)
    assert made.args[0] == 2
    assert seen[-1] == tuple(raw)  # the unsigned form was the one accepted


def _fake_from_torch_distributed(comm):
    """In a gloo child: build the communicator through the gloo group with each fake cupy."""
    out = {}
    for form in ("bytes", "tuple"):
        nccl = install_fake_cupy(form)
        c = NcclCommunicator.from_torch_distributed(device="cuda:0", timeout=None)
        (made,) = nccl.constructed
        out[form] = {"received": made.args, "generated": list(nccl.generated),
                     "peers": c.peers, "rank": c.rank, "pid": os.getpid()}
    return out


def test_from_torch_distributed_exchanges_the_id_in_both_forms():
    res = run_gloo(2, _fake_from_torch_distributed, timeout=120)
    for form, want in (("bytes", bytes), ("tuple", tuple)):
        made0, made1 = res[0][form], res[1][form]
        assert len(made0["generated"]) == 1 and made1["generated"] == []  # only rank 0 makes it
        uid = made0["generated"][0]
        for r, m in enumerate((made0, made1)):
            ndev, got, rank = m["received"]
            assert (ndev, rank) == (2, r)
            assert type(got) is want and got == uid
            assert m["peers"] == {0: (socket.gethostname(), res[0][form]["pid"]),
                                  1: (socket.gethostname(), res[1][form]["pid"])}


# ---------------------------------------------------------------------------------------------
# the watchdog: a lost peer raises within the timeout, never hangs
# ---------------------------------------------------------------------------------------------
def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # reaped: the pid no longer exists
    return p.pid


def _wait_for(pred, limit=5.0):
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return False


def test_watchdog_async_error_aborts_and_names_the_lost_peer(fake_nccl):
    host = socket.gethostname()
    dead = _dead_pid()
    peers = [(host, os.getpid()), (host, dead), (host, os.getpid())]
    comm = NcclCommunicator(0, 3, NcclCommunicator.get_unique_id(), device="cuda:0",
                            timeout=30.0, peers=peers, poll_interval=0.01)
    made = fake_nccl.constructed[-1]
    assert comm._watchdog is not None and comm._watchdog.is_alive()
    assert _wait_for(lambda: made.async_checks >= 2)  # it polls while all is well
    assert comm._failure is None and not made.aborted
    t0 = time.monotonic()
    made.async_error = "ncclRemoteError: remote process exited or there was a network error"
    assert _wait_for(lambda: comm._failure is not None, 3.0)
    assert time.monotonic() - t0 < 2.0
    assert made.aborted  # the NCCL communicator was aborted: kernels stuck on the GPU return
    comm._watchdog.join(2.0)
    assert not comm._watchdog.is_alive()
    for call in (lambda: comm.allreduce(torch.ones(2)), comm.barrier, comm.check,
                 lambda: comm.send_recv([(1, torch.ones(1))], [])):
        with pytest.raises(CommAborted) as info:
            call()
        msg = str(info.value)
        assert f"rank 1 (pid {dead} on host {host})" in msg and "no longer running" in msg
        assert "ncclRemoteError" in msg
    assert comm._failure.lost_ranks == [1]


class _NeverDone:
    def query(self):
        return False


class _Done:
    def query(self):
        return True


def test_watchdog_times_out_a_primitive_that_never_completes(fake_nccl):
    host = socket.gethostname()
    comm = NcclCommunicator(1, 2, NcclCommunicator.get_unique_id(), device="cuda:0",
                            timeout=0.3, peers=[(host, os.getpid())] * 2, poll_interval=0.01)
    made = fake_nccl.constructed[-1]
    done = _Done()
    comm._pending.append((time.monotonic(), "allgather", done))
    assert _wait_for(lambda: not comm._pending)  # completed primitives are dropped ...
    assert list(comm._spare_events) == [done]    # ... and their events reused
    t0 = time.monotonic()
    comm._pending.append((t0, "allreduce", _NeverDone()))
    assert _wait_for(lambda: comm._failure is not None, 5.0)
    waited = time.monotonic() - t0
    assert 0.3 <= waited < 2.5, waited
    assert made.aborted
    with pytest.raises(CommTimeout, match=r"allreduce not completed after 0.3s"):
        comm.allreduce(torch.ones(1))
    assert "every peer process on this host is still running" in str(comm._failure)


def test_check_async_error_raises_comm_aborted_without_watchdog(fake_nccl):
    comm = NcclCommunicator(0, 2, NcclCommunicator.get_unique_id(), device="cuda:0",
                            timeout=None)
    assert comm._watchdog is None
    made = fake_nccl.constructed[-1]
    comm.check_async_error()  # fine
    made.async_error = "ncclSystemError"
    with pytest.raises(CommAborted, match="ncclSystemError") as info:
        comm.check_async_error()
    assert "peers unknown" in str(info.value)
    assert made.aborted
    with pytest.raises(CommAborted):
        comm.allreduce(torch.ones(1))


def test_dropped_communicator_ends_its_watchdog(fake_nccl):
    comm = NcclCommunicator(0, 2, NcclCommunicator.get_unique_id(), device="cuda:0",
                            timeout=10.0, poll_interval=0.01)
    thread = comm._watchdog
    del comm
    import gc
    gc.collect()
    thread.join(2.0)
    assert not thread.is_alive()


# ---------------------------------------------------------------------------------------------
# packaging
# ---------------------------------------------------------------------------------------------
def test_cuda_extras_name_the_cupy_wheels():
    tomllib = pytest.importorskip("tomllib")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    names = {k: [d.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip()
                 for d in v] for k, v in extras.items()}
    assert "cupy-cuda12x" in names["cuda12"] and "nvidia-nccl-cu12" in names["cuda12"]
    assert "cupy-cuda13x" in names["cuda13"] and "nvidia-nccl-cu13" in names["cuda13"]
    assert not any(n.startswith("cupy") for n in names["cuda12"] if n != "cupy-cuda12x")
    assert not any(n.startswith("cupy") for n in names["cuda13"] if n != "cupy-cuda13x")


# ---------------------------------------------------------------------------------------------
# CUDA graphs: the watchdog makes no CUDA call while a capture is open
# ---------------------------------------------------------------------------------------------
class _LoggedEvent:
    """A fake CUDA event: ``query()`` logs when it was called (never done, or done on demand);
    ``slow`` seconds per query play a poll in progress."""

    def __init__(self, slow: float = 0.0):
        self.calls = []
        self.done = False
        self.slow = slow

    def query(self):
        t = time.monotonic()
        if self.slow:
            time.sleep(self.slow)
        self.calls.append((t, time.monotonic()))
        return self.done


def test_watchdog_makes_no_cuda_call_while_a_capture_is_open(fake_nccl):
    comm = NcclCommunicator(0, 2, NcclCommunicator.get_unique_id(), device="cuda:0",
                            timeout=60.0, poll_interval=0.01)
    made = fake_nccl.constructed[-1]
    ev = _LoggedEvent()
    comm._pending.append((time.monotonic(), "allreduce", ev))
    assert _wait_for(lambda: len(ev.calls) >= 2)            # polling before the capture
    with comm.capture_guard():
        t_open = time.monotonic()
        checks = made.async_checks
        time.sleep(0.3)                                      # 30 poll periods
        assert made.async_checks == checks                   # not even NCCL's error query
        t_close = time.monotonic()
    assert not [c for c in ev.calls if c[1] > t_open and c[0] < t_close]
    n = len(ev.calls)
    assert _wait_for(lambda: len(ev.calls) > n + 1)          # it resumes after the capture
    assert made.async_checks > checks
    ev.done = True
    assert _wait_for(lambda: not comm._pending)
    assert comm._failure is None
    comm.close()


def test_capture_guard_waits_for_the_poll_in_progress(fake_nccl):
    comm = NcclCommunicator(0, 2, NcclCommunicator.get_unique_id(), device="cuda:0",
                            timeout=60.0, poll_interval=0.01)
    ev = _LoggedEvent(slow=0.2)
    comm._pending.append((time.monotonic(), "alltoall", ev))
    assert _wait_for(lambda: len(ev.calls) >= 1)
    time.sleep(0.05)                                  # most likely inside a 0.2 s query now
    with comm.capture_guard():
        t_open = time.monotonic()
        time.sleep(0.3)
        t_close = time.monotonic()
    # every query ended before the capture opened or began after it closed
    assert all(end <= t_open or start >= t_close for start, end in ev.calls), ev.calls
    comm.close()


def test_paused_time_does_not_count_toward_the_timeout(fake_nccl):
    comm = NcclCommunicator(1, 2, NcclCommunicator.get_unique_id(), device="cuda:0",
                            timeout=1.0, poll_interval=0.01)
    with comm.capture_guard():
        comm._pending.append((time.monotonic(), "send_recv", _NeverDone()))
        time.sleep(1.3)                              # longer than the timeout, all paused
    t_close = time.monotonic()
    time.sleep(0.05)
    assert comm._failure is None or time.monotonic() - t_close > 1.0   # (a descheduled host)
    assert _wait_for(lambda: comm._failure is not None, 5.0)   # then it times out as before
    assert time.monotonic() - t_close >= 0.95
    with pytest.raises(CommTimeout, match="send_recv not completed after 1s"):
        comm.check()


def test_replays_are_tracked_and_captures_are_not(fake_nccl, monkeypatch):
    comm = NcclCommunicator(0, 2, NcclCommunicator.get_unique_id(), device="cuda:0",
                            timeout=60.0, poll_interval=10.0)
    recorded = []

    class _Event:
        def record(self, stream):
            recorded.append(stream)

        def query(self):
            return False

    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "stream")
    capturing = {"on": True}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["on"])
    comm.track_replay()                 # (as if) inside a capture: its events belong to the graph
    assert not comm._pending
    capturing["on"] = False
    comm.track_replay()
    assert [w for _, w, _ in comm._pending] == ["graph replay"] and recorded == ["stream"]
    comm.close()

"""Communicators: every primitive with known answers and byte counts, on LocalCluster (P = 1, 2,
3, 5, 8) and on gloo TorchCommunicator (2 and 3 processes); failure propagation, timeouts,
bitwise-identical allreduce, dtypes; NCCL through CuPy when a GPU and cupy are present."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from distutil import RemoteError, run_gloo, run_nccl, run_pooled
from oktopk_triton.comm import (CommAborted, CommError, CommTimeout, LocalCluster,
                                LocalCommunicator)
from oktopk_triton.comm.local import SingleCommunicator

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8]


# ---------------------------------------------------------------------------------------------
# shared bodies (module level: also run in gloo child processes)
# ---------------------------------------------------------------------------------------------
def _eq(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert torch.equal(a.cpu(), b.cpu()), \
        f"{what}: got {a.cpu().tolist()} expected {b.cpu().tolist()}"


def check_primitives(comm, dtypes=tuple(DTYPES)):
    """Every primitive with known answers (small integers: exact in every dtype) and its byte
    count. Returns bytes_sent."""
    P, r, dev = comm.world_size, comm.rank, comm.device
    assert 0 <= r < P
    for dt in dtypes:
        es = torch.empty((), dtype=dt).element_size()

        # send_recv: two messages to the next rank (order kept), one to the previous, one to self
        nxt, prv = (r + 1) % P, (r - 1) % P
        a = torch.full((3,), r + 1, dtype=dt, device=dev)
        b = torch.full((5,), r + 100, dtype=dt, device=dev)
        c = torch.arange(4, dtype=dt, device=dev) + r
        s = torch.full((2,), 7, dtype=dt, device=dev)
        ra, rb = torch.zeros(3, dtype=dt, device=dev), torch.zeros(5, dtype=dt, device=dev)
        rc, rs = torch.zeros(4, dtype=dt, device=dev), torch.zeros(2, dtype=dt, device=dev)
        before = comm.bytes_sent
        comm.send_recv([(nxt, a), (nxt, b), (prv, c), (r, s)],
                       [(prv, ra), (prv, rb), (nxt, rc), (r, rs)])
        _eq(ra, torch.full((3,), prv + 1, dtype=dt), "send_recv a")
        _eq(rb, torch.full((5,), prv + 100, dtype=dt), "send_recv b")
        _eq(rc, torch.arange(4, dtype=dt) + nxt, "send_recv c")
        _eq(rs, torch.full((2,), 7, dtype=dt), "send_recv self")
        expect = 0 if P == 1 else (3 + 5 + 4) * es
        assert comm.bytes_sent - before == expect, \
            ("send_recv bytes", comm.bytes_sent - before, expect)
        # an empty batch and a receive-only/send-only pair across two calls
        comm.send_recv([], [])

        # allgather
        m = 4
        inp = torch.arange(m, dtype=dt, device=dev) + 10 * r
        out = torch.full((P * m,), 255 if dt == torch.uint8 else -1, dtype=dt, device=dev)
        before = comm.bytes_sent
        comm.allgather(out, inp)
        exp = torch.cat([torch.arange(m, dtype=dt) + 10 * q for q in range(P)])
        _eq(out, exp, "allgather")
        assert comm.bytes_sent - before == (P - 1) * m * es
        # 2-D output, in-place style (input is this rank's chunk of the output)
        out2 = torch.zeros((P, m), dtype=dt, device=dev)
        out2[r].copy_(inp)
        comm.allgather(out2, out2[r])
        _eq(out2.reshape(-1), exp, "allgather in place")

        # allreduce (sum in place): rank q contributes (q + 1) * pattern
        n = 37
        pat = torch.arange(n, device=dev) % 3
        t = (pat * (r + 1)).to(dt)
        before = comm.bytes_sent
        comm.allreduce(t)
        _eq(t, (pat.cpu() * (P * (P + 1) // 2)).to(dt), "allreduce")
        assert comm.bytes_sent - before == 2 * (P - 1) * n * es // P
        # non-contiguous tensor
        t2 = torch.ones((6, 4), dtype=dt, device=dev).t()
        comm.allreduce(t2)
        _eq(t2, torch.full((4, 6), P, dtype=dt), "allreduce non-contiguous")

        # alltoall: chunk j of rank src holds (src*P + j)*m + i; rank r's output chunk q then
        # holds (q*P + r)*m + i
        m = 3
        i = torch.arange(m)
        inp = torch.cat([(r * P + j) * m + i for j in range(P)]).to(dt).to(dev)
        out = torch.zeros(P * m, dtype=dt, device=dev)
        before = comm.bytes_sent
        comm.alltoall(out, inp)
        exp = torch.cat([(q * P + r) * m + i for q in range(P)]).to(dt)
        _eq(out, exp, "alltoall")
        assert comm.bytes_sent - before == (P - 1) * (P * m * es) // P

        # broadcast from the last rank and from rank 0
        for root in {P - 1, 0}:
            t = (torch.arange(6, dtype=dt, device=dev) + 1 if r == root
                 else torch.zeros(6, dtype=dt, device=dev))
            before = comm.bytes_sent
            comm.broadcast(t, root=root)
            _eq(t, torch.arange(6, dtype=dt) + 1, f"broadcast root={root}")
            assert comm.bytes_sent - before == (6 * es if (r == root and P > 1) else 0)

        before = comm.bytes_sent
        comm.barrier()
        assert comm.bytes_sent == before
    return comm.bytes_sent


def expected_total_bytes(P: int, r: int, dtypes=tuple(DTYPES)) -> int:
    tot = 0
    for dt in dtypes:
        es = torch.empty((), dtype=dt).element_size()
        if P > 1:
            tot += 12 * es                       # send_recv
        tot += (P - 1) * 4 * es * 2              # two allgathers
        tot += 2 * (P - 1) * 37 * es // P + 2 * (P - 1) * 24 * es // P  # two allreduces
        tot += (P - 1) * (P * 3 * es) // P       # alltoall
        if P > 1:
            tot += sum(6 * es for root in {P - 1, 0} if r == root)
    return tot


def random_allreduce(comm, n, seed):
    """Allreduce of random fp32 data; returns the result (compared bitwise across ranks)."""
    g = torch.Generator().manual_seed(seed + comm.rank)
    t = (torch.randn(n, generator=g)
         * 10 ** torch.randint(-3, 4, (n,), generator=g)).to(comm.device)
    comm.allreduce(t)
    return t


def gloo_all_checks(comm):
    from oktopk_triton.comm import TorchCommunicator, default_communicator
    d = default_communicator(torch.device("cpu"))
    assert type(d) is TorchCommunicator and d.world_size == comm.world_size
    assert d.rank == comm.rank and d.device == torch.device("cpu")
    total = check_primitives(comm)
    res = random_allreduce(comm, 100_003, 1234)
    # a large-ish allgather + alltoall
    P = comm.world_size
    x = torch.arange(60_000, dtype=torch.float32) + comm.rank
    out = torch.empty(P * 60_000)
    comm.allgather(out, x)
    assert torch.equal(out.view(P, -1)[P - 1], torch.arange(60_000, dtype=torch.float32) + P - 1)
    return total, res


def gloo_failure_body(comm, outdir):
    """Rank 1 raises after a short delay; the others block in a collective and must get an error
    quickly. They record what they saw in a file, then re-raise."""
    if comm.rank == 1:
        time.sleep(0.5)
        raise ValueError("boom on rank 1")
    t0 = time.monotonic()
    try:
        for _ in range(3):
            comm.allreduce(torch.ones(1000))
        comm.barrier()
    except Exception as exc:  # noqa: BLE001
        with open(os.path.join(outdir, f"rank{comm.rank}.txt"), "w") as f:
            f.write(f"{type(exc).__name__}\n{time.monotonic() - t0}\n{exc}\n")
        raise
    with open(os.path.join(outdir, f"rank{comm.rank}.txt"), "w") as f:
        f.write("no error\n")


# ---------------------------------------------------------------------------------------------
# LocalCluster
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("P", [1, 2, 3, 5, 8])
def test_local_primitives(P):
    totals = LocalCluster(P, timeout=30).run(check_primitives)
    assert totals == [expected_total_bytes(P, r) for r in range(P)]


def test_local_comm_attributes():
    def fn(comm):
        return comm.rank, comm.world_size, comm.device, type(comm), comm.bytes_sent
    res = LocalCluster(3).run(fn)
    assert [x[0] for x in res] == [0, 1, 2]
    assert all(x[1] == 3 and x[2] == torch.device("cpu") and x[3] is LocalCommunicator
               and x[4] == 0 for x in res)


def test_local_copies_no_aliasing():
    def fn(comm):
        src = torch.full((8,), float(comm.rank))
        out = torch.empty(8 * comm.world_size)
        comm.allgather(out, src)
        recv = torch.empty(8)
        peer = 1 - comm.rank
        comm.send_recv([(peer, src)], [(peer, recv)])
        src.fill_(-5.0)  # mutate after the calls: peers' results must not change
        comm.barrier()
        return out, recv
    res = LocalCluster(2).run(fn)
    for r, (out, recv) in enumerate(res):
        assert torch.equal(out, torch.tensor([0.0] * 8 + [1.0] * 8))
        assert torch.equal(recv, torch.full((8,), float(1 - r)))


@pytest.mark.parametrize("P", [3, 8])
def test_local_allreduce_bitwise_identical(P):
    res = LocalCluster(P).run(random_allreduce, 200_001, 7)
    # the reference: summed in rank order
    ref = torch.zeros(200_001)
    for r in range(P):
        g = torch.Generator().manual_seed(7 + r)
        noise = torch.randn(200_001, generator=g) * 10 ** torch.randint(-3, 4, (200_001,),
                                                                          generator=g)
        ref = noise if r == 0 else ref + noise
    for t in res:
        assert torch.equal(t, res[0])
    assert torch.equal(res[0], ref)


def test_local_large_fast():
    n = 1 << 20
    P = 8

    def fn(comm):
        t = torch.full((n,), float(comm.rank))
        comm.allreduce(t)
        o = torch.empty(n)
        comm.alltoall(o, t)
        g = torch.empty(P * (n // P))
        comm.allgather(g, t[: n // P])
        return t[0].item(), o[-1].item(), comm.bytes_sent
    t0 = time.monotonic()
    res = LocalCluster(P).run(fn)
    assert time.monotonic() - t0 < 20
    b = 4 * n
    assert res[0] == (28.0, 28.0, 2 * (P - 1) * b // P + (P - 1) * b // P + (P - 1) * b // P)


def test_local_failure_propagates_quickly():
    seen = {}
    lock = threading.Lock()

    def fn(comm):
        if comm.rank == 1:
            time.sleep(0.2)
            raise ValueError("boom")
        try:
            comm.barrier()  # rank 1 never arrives
            comm.allreduce(torch.ones(10))
        except CommAborted as exc:
            with lock:
                seen[comm.rank] = exc
            raise
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="boom") as info:
        LocalCluster(4, timeout=30).run(fn)
    elapsed = time.monotonic() - t0
    assert elapsed < 3.0, elapsed
    assert sorted(seen) == [0, 2, 3]
    notes = " ".join(getattr(info.value, "__notes__", [])) + str(info.value)
    assert "rank 1" in notes
    assert threading.active_count() == 1 or not any(
        t.name.startswith("LocalCluster-rank") for t in threading.enumerate())


def test_local_failure_next_call_raises():
    def fn(comm):
        if comm.rank == 0:
            raise KeyError("first")
        time.sleep(0.3)
        with pytest.raises(CommAborted):
            comm.send_recv([(0, torch.ones(2))], [])
        with pytest.raises(CommAborted):
            comm.barrier()
        return "ok"
    with pytest.raises(KeyError):
        LocalCluster(3, timeout=30).run(fn)


def test_local_timeout():
    def fn(comm):
        if comm.rank == 2:
            time.sleep(1.5)  # arrives too late
            return None
        comm.barrier()
    t0 = time.monotonic()
    with pytest.raises(CommTimeout):
        LocalCluster(3, timeout=0.5).run(fn)
    assert time.monotonic() - t0 < 5


def test_local_run_waits_while_ranks_communicate_and_not_for_a_silent_one():
    """run() gives up on a rank only after 2·timeout + GRACE seconds with no collective done: a
    run three times that long that keeps communicating finishes (a 320-step training at 64
    ranks was cut off at a fixed bound); ranks that go silent in their own code are given up
    on (CommTimeout, "did not finish")."""
    def busy(comm):
        for _ in range(12):
            time.sleep(0.1)
            comm.barrier()
        return comm.rank

    def silent(comm):
        time.sleep(4.0)

    cluster = LocalCluster(2, timeout=0.1)
    cluster.GRACE = 0.2                         # bound: 0.4 s of silence; busy runs 1.2 s
    assert cluster.run(busy) == [0, 1]
    t0 = time.monotonic()
    with pytest.raises(CommTimeout, match="did not finish"):
        cluster.run(silent)
    assert time.monotonic() - t0 < 3.5


def test_local_timeout_recv_and_peer_returned():
    def fn(comm):
        if comm.rank == 0:
            comm.send_recv([], [(1, torch.empty(3))])  # rank 1 returns without sending
    t0 = time.monotonic()
    with pytest.raises(CommTimeout):
        LocalCluster(2, timeout=30).run(fn)
    assert time.monotonic() - t0 < 3  # a peer that already returned cannot arrive: no wait


def test_local_mismatch():
    def fn(comm):
        if comm.rank == 0:
            comm.allreduce(torch.ones(4))
        else:
            comm.barrier()
    with pytest.raises(CommError):
        LocalCluster(2, timeout=10).run(fn)


def test_local_recv_size_mismatch():
    def fn(comm):
        if comm.rank == 0:
            comm.send_recv([(1, torch.ones(4))], [])
        else:
            comm.send_recv([], [(0, torch.ones(5))])
    with pytest.raises(CommError):
        LocalCluster(2, timeout=10).run(fn)


def test_local_cluster_reusable():
    cl = LocalCluster(3)
    with pytest.raises(ZeroDivisionError):
        cl.run(lambda comm: 1 / 0 if comm.rank == 2 else comm.barrier())
    assert cl.run(lambda comm: comm.rank * 2) == [0, 2, 4]


def test_single_communicator():
    comm = SingleCommunicator()
    assert (comm.rank, comm.world_size, comm.device) == (0, 1, torch.device("cpu"))
    assert check_primitives(comm) == 0


def test_default_communicator_single():
    from oktopk_triton.comm import default_communicator
    import torch.distributed as dist
    assert not dist.is_initialized()
    comm = default_communicator(torch.device("cpu"))
    assert comm.world_size == 1 and comm.rank == 0
    t = torch.ones(3)
    comm.allreduce(t)
    assert torch.equal(t, torch.ones(3)) and comm.bytes_sent == 0


# ---------------------------------------------------------------------------------------------
# gloo (TorchCommunicator)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("P", [2, 3])
def test_gloo_primitives(P):
    res = run_pooled(P, gloo_all_checks, timeout=120)
    assert [tot for tot, _ in res] == [expected_total_bytes(P, r) for r in range(P)]
    outs = [t for _, t in res]
    for t in outs:
        assert torch.equal(t, outs[0])  # bitwise identical on every rank
    ref = LocalCluster(P).run(random_allreduce, 100_003, 1234)[0]
    torch.testing.assert_close(outs[0], ref, rtol=1e-5, atol=1e-3)


@pytest.mark.slow
def test_gloo_failure_propagates(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RemoteError) as info:
        run_gloo(3, gloo_failure_body, str(tmp_path), timeout=90)
    elapsed = time.monotonic() - t0
    assert info.value.rank == 1 and info.value.exc_type == "ValueError"
    assert "boom on rank 1" in str(info.value)
    for r in (0, 2):
        lines = (tmp_path / f"rank{r}.txt").read_text().splitlines()
        assert lines[0] in ("CommAborted", "CommTimeout", "RuntimeError"), lines
        assert float(lines[1]) < 15.0, lines  # well below the 60 s process-group timeout
    assert elapsed < 60, elapsed


@pytest.mark.slow
def test_run_gloo_reports_dead_process():
    t0 = time.monotonic()
    with pytest.raises(RemoteError) as info:
        run_gloo(2, exit_body, timeout=60)
    assert info.value.rank == 1 and "exited with code 3" in str(info.value)
    assert time.monotonic() - t0 < 60


def pooled_body(comm, mode):
    if comm.rank == 1 and mode == "raise":
        raise ValueError("pooled boom on rank 1")
    if comm.rank == 1 and mode == "exit":
        os._exit(3)
    if mode == "sleep":
        time.sleep(60)
    if mode == "env":
        os.environ["OKTOPK_POOL_PROBE"] = "set"
    t = torch.full((3,), float(comm.rank + 1))
    comm.allreduce(t)
    return t, os.getpid(), os.environ.get("OKTOPK_POOL_PROBE"), torch.rand(4)


@pytest.mark.slow
def test_run_pooled_reuses_ranks_and_replaces_a_broken_pool():
    """The pool behind run_pooled: reused ranks see a fresh process's seed and the environment of
    before the call; a rank that raises, dies or overruns the timeout fails the call (its
    traceback in the message, within the bound) and the next call gets new ranks."""
    a = run_pooled(2, pooled_body, "env")
    b = run_pooled(2, pooled_body, "plain")
    for r in range(2):
        assert torch.equal(a[r][0], torch.full((3,), 3.0)) and torch.equal(b[r][0], a[r][0])
        assert a[r][1] == b[r][1]                   # the same process
        assert a[r][2] == "set" and b[r][2] is None  # the environment put back
        assert torch.equal(a[r][3], b[r][3])        # the same seed every call
    t0 = time.monotonic()
    with pytest.raises(RemoteError) as info:
        run_pooled(2, pooled_body, "raise", timeout=60)
    assert info.value.rank == 1 and info.value.exc_type == "ValueError"
    assert "pooled boom on rank 1" in str(info.value) and "Traceback" in str(info.value)
    c = run_pooled(2, pooled_body, "plain")
    assert {r[1] for r in c}.isdisjoint({r[1] for r in a})    # a new pool
    assert torch.equal(c[0][0], torch.full((3,), 3.0))
    with pytest.raises(RemoteError) as info:
        run_pooled(2, pooled_body, "exit", timeout=60)
    assert info.value.rank == 1 and info.value.exc_type == "ProcessDied"
    run_pooled(2, pooled_body, "plain")                        # warm again
    with pytest.raises(TimeoutError, match="did not finish within 2"):
        run_pooled(2, pooled_body, "sleep", timeout=2)
    assert time.monotonic() - t0 < 150


def exit_body(comm):
    if comm.rank == 1:
        os._exit(3)  # dies without reporting
    comm.barrier()


def killed_mid_step_body(comm, outdir, victim):
    """Ok-Topk steps on every rank; in step 2 the victim SIGKILLs itself after its send/recv batch,
    where the step's allgather begins (mid-step: the others are inside the step's collectives).
    The survivors record what they raised (type, seconds after the kill, message, lost_ranks)."""
    import json
    import signal

    from oktopk_triton.algorithms import get_algorithm
    n = 4096
    alg = get_algorithm("oktopk")(n, comm, 0.01, backend="torch")
    gen = torch.Generator().manual_seed(comm.rank)
    for step in range(5):
        if step == 2 and comm.rank == victim:
            def die(output, input):
                with open(os.path.join(outdir, "killed_at"), "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            comm.allgather = die
        try:
            alg(torch.randn(n, generator=gen))
        except Exception as exc:  # noqa: BLE001
            rec = {"type": type(exc).__name__, "step": step, "time": time.time(), "msg": str(exc),
                   "lost_ranks": getattr(exc, "lost_ranks", None)}
            with open(os.path.join(outdir, f"rank{comm.rank}.json"), "w") as f:
                json.dump(rec, f)
            raise
    with open(os.path.join(outdir, f"rank{comm.rank}.json"), "w") as f:
        f.write('{"type": null}')


@pytest.mark.slow
def test_gloo_rank_killed_mid_step_names_the_lost_peer(tmp_path):
    """A rank killed with SIGKILL in the middle of an Ok-Topk step: both other ranks raise a
    communicator error naming rank 1 well within the 10 s process-group timeout; no process is
    left (run_gloo reports the dead rank and returns)."""
    with pytest.raises(RemoteError) as info:
        run_gloo(3, killed_mid_step_body, str(tmp_path), 1, timeout=60, pg_timeout=10)
    import json
    import multiprocessing
    killed_at = float((tmp_path / "killed_at").read_text())
    for r in (0, 2):
        rec = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert rec["type"] in ("CommAborted", "CommTimeout", "CommError"), rec
        assert rec["step"] == 2, rec
        assert rec["time"] - killed_at < 5.0, rec
        assert "rank 1 (pid" in rec["msg"] and "no longer running" in rec["msg"], rec["msg"]
        assert 1 in rec["lost_ranks"], rec
    assert not (tmp_path / "rank1.json").exists()
    assert "rank 1" in str(info.value) and "code -9" in str(info.value)
    # no rank of this run left (the pooled ranks of run_pooled stay up between tests)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("run_gloo-rank")]


# ---------------------------------------------------------------------------------------------
# NCCL through CuPy
# ---------------------------------------------------------------------------------------------
def _has_cupy_nccl() -> bool:
    try:
        from cupy.cuda import nccl  # noqa: F401
    except Exception:
        return False
    return True


requires_nccl = pytest.mark.skipif(not (torch.cuda.is_available() and _has_cupy_nccl()),
                                   reason="needs CUDA and cupy with NCCL")


def test_nccl_module_imports_without_cupy():
    from oktopk_triton.comm import NcclCommunicator
    from oktopk_triton.comm.nccl import nccl_dtype
    assert nccl_dtype(torch.bfloat16) == 9 and nccl_dtype(torch.float32) == 7
    if not _has_cupy_nccl():
        with pytest.raises(ImportError):
            NcclCommunicator(0, 1, (0,) * 128, device="cuda:0")


def nccl_all_checks(comm):
    assert comm.device.type == "cuda"
    total = check_primitives(comm)
    res = random_allreduce(comm, 1_000_003, 99)
    # every primitive is enqueued on the current stream: run on a side stream too
    s = torch.cuda.Stream(comm.device)
    s.wait_stream(torch.cuda.current_stream(comm.device))
    with torch.cuda.stream(s):
        t = torch.full((1 << 20,), float(comm.rank + 1), device=comm.device)
        comm.allreduce(t)
        o = torch.empty(comm.world_size << 20, device=comm.device)
        comm.allgather(o, t)
    torch.cuda.current_stream(comm.device).wait_stream(s)
    P = comm.world_size
    assert torch.equal(o, torch.full_like(o, P * (P + 1) / 2))
    return total, res


@requires_nccl
@pytest.mark.gpu
@pytest.mark.parametrize("P", [2, 3, 4])
def test_nccl_primitives(P):
    res = run_nccl(P, nccl_all_checks, timeout=240)
    assert [tot for tot, _ in res] == [expected_total_bytes(P, r) for r in range(P)]
    outs = [t for _, t in res]
    for t in outs:
        assert torch.equal(t, outs[0])
    ref = LocalCluster(P).run(random_allreduce, 1_000_003, 99)[0]
    torch.testing.assert_close(outs[0], ref, rtol=1e-5, atol=1e-3)


def _mismatched_buffers(comm):
    P = comm.world_size
    errors = []
    for call in (lambda: comm.allgather(torch.zeros(P * 4, dtype=torch.int32), torch.zeros(4)),
                 lambda: comm.alltoall(torch.zeros(P * 2, dtype=torch.int64), torch.zeros(P * 2)),
                 lambda: comm.allgather(torch.zeros(P * 4 + 1), torch.zeros(4)),
                 lambda: comm.alltoall(torch.zeros(P * 2 + 1), torch.zeros(P * 2 + 1))):
        try:
            call()
        except (TypeError, ValueError) as e:
            errors.append(type(e).__name__)
    return errors


@pytest.mark.parametrize("P", [2, 3])
def test_mismatched_buffers_raise_clear_errors_on_every_rank(P):
    # validated before any rank communicates, so no rank waits on a peer that gave up
    out = LocalCluster(P, timeout=10).run(_mismatched_buffers)
    assert out == [["TypeError", "TypeError", "ValueError", "ValueError"]] * P


# -- a bare "cuda" names the current device ----------------------------------------------------
def test_resolve_device_pins_bare_cuda(monkeypatch):
    """``cuda`` and ``cuda:0`` are unequal torch devices: a reducer built with device="cuda" once
    refused the gradients made on it ("gradient is on cuda:0, expected cuda", seen on an H100)."""
    from oktopk_triton.comm.base import resolve_device
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert resolve_device("cuda") == torch.device("cuda", 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


def _seen_now(name):
    return os.environ.get(name)


class _ReadAtUnpickling:
    """An argument that reads the variable while the rank unpickles it (as a module imported
    then would: before the target runs)."""

    def __init__(self, name):
        self.name = name

    def __reduce__(self):
        return _seen_now, (self.name,)


def _env_of_rank(rank, P, port, send, name, at_unpickling):
    return at_unpickling, os.environ.get(name)


def _ranks_env(name):
    from oktopk_triton.bench.ranks import Ranks
    ranks = Ranks(2, _env_of_rank, (name, _ReadAtUnpickling(name)), start_method="forkserver")
    try:
        got = [ranks.get(time.monotonic() + 60) for _ in range(2)]
    finally:
        ranks.stop(5.0)
    assert all(kind == "done" for _, kind, _ in got), got
    return [value for _, _, value in got]


def test_forked_ranks_run_in_the_environment_of_the_moment(monkeypatch):
    """Ranks forked from the fork server (started once, with the environment of then) have the
    caller's environment from the moment they unpickle their arguments: a variable set,
    changed or removed since."""
    name = "OKTOPK_TRITON_TEST_RANK_ENV"
    monkeypatch.setenv(name, "first")
    assert _ranks_env(name) == [("first", "first")] * 2
    monkeypatch.setenv(name, "second")
    assert _ranks_env(name) == [("second", "second")] * 2
    monkeypatch.delenv(name)
    assert _ranks_env(name) == [(None, None)] * 2

"""oktopk_triton.modes.graph: a steady step captured once and replayed (CUDA graphs).

On CPU: every algorithm's steady step keeps its state tensors' storage (what a replay needs),
the replay bookkeeping against a stand-in graph that re-runs the step, and the refusals. On
CUDA: the real capture gives the eager step's output bit for bit."""
from __future__ import annotations

import contextlib

import pytest
import torch

from conservation import student_t
from oktopk_triton.algorithms import SPARSE_ALGORITHMS, get_algorithm
from oktopk_triton.comm.local import LocalCluster, SingleCommunicator
from oktopk_triton.modes.graph import GraphedStep

N = 3000


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch):
    """The CPU tests here check capture and replay bookkeeping, which is the same over either
    kernel path: they run the kernels' torch references (the interpreter cost minutes here; the
    interpreted kernels are compared with the references bit for bit in tests/test_kernel_*.py
    and tests/test_oktopk.py). One steady-step case keeps the interpreted kernels."""
    from oktopk_triton.kernels import _dispatch
    monkeypatch.setattr(_dispatch, "INTERPRET", False)


def _state(alg):
    return {k: v for k, v in vars(alg).items() if isinstance(v, torch.Tensor)}


def _storage_body(comm, name):
    alg = get_algorithm(name)(N, comm, 0.02, momentum=0.9)
    grad = student_t(seed=5)
    for t in range(3):
        alg(grad(comm.rank, t, N))
    before = {k: v.data_ptr() for k, v in _state(alg).items()}
    alg(grad(comm.rank, 3, N))
    after = {k: v.data_ptr() for k, v in _state(alg).items()}
    return sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))


@pytest.mark.parametrize("name", ["dense", *SPARSE_ALGORITHMS])
def test_steady_step_updates_state_in_place(name):
    """A captured graph reads and writes fixed addresses: an attribute rebound to a new tensor
    in a steady step (Ok-Topk's thresholds and regions once were) would freeze on replay."""
    for P in (1, 3):
        assert LocalCluster(P).run(_storage_body, name) == [[]] * P


@pytest.mark.skipif(__import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="needs TRITON_INTERPRET=1 (the interpreter runs Triton on CPU tensors)")
def test_steady_step_updates_state_in_place_interpreted(monkeypatch):
    """The same through the interpreted Triton kernels (Ok-Topk, one rank)."""
    from oktopk_triton.kernels import _dispatch
    monkeypatch.setattr(_dispatch, "INTERPRET", True)
    assert LocalCluster(1).run(_storage_body, "oktopk") == [[]]


class _RerunGraph:
    """Stands in for torch.cuda.CUDAGraph: replay() re-runs the captured step in Python."""

    def __init__(self):
        self.run = None

    def replay(self):
        self.run()


def _rerun_capture(get_step):
    """Stands in for torch.cuda.graph: the step inside runs, but the algorithm's state is put
    back afterwards (a capture records kernels without running them); replay re-runs it into the
    static output, leaving the Python counters to GraphedStep as a real replay does."""
    @contextlib.contextmanager
    def capture(graph, **kwargs):
        graph.kwargs = kwargs
        step = get_step()
        alg = step.algorithm
        saved = {k: v.clone() for k, v in _state(alg).items()}
        yield
        for k, v in saved.items():
            getattr(alg, k).copy_(v)

        def run():
            steps, sent = alg.step_count, alg.comm.bytes_sent
            step._out.copy_(alg(step._grad))
            alg.step_count, alg.comm.bytes_sent = steps, sent
        graph.run = run
    return capture


@pytest.mark.parametrize("name", ["oktopk", "spardl", "dense"])
def test_replays_give_the_eager_steps(name):
    grad = student_t(seed=7)
    ref = get_algorithm(name)(N, SingleCommunicator(), 0.02, momentum=0.9)
    alg = get_algorithm(name)(N, SingleCommunicator(), 0.02, momentum=0.9)
    box = {}
    step = GraphedStep(alg, eager_steps=2, graph_factory=_RerunGraph,
                       capture=_rerun_capture(lambda: box["step"]))
    box["step"] = step
    outs = []
    for t in range(7):
        want = ref(grad(0, t, N)).clone()
        got = step(grad(0, t, N))
        assert torch.equal(got, want), t
        assert step.captured == (t >= 2)
        outs.append(got)
    assert outs[3] is outs[6]                       # the static output, every replay
    assert alg.step_count == ref.step_count == 7
    assert torch.equal(alg.residual, ref.residual)


def test_refusals():
    alg = get_algorithm("oktopk")(N, SingleCommunicator(), 0.02)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        GraphedStep(alg)
    with pytest.raises(ValueError, match="eager_steps must be an int >= 1"):
        GraphedStep(alg, eager_steps=0, graph_factory=_RerunGraph)
    with pytest.raises(TypeError, match="expected an Algorithm"):
        GraphedStep(object())

    def threads(comm):
        a = get_algorithm("dense")(N, comm, 1.0)
        with pytest.raises(ValueError, match="cannot be captured"):
            GraphedStep(a, graph_factory=_RerunGraph)
        return True
    assert LocalCluster(2).run(threads) == [True, True]

    box = {}
    step = GraphedStep(alg, eager_steps=1, graph_factory=_RerunGraph,
                       capture=_rerun_capture(lambda: box["step"]))
    box["step"] = step
    g = torch.randn(N)
    with pytest.raises(ValueError, match="loss scale cannot be replayed"):
        step(g, scale=1024.0)
    step(g)
    step(g)                                         # captured
    with pytest.raises(ValueError, match=r"the captured step takes \(3000,\)"):
        step(torch.randn(N).double())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["oktopk", "spardl", "dense"])
def test_cuda_graph_replays_the_eager_step(name):
    n = 1 << 20
    grad = student_t(seed=9)
    ref = get_algorithm(name)(n, SingleCommunicator("cuda"), 0.01, momentum=0.9)
    alg = get_algorithm(name)(n, SingleCommunicator("cuda"), 0.01, momentum=0.9)
    step = GraphedStep(alg)
    for t in range(8):
        g = grad(0, t, n).cuda()
        want = ref(g).clone()
        got = step(g)
        assert torch.equal(got, want), t
    assert step.captured and alg.step_count == 8
    assert torch.equal(alg.residual, ref.residual)


# -- SparseAllreduce(cuda_graph=True) -------------------------------------------------------------
class _RerunGraphed(GraphedStep):
    """GraphedStep with the stand-ins above, as SparseAllreduce builds it."""

    def __init__(self, algorithm, **kwargs):
        super().__init__(algorithm, eager_steps=2, graph_factory=_RerunGraph,
                         capture=_rerun_capture(lambda: self))


def _model(seed, device="cpu"):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.ReLU(),
                               torch.nn.Linear(30, 5)).to(device)


def _train(sar, model, steps, device="cpu"):
    outs = []
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randn(16, 20, generator=g).to(device)
        model.zero_grad()
        model(x).square().mean().backward()
        sar.reduce_gradients()
        outs.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
    return outs


def test_sparse_allreduce_cuda_graph_option(monkeypatch):
    from oktopk_triton import module
    from oktopk_triton.module import SparseAllreduce
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        SparseAllreduce(_model(0).parameters(), cuda_graph=True)
    with pytest.raises(ValueError, match="cannot follow a density_schedule"):
        SparseAllreduce(_model(0).parameters(), cuda_graph=True,
                        density_schedule={"ramp_steps": 10})
    with pytest.raises(TypeError, match="cuda_graph must be True or False"):
        SparseAllreduce(_model(0).parameters(), cuda_graph="yes")

    monkeypatch.setattr(module, "GraphedStep", _RerunGraphed)
    ma, mb = _model(1), _model(1)
    eager = SparseAllreduce(ma.parameters(), density=0.05, momentum=0.9)
    graphed = SparseAllreduce(mb.parameters(), density=0.05, momentum=0.9, cuda_graph=True)
    for a, b in zip(_train(eager, ma, 6), _train(graphed, mb, 6)):
        assert torch.equal(a, b)
    assert graphed.parts.graph.captured
    graphed.set_extra_state(eager.get_extra_state())      # a resume drops the graph
    assert not graphed.parts.graph.captured
    for a, b in zip(_train(eager, ma, 4), _train(graphed, mb, 4)):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sparse_allreduce_graph_matches_eager():
    from oktopk_triton.module import SparseAllreduce
    ma, mb = _model(2, "cuda"), _model(2, "cuda")
    eager = SparseAllreduce(ma.parameters(), density=0.05, momentum=0.9)
    graphed = SparseAllreduce(mb.parameters(), density=0.05, momentum=0.9, cuda_graph=True)
    for a, b in zip(_train(eager, ma, 8, "cuda"), _train(graphed, mb, 8, "cuda")):
        assert torch.equal(a, b)
    assert graphed.parts.graph.captured


# -- across ranks: the communicator's guard, the capture mode, replays tracked --------------------
class _GuardedComm(SingleCommunicator):
    """A one-rank communicator that logs its capture guard and the replays it is told of."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    @contextlib.contextmanager
    def capture_guard(self):
        self.log.append("guard on")
        yield
        self.log.append("guard off")

    def track_replay(self):
        self.log.append("replay tracked")


def test_capture_runs_inside_the_guard_in_thread_local_mode():
    log = []
    alg = get_algorithm("oktopk")(N, _GuardedComm(log), 0.02)
    ref = get_algorithm("oktopk")(N, SingleCommunicator(), 0.02)
    box = {}
    inner = _rerun_capture(lambda: box["step"])

    @contextlib.contextmanager
    def capture(graph, **kwargs):
        log.append(("capture", kwargs))
        with inner(graph, **kwargs):
            yield
        log.append("capture end")

    step = GraphedStep(alg, eager_steps=1, graph_factory=_RerunGraph, capture=capture)
    box["step"] = step
    grad = student_t(seed=3)
    for t in range(4):
        want = ref(grad(0, t, N)).clone()
        assert torch.equal(step(grad(0, t, N)), want)
    assert log == ["guard on", ("capture", {"capture_error_mode": "thread_local"}),
                   "capture end", "guard off"] + ["replay tracked"] * 3
    assert alg.step_count == ref.step_count == 4
    assert alg.comm.collectives_issued == ref.comm.collectives_issued


def test_replays_advance_every_python_counter():
    alg = get_algorithm("oktopk")(N, SingleCommunicator(), 0.02)
    box = {}
    step = GraphedStep(alg, eager_steps=2, graph_factory=_RerunGraph,
                       capture=_rerun_capture(lambda: box["step"]))
    box["step"] = step
    ref = get_algorithm("oktopk")(N, SingleCommunicator(), 0.02)
    grad = student_t(seed=8)
    for t in range(6):
        step(grad(0, t, N))
        ref(grad(0, t, N))
        assert (alg.step_count, alg.comm.bytes_sent, alg.comm.collectives_issued) == \
            (ref.step_count, ref.comm.bytes_sent, ref.comm.collectives_issued), t


# -- a replay reads nothing back to the host -------------------------------------------------------
_HOST_READS = ("_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "allclose",
               "unique", "masked_select", "tolist")


class _HostReadSpy(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every op that brings a tensor's value to the host (on CUDA: a synchronisation)."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _HOST_READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


class _NoOpGraph:
    """A captured graph whose replay launches nothing (what the host sees of a real one)."""

    def replay(self):
        pass


@contextlib.contextmanager
def _plain_capture(graph, **kwargs):
    yield


def test_spy_sees_host_reads():
    spy = _HostReadSpy()
    with spy:
        x = torch.ones(3)
        bool(x.sum() > 0)
        x.sum().item()
    assert len(spy.reads) == 2 and "_local_scalar_dense" in spy.reads


@pytest.mark.parametrize("name", ["oktopk", "dense"])
def test_replay_path_makes_no_host_read(name):
    alg = get_algorithm(name)(N, SingleCommunicator(), 0.02)
    step = GraphedStep(alg, eager_steps=2, graph_factory=_NoOpGraph, capture=_plain_capture)
    g = student_t(seed=2)(0, 0, N)
    for _ in range(3):
        step(g)                                     # eager, eager, captured
    assert step.captured
    spy = _HostReadSpy()
    with spy:
        for _ in range(3):
            step(g)
    assert spy.reads == []
    assert alg.step_count == 6


class _NoOpGraphed(GraphedStep):
    """GraphedStep as SparseAllreduce builds it, its replays launching nothing."""

    def __init__(self, algorithm, **kwargs):
        super().__init__(algorithm, eager_steps=1, graph_factory=_NoOpGraph,
                         capture=_plain_capture)


def test_sparse_allreduce_graphed_steps_make_no_host_read(monkeypatch):
    from oktopk_triton import module
    from oktopk_triton.module import SparseAllreduce
    monkeypatch.setattr(module, "GraphedStep", _NoOpGraphed)
    model = _model(4)
    sar = SparseAllreduce(model.parameters(), density=0.05, momentum=0.9, cuda_graph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 20)
    for t in range(5):
        model.zero_grad()
        model(x).square().mean().backward()
        spy = _HostReadSpy()
        with spy:
            if t % 2:
                sar.reduce_updates(opt)
            else:
                sar.reduce_gradients()
        if t >= 2:                                  # replays (the graph captured at t = 1)
            assert spy.reads == [], (t, spy.reads)
    assert sar.parts.graph.captured


def _local_steps_run(graphed: bool, calls: int):
    from oktopk_triton.module import SparseAllreduce
    model = _model(5)
    sar = SparseAllreduce(model.parameters(), density=0.05, sync_every=2, outer_momentum=0.5,
                          residual_decay=0.9)
    if graphed:      # what cuda_graph=True builds on CUDA (a stand-in graph on the CPU)
        sar.parts.graph = _RerunGraphed(sar.algorithm)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(6)
    weights = []
    for _ in range(calls):
        x = torch.randn(16, 20, generator=g)
        model.zero_grad()
        model(x).square().mean().backward()
        sar.reduce_updates(opt)
        weights.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
    return sar, weights


def test_local_steps_sync_replays_the_eager_sync():
    """The local-steps sync reduces through the same graphed step: a replayed sync (stand-in
    graph) gives the eager run's weights bit for bit, residual decay and outer momentum on."""
    eager, want = _local_steps_run(False, 12)
    graphed, got = _local_steps_run(True, 12)
    assert graphed.parts.graph.captured and graphed.algorithm.step_count == 6
    for t, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), t
    assert torch.equal(eager.residual, graphed.residual)


@pytest.mark.parametrize("name", SPARSE_ALGORITHMS)
def test_compact_wire_replays_give_the_eager_steps(name):
    """The compact wire's steady step is replayable too: a stand-in graph that re-runs the
    captured step from its static input gives the eager steps bit for bit."""
    grad = student_t(seed=11)
    ref = get_algorithm(name)(N, SingleCommunicator(), 0.02, wire_format="compact")
    alg = get_algorithm(name)(N, SingleCommunicator(), 0.02, wire_format="compact")
    box = {}
    step = GraphedStep(alg, eager_steps=2, graph_factory=_RerunGraph,
                       capture=_rerun_capture(lambda: box["step"]))
    box["step"] = step
    for t in range(5):
        want = ref(grad(0, t, N)).clone()
        assert torch.equal(step(grad(0, t, N)), want), t
    assert step.captured and torch.equal(alg.residual, ref.residual)


def _has_cupy_nccl():
    try:
        from cupy.cuda import nccl  # noqa: F401
        return True
    except Exception:  # noqa: BLE001
        return False


def _nccl_graph_body(comm, name, wire, n):
    """Eager and graphed steps of one algorithm side by side on NCCL ranks (watchdog on):
    the replays give the eager outputs bit for bit, with no host synchronisation."""
    from conservation import student_t as st
    grad = st(seed=13)
    ref = get_algorithm(name)(n, comm, 0.01, wire_format=wire)
    alg = get_algorithm(name)(n, comm, 0.01, wire_format=wire)
    step = GraphedStep(alg)
    assert comm._watchdog is not None
    syncs = []
    for t in range(8):
        g = grad(comm.rank, t, n).cuda(comm.device)
        want = ref(g).clone()
        if step.captured:
            import warnings
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    got = step(g)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            syncs.append(sum("synchroniz" in str(w.message).lower() for w in caught))
        else:
            got = step(g)
        assert torch.equal(got, want), t
    comm.check()
    return step.captured, syncs


@pytest.mark.skipif(not (torch.cuda.is_available() and _has_cupy_nccl()),
                    reason="needs CUDA and cupy with NCCL")
@pytest.mark.gpu
@pytest.mark.parametrize("wire", ["fp32", "compact"])
@pytest.mark.parametrize("name", ["oktopk", "dense"])
def test_nccl_ranks_capture_and_replay(name, wire):
    """Across NCCL ranks (the watchdog polling): capture at n = 2^22 and replay, bit for bit
    the eager steps, no host synchronisation in a replay."""
    from distutil import run_nccl
    if name == "dense" and wire == "compact":
        pytest.skip("dense sends no sparse messages")
    res = run_nccl(2, _nccl_graph_body, name, wire, 1 << 22, timeout=300)
    for captured, syncs in res:
        assert captured and syncs and all(s == 0 for s in syncs), syncs


def test_a_failed_capture_leaves_no_graph_and_the_counters_as_they_were():
    alg = get_algorithm("oktopk")(N, SingleCommunicator(), 0.02)
    box = {"fail": True}
    inner = _rerun_capture(lambda: box["step"])

    @contextlib.contextmanager
    def capture(graph, **kwargs):
        with inner(graph, **kwargs):
            yield
        if box["fail"]:
            box["fail"] = False
            raise RuntimeError("operation failed due to a previous error during capture")

    step = GraphedStep(alg, eager_steps=1, graph_factory=_RerunGraph, capture=capture)
    box["step"] = step
    ref = get_algorithm("oktopk")(N, SingleCommunicator(), 0.02)
    grad = student_t(seed=12)
    assert torch.equal(step(grad(0, 0, N)), ref(grad(0, 0, N)))
    with pytest.raises(RuntimeError, match="during capture"):
        step(grad(0, 1, N))
    assert not step.captured and alg.step_count == 1 and alg.comm.bytes_sent == 0
    for t in range(1, 4):                            # captures again, then replays
        assert torch.equal(step(grad(0, t, N)), ref(grad(0, t, N))), t
    assert step.captured and alg.step_count == ref.step_count == 4

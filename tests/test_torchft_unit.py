"""Unit tests of the torchft integration, in one process: the refusals (each one line), the
rollback's capture and restore, the communicator's failure handling and the heal's fingerprint
check. A real in-process lighthouse and Managers that never start a quorum; a fake process group
where a failure is needed."""
from datetime import timedelta

import pytest
import torch

pytest.importorskip("torchft")

from oktopk_triton.checkpoint import CheckpointError  # noqa: E402
from oktopk_triton.comm import CommAborted, CommError  # noqa: E402
from oktopk_triton.comm.torchft import ManagerCommunicator  # noqa: E402
from oktopk_triton.config import OkTopk  # noqa: E402
from oktopk_triton.integrations.torchft import (ReplicaSync, SparseDiLoCo,  # noqa: E402
                                                SparseGradients)


@pytest.fixture(scope="module")
def lighthouse():
    from torchft.coordination import LighthouseServer
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    yield lh
    lh.shutdown()


@pytest.fixture(scope="module")
def new_manager(lighthouse):
    """A new Manager per call (one sparse reducer each), all shut down at the end."""
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    made = []

    def make(use_async=False):
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        m = Manager(pg=ProcessGroupGloo(), load_state_dict=lambda s: None,
                    state_dict=lambda: {}, min_replica_size=1, use_async_quorum=use_async,
                    rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
                    lighthouse_addr=lighthouse.address(), replica_id=f"unit_{len(made)}",
                    hostname="127.0.0.1", timeout=timedelta(seconds=5))
        made.append((m, store))
        return m
    yield make
    for m, _ in made:
        m.shutdown(wait=False)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))


def _diloco(manager, model=None, outer=None, **kw):
    model = model or _model()
    outer = outer(model.parameters()) if outer else torch.optim.SGD(model.parameters(), lr=1.0)
    return SparseDiLoCo(manager, [model], torch.optim.SGD(model.parameters(), lr=0.1), outer,
                        sync_every=2, **kw)


def _one_line(exc_info, start):
    text = str(exc_info.value)
    assert "\n" not in text and text.startswith(start), text


def test_an_async_quorum_is_refused_in_one_line(new_manager):
    m = new_manager(use_async=True)
    for build in (lambda: _diloco(m), lambda: SparseGradients(m, _model())):
        with pytest.raises(ValueError) as e:
            build()
        _one_line(e, "ManagerCommunicator: the Manager must be built with use_async_quorum=False")


def test_a_missing_manager_is_refused_in_one_line():
    for bad in (None, object()):
        with pytest.raises(TypeError) as e:
            _diloco(bad)
        _one_line(e, "ManagerCommunicator: expected a torchft.Manager, got")


@pytest.mark.parametrize("kw, start", [
    (dict(fragment_sync_delay=2), "SparseDiLoCo: fragment_sync_delay must be an int in [0, 2) "
                                  "(sync_every / fragments), got 2"),
    (dict(fragment_sync_delay=-1), "SparseDiLoCo: fragment_sync_delay must be an int in"),
    (dict(fragment_update_alpha=1.5), "SparseDiLoCo: fragment_update_alpha must be a number in "
                                      "[0, 1], got 1.5"),
])
def test_bad_streaming_options_are_refused_in_one_line(new_manager, kw, start):
    with pytest.raises(ValueError) as e:
        _diloco(new_manager(), **kw)
    _one_line(e, start)


def test_should_quantize_is_the_two_bit_wire_or_refused_in_one_line(new_manager, caplog):
    import logging
    with caplog.at_level(logging.INFO, logger="oktopk_triton"):
        d = _diloco(new_manager(), should_quantize=True, density=0.2, algorithm="oktopk")
    assert d.reducer.config.wire_format == "q2"
    assert any("should_quantize=True sends the pseudo-gradient on the 2-bit wire" in
               r.getMessage() for r in caplog.records)
    compact = _diloco(new_manager(), should_quantize=True, density=0.2,
                      algorithm=OkTopk(wire_format="compact"))
    assert compact.reducer.config.wire_format == "compact"     # a packed wire chosen is kept
    with pytest.raises(ValueError) as e:
        _diloco(new_manager(), should_quantize=True, density=0.2, algorithm="dense")
    _one_line(e, "SparseDiLoCo: should_quantize=True maps to wire_format='q2', which dense "
                 "cannot send")


def test_a_diloco_preset_is_the_default_and_logs_one_line(new_manager, caplog):
    import logging

    from oktopk_triton.presets import DILOCO_PRESETS, DILOCO_SOLVE_P
    with caplog.at_level(logging.INFO, logger="oktopk_triton"):
        d = _diloco(new_manager())
    p = DILOCO_PRESETS["diloco"]
    assert d.reducer.config == p.algorithm and d.residual_decay == p.residual_decay
    assert d.reducer.algorithm.density == pytest.approx(p.density(d.reducer.numel,
                                                                  DILOCO_SOLVE_P))
    lines = [r.getMessage() for r in caplog.records if "preset diloco" in r.getMessage()]
    assert len(lines) == 1 and "of DiLoCo's dense sync" in lines[0], lines
    with pytest.raises(ValueError) as e:
        _diloco(new_manager(), preset="diloco", density=0.1)
    _one_line(e, "SparseDiLoCo: preset='diloco' sets density, algorithm and residual_decay; "
                 "also got density")
    with pytest.raises(ValueError) as e:
        _diloco(new_manager(), preset="transformer")
    _one_line(e, "SparseDiLoCo: preset must be one of ['diloco', 'diloco-lean'] or a DiLoCo "
                 "Preset")
    with pytest.raises(ValueError) as e:
        _diloco(new_manager(), density=0.2, residual_decay=1.5)
    _one_line(e, "SparseDiLoCo: residual_decay must be a number in (0, 1], got 1.5")


def test_the_users_outer_optimizer_is_served_or_refused(new_manager):
    nesterov = _diloco(new_manager(), density=0.2, outer=lambda ps: torch.optim.SGD(
        ps, lr=0.7, momentum=0.9, nesterov=True))
    assert nesterov.outer_optimizer.param_groups[0]["momentum"] == 0.5
    with pytest.raises(ValueError) as e:
        _diloco(new_manager(), density=0.2, outer=lambda ps: torch.optim.Adam(ps))
    _one_line(e, "SparseDiLoCo: with a sparse algorithm the outer optimizer must be "
                 "torch.optim.SGD")
    dense = _diloco(new_manager(), density=0.2, algorithm="dense",
                    outer=lambda ps: torch.optim.Adam(ps))
    assert isinstance(dense.outer_optimizer, torch.optim.Adam)


def test_bad_fragments_and_a_bad_interval_are_refused(new_manager):
    m = new_manager()
    a, b = _model(), _model()
    opt = torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=0.1)
    with pytest.raises(ValueError) as e:
        SparseDiLoCo(m, [a, b], opt, opt, sync_every=3)
    _one_line(e, "SparseDiLoCo: sync_every must be a multiple of the number of fragments (2), "
                 "got 3")
    with pytest.raises(ValueError) as e:
        SparseDiLoCo(m, [a, a], opt, opt, sync_every=2)
    _one_line(e, "SparseDiLoCo: the model fragments share parameters")
    with pytest.raises(ValueError) as e:
        SparseDiLoCo(m, [], opt, opt, sync_every=2)
    _one_line(e, "SparseDiLoCo: model_fragments must be a non-empty list of nn.Module")
    with pytest.raises(ValueError) as e:
        SparseDiLoCo(m, [a], opt, opt, sync_every=0)
    _one_line(e, "SparseDiLoCo: sync_every must be a positive int, got 0")
    two = SparseDiLoCo(m, [a, b], opt, torch.optim.SGD(opt.param_groups[0]["params"], lr=1.0),
                       sync_every=4, fragment_sync_delay=1, density=0.2)
    assert two.streaming and len(two.replica.sars) == 2


def test_a_heal_from_another_model_is_refused_before_anything_is_loaded(new_manager):
    m = new_manager()
    d = _diloco(m)
    fns = list(m._load_state_dict_fns)
    assert fns[0] == "oktopk"             # ours runs before the user's weights are loaded
    theirs = d.replica._heal_save()
    d.replica._heal_load(theirs)          # the same model: accepted
    assert d.replica._pending is theirs
    other = _diloco(new_manager(), model=torch.nn.Sequential(torch.nn.Linear(6, 7)))
    with pytest.raises(CheckpointError) as e:
        d.replica._heal_load(other.replica._heal_save())
    _one_line(e, "torchft heal refused: the peer's model is another one (parameter 0 has "
                 "shape [7, 6]")


def _restores_bit_for_bit(comm, name, options, seed):
    from oktopk_triton.algorithms import get_algorithm
    g = torch.Generator().manual_seed(seed)
    alg = get_algorithm(name)(512, comm, 0.05, **options)
    for _ in range(3):
        alg(torch.randn(512, generator=g))
    snap, grad = alg.snapshot(), torch.randn(512, generator=g)
    first = alg(grad).clone()
    after = {k: v.clone() if torch.is_tensor(v) else v for k, v in alg.state_dict().items()}
    alg.restore(snap)
    again = alg(grad)
    assert torch.equal(first, again)
    for k, v in alg.state_dict().items():
        assert (torch.equal(v, after[k]) if torch.is_tensor(v) else v == after[k]), k
    return True


@pytest.mark.parametrize("name,options", [
    ("oktopk", dict(momentum=0.9, consistency=0.9, backend="torch")),
    ("oktopk", dict(wire_format="q2", backend="torch")),
    ("topka", dict(backend="torch")), ("gtopk", dict(backend="torch")),
    ("spardl", {}), ("topkdsa", {}), ("gaussiank", dict(backend="torch")),
    ("dense", dict(momentum=0.9))])
def test_an_algorithm_snapshot_restores_it_bit_for_bit(name, options):
    """The algorithm owns its rollback: snapshot, a step, restore, the same step again gives
    the same out and the same state, on 3 ranks."""
    from oktopk_triton.comm.local import LocalCluster
    assert all(LocalCluster(3).run(
        lambda comm: _restores_bit_for_bit(comm, name, options, 1 + comm.rank)))


class _Work:
    def __init__(self, fail):
        self.fail = fail

    def wait(self, timeout=None):
        if self.fail:
            raise RuntimeError("Connection reset by peer")
        return True


class _PG:
    def __init__(self, size):
        self._size, self.fail = size, False

    def size(self):
        return self._size

    def getBackendName(self):
        return "torchft-gloo"

    def allreduce(self, tensors, opts):
        return _Work(self.fail)


class _Manager:
    _use_async_quorum = False
    _timeout = timedelta(seconds=1)
    _quorum_id = 3

    def __init__(self, rank, size, pg_size=None):
        self.rank, self.size, self._pg, self.errors = rank, size, _PG(pg_size or size), []

    def start_quorum(self):
        pass

    def should_commit(self):
        return not self.errors

    def num_participants(self):
        return self.size

    def participating_rank(self):
        return self.rank

    def errored(self):
        return None

    def report_error(self, e):
        self.errors.append(e)


def test_a_failed_primitive_is_reported_and_breaks_the_communicator_until_the_next_quorum():
    m = _Manager(1, 3)
    comm = ManagerCommunicator(m)
    assert comm.refresh() and (comm.rank, comm.world_size) == (1, 3)
    assert not comm.refresh()                  # the same rank and P: nothing to reconfigure
    comm.allreduce(torch.ones(4))
    assert comm.bytes_sent == 2 * 2 * 16 // 3
    m._pg.fail = True
    with pytest.raises(CommAborted) as e:
        comm.allreduce(torch.ones(4))
    _one_line(e, "rank 1 of 3: allreduce failed in quorum 3: Connection reset by peer")
    assert m.errors and m.errors[0] is e.value
    m._pg.fail = False
    with pytest.raises(CommAborted, match="broken by an earlier failure"):
        comm.allreduce(torch.ones(4))
    comm.refresh()
    comm.allreduce(torch.ones(4))               # a new quorum clears it


def test_refresh_refuses_a_spare_and_a_group_of_another_size():
    with pytest.raises(CommError, match="does not participate"):
        ManagerCommunicator(_Manager(None, 2)).refresh()
    with pytest.raises(CommError, match="3 participants but a process group of 4"):
        ManagerCommunicator(_Manager(0, 3, pg_size=4)).refresh()


def test_replica_sync_starts_at_one_rank_and_one_per_manager(new_manager):
    m = new_manager()
    rs = ReplicaSync(m, _model(), 0.1, "topka")
    assert rs.sar.comm.world_size == 1 and rs.committed == 0
    assert list(m._load_state_dict_fns)[0] == "oktopk"
    assert rs._heal_save()["fingerprint"]["algorithm"] == "topka"
    with pytest.raises(ValueError) as e:
        SparseGradients(m, _model())
    _one_line(e, "ReplicaSync: this Manager already has a sparse reducer")

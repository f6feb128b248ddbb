"""SparseAllreduce (oktopk_triton/module.py): the public front."""

import pytest
import torch

from conservation import (assert_bitwise_agreement, assert_conservation, continued_from_save,
                          host_syncs_raise, mixed, run_steps, toy_calls, whole_and_resumed)
from conservation import toy_model as _model
from oktopk_triton import SparseAllreduce
from oktopk_triton.algorithms import SPARSE_ALGORITHMS
from oktopk_triton.comm.local import LocalCluster

BE = {"backend": "torch"}


def _opts(alg):
    return BE if alg == "oktopk" else {}


# -- shapes, dtypes, devices ---------------------------------------------------------------------
@pytest.mark.parametrize("alg", ["dense", "oktopk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_out_shape_dtype_device_world_of_one(alg, dtype):
    sar = SparseAllreduce(600, density=0.05, algorithm=alg, **_opts(alg))
    g = torch.randn(20, 30).to(dtype)
    out = sar(g)
    assert out.shape == g.shape and out.dtype == dtype and out.device == g.device
    assert sar.residual.dtype == torch.float32 and sar.residual.numel() == 600
    for key in ("bytes_sent", "local_selected", "global_selected", "overflow"):
        assert key in sar.stats
    # conservation in a world of one: acc = out + residual'
    acc = g.float().reshape(-1)
    assert torch.allclose(out.float().reshape(-1) + sar.residual, acc, rtol=0, atol=1e-2)


def _lp_body(comm, dtype):
    sar = SparseAllreduce(2000, comm=comm, density=0.02, algorithm="oktopk", **BE)
    out = sar(mixed(1)(comm.rank, 0, 2000).to(dtype))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_conserves_across_ranks(dtype):
    res = run_steps("oktopk", 3, 2000, 30, 0.02, mixed(2), dtype=dtype, backend="torch")
    assert_conservation(res)
    assert_bitwise_agreement(res)
    outs = LocalCluster(3).run(_lp_body, dtype)
    assert all(o.dtype == dtype for o in outs)


# -- reduce_gradients -------------------------------------------------------------------------


def _grads_body(comm, alg):
    m = _model(0)                      # identical weights everywhere
    twin = _model(0)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(100 + comm.rank))
    m(x).pow(2).sum().backward()
    twin(x).pow(2).sum().backward()
    m[2].bias.grad = None              # a None grad counts as zeros
    sar = SparseAllreduce(m.parameters(), comm=comm, density=0.1, algorithm=alg, **_opts(alg))
    flat_ref = torch.cat([(p.grad if i != 3 else torch.zeros_like(p)).reshape(-1)
                          for i, p in enumerate(twin.parameters())])
    ref_sar = SparseAllreduce(flat_ref.numel(), comm=comm, density=0.1, algorithm=alg,
                              **_opts(alg))
    flat = sar.reduce_gradients()
    first = flat.clone()
    ref = ref_sar(flat_ref)
    grads = [p.grad.clone() for p in m.parameters()]
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    views = all(lo <= p.grad.data_ptr() < hi for p in m.parameters())
    # second step: backward accumulates into the views; reduce_gradients copies nothing in
    ptrs = [p.grad.data_ptr() for p in m.parameters()]
    m(x).sum().backward()
    assert torch.equal(torch.cat([p.grad.reshape(-1) for p in m.parameters()]), flat)
    flat2 = sar.reduce_gradients()
    assert flat2.data_ptr() == lo and ptrs == [p.grad.data_ptr() for p in m.parameters()]
    return first, ref, grads, views, sar.residual.clone(), ref_sar.residual.clone()

@pytest.mark.parametrize("alg", ["dense", "oktopk"])
def test_reduce_gradients_writes_grads(alg):
    res = LocalCluster(2).run(_grads_body, alg)
    for flat, ref, grads, views, r1, r2 in res:
        assert torch.equal(flat, ref)
        assert torch.equal(torch.cat([g.reshape(-1) for g in grads]), ref)
        assert views
        assert r1.shape == r2.shape
    assert torch.equal(res[0][0], res[1][0])


# -- reduce_updates ---------------------------------------------------------------------------
def _sgd_pair_body(comm, alg):
    """reduce_updates with plain SGD against reduce_gradients + SGD: the update is -lr * grad,
    so with the dense algorithm both give the same weights."""
    a, b = _model(1), _model(1)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    sa = SparseAllreduce(a.parameters(), comm=comm, density=1.0, algorithm=alg)
    sb = SparseAllreduce(b.parameters(), comm=comm, density=1.0, algorithm=alg)
    gen = torch.Generator().manual_seed(7 + comm.rank)
    for _ in range(3):
        x = torch.randn(6, 8, generator=gen)
        for m, o in ((a, opt_a), (b, opt_b)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
        sa.reduce_updates(opt_a)
        sb.reduce_gradients()
        opt_b.step()
    return ([p.detach().clone() for p in a.parameters()],
            [p.detach().clone() for p in b.parameters()])


def test_reduce_updates_with_sgd_matches_reduce_gradients():
    for wa, wb in LocalCluster(3).run(_sgd_pair_body, "dense"):
        for x, y in zip(wa, wb):
            assert torch.allclose(x, y, rtol=0, atol=1e-6)


def _adam_body(comm, steps, nan_step):
    """Adam in update space: a twin optimizer (same state, same grads) computes the update the
    reducer saw, so conservation can be checked: sum over ranks and steps of the updates =
    P * sum of outs + sum of the final residuals."""
    m, twin = _model(2), _model(2)
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    opt_t = torch.optim.Adam(twin.parameters(), lr=0.01)
    sar = SparseAllreduce(m.parameters(), comm=comm, density=0.05, algorithm="oktopk", **BE)
    gen = torch.Generator().manual_seed(11 + comm.rank)
    n = sar.numel
    total_update = torch.zeros(n, dtype=torch.float64)
    total_out = torch.zeros(n, dtype=torch.float64)
    moved_by_out, same_after_nan = [], None
    for step in range(steps):
        x = torch.randn(6, 8, generator=gen)
        with torch.no_grad():                    # the twin starts from the same weights
            for p, q in zip(twin.parameters(), m.parameters()):
                p.copy_(q)
        for mm, o in ((m, opt), (twin, opt_t)):
            o.zero_grad()
            mm(x).pow(2).mean().backward()
        if step == nan_step and comm.rank == 1:
            next(m.parameters()).grad[0, 0] = float("nan")
        before = torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()
        opt_t.step()
        upd = torch.cat([(p.detach() - q.detach()).reshape(-1)
                         for p, q in zip(twin.parameters(), m.parameters())])
        out = sar.reduce_updates(opt)
        after = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        if step == nan_step:
            same_after_nan = torch.equal(after, before)
            opt = torch.optim.Adam(m.parameters(), lr=0.01)   # rank 1's state took the NaN
            opt_t = torch.optim.Adam(twin.parameters(), lr=0.01)
            continue
        moved_by_out.append(torch.equal(after, before + out))
        total_update += upd.double()
        total_out += out.double()
    return (after.clone(), total_update, total_out, sar.residual.double().clone(), moved_by_out,
            same_after_nan, sar.step_count)


def test_reduce_updates_adam_conserves_and_keeps_replicas_identical():
    P = 3
    res = LocalCluster(P).run(_adam_body, 8, 4)
    weights = [r[0] for r in res]
    assert all(torch.equal(weights[0], w) for w in weights[1:])     # replicas identical
    assert all(all(r[4]) for r in res)                              # weights moved by out exactly
    assert all(r[5] for r in res)             # the NaN step left the weights alone everywhere
    lhs = sum(r[1] for r in res)
    rhs = P * res[0][2] + sum(r[3] for r in res)
    assert torch.allclose(lhs, rhs, rtol=0, atol=1e-5)
    # something was both applied and held back
    assert res[0][2].abs().sum() > 0 and sum(r[3] for r in res).abs().sum() > 0


def _unchecked_nan_body(comm):
    """check_finite="off": no flag from the algorithm, so reduce_updates masks out itself."""
    m = _model(2)
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    sar = SparseAllreduce(m.parameters(), comm=comm, density=1.0, algorithm="dense",
                          check_finite="off")
    m(torch.randn(6, 8, generator=torch.Generator().manual_seed(comm.rank))).square().mean(
        ).backward()
    if comm.rank == 1:
        next(m.parameters()).grad[0, 0] = float("nan")
    before = [p.detach().clone() for p in m.parameters()]
    out = sar.reduce_updates(opt)
    return before, [p.detach().clone() for p in m.parameters()], out.clone(), sar.stats


def test_reduce_updates_unchecked_leaves_only_the_nonfinite_entries_alone():
    """Without the algorithm's non-finite flag the weights stay where ``out`` is not finite
    (rank 1's NaN entry, on every rank) and move by ``out`` everywhere else."""
    res = LocalCluster(2).run(_unchecked_nan_body)
    for before, after, out, stats in res:
        assert stats.get("nonfinite") is None
        assert not bool(torch.isfinite(out[0])) and bool(torch.isfinite(out[1:]).all())
        assert after[0][0, 0] == before[0][0, 0]
        flat_before = torch.cat([b.reshape(-1) for b in before])
        flat_after = torch.cat([a.reshape(-1) for a in after])
        assert torch.equal(flat_after[1:], flat_before[1:] + out[1:])
        assert bool(torch.isfinite(flat_after).all())
    assert torch.equal(torch.cat([a.reshape(-1) for a in res[0][1]]),
                       torch.cat([a.reshape(-1) for a in res[1][1]]))


@pytest.mark.parametrize("alg", ["dense", "oktopk"])
def test_reduce_updates_mixed_dtypes_world_of_one(alg):
    """fp32 and bf16 parameters in one reducer (its flat buffer is fp32): the weights end at
    before + out, each in its own dtype, and with density 1 that is plain SGD."""
    g = torch.Generator().manual_seed(5)
    a = torch.randn(40, generator=g).requires_grad_()
    b = torch.randn(24, generator=g).to(torch.bfloat16).requires_grad_()
    a0, b0 = a.detach().clone(), b.detach().clone()
    opt = torch.optim.SGD([a, b], lr=0.5)
    sar = SparseAllreduce([a, b], density=1.0 if alg == "dense" else 0.25, algorithm=alg,
                          **_opts(alg))
    (a.pow(2).sum() + b.float().pow(3).sum()).backward()
    ga, gb = a.grad.clone(), b.grad.clone()
    out = sar.reduce_updates(opt)
    assert out.dtype == torch.float32 and a.dtype == torch.float32 and b.dtype == torch.bfloat16
    assert torch.equal(a.detach(), a0 + out[:40])
    assert torch.equal(b.detach(), (b0.float() + out[40:]).to(torch.bfloat16))
    if alg == "dense":
        assert torch.allclose(a.detach(), a0 - 0.5 * ga, atol=1e-6)
        assert torch.allclose(b.detach().float(), (b0 - 0.5 * gb).float(), atol=0.1)
    else:
        assert int((out != 0).sum()) <= 16 and sar.residual.abs().sum() > 0


def _updates_sync_body(comm):
    dev = comm.device
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                            torch.nn.Linear(256, 64)).to(dev)
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):          # identical weights on every rank
            p.copy_(torch.linspace(-0.1, 0.1, p.numel(), device=dev).reshape(p.shape) * (i + 1))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, capturable=True)
    sar = SparseAllreduce(m.parameters(), comm=comm, density=0.05, algorithm="oktopk")
    xs = [torch.randn(8, 64, generator=torch.Generator().manual_seed(comm.rank * 10 + t)).to(dev)
          for t in range(5)]
    def call(x):
        opt.zero_grad(set_to_none=False)
        m(x).pow(2).mean().backward()
        sar.reduce_updates(opt)

    for x in xs[:2]:                    # calibration + one steady step, syncs allowed
        call(x)
    with host_syncs_raise(comm):
        for x in xs[2:]:
            call(x)
    return True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_reduce_updates_never_syncs():
    """A steady reduce_updates step (AdamW with capturable=True, whose own step does not read
    the host) on CUDA under torch.cuda.set_sync_debug_mode('error')."""
    assert LocalCluster(2, device="cuda").run(_updates_sync_body) == [True, True]


def _foreign_body(comm):
    m, other = _model(3), torch.nn.Linear(2, 2)
    sar = SparseAllreduce(m.parameters(), comm=comm, density=0.1, algorithm="oktopk", **BE)
    opt = torch.optim.Adam(list(m.parameters()) + list(other.parameters()))
    m(torch.randn(2, 8)).sum().backward()
    try:
        sar.reduce_updates(opt)
    except ValueError as e:
        return str(e)
    return "no error"


def test_reduce_updates_bad_input():
    assert "does not reduce" in LocalCluster(1).run(_foreign_body)[0]
    with pytest.raises(RuntimeError, match="built from parameters"):
        SparseAllreduce(10, density=0.5).reduce_updates(torch.optim.SGD([torch.zeros(1,
                                                                 requires_grad=True)], lr=1))
    m = _model(0)
    with pytest.raises(TypeError, match="Optimizer"):
        SparseAllreduce(m.parameters(), density=0.5).reduce_updates(lambda: None)


# -- non-finite policy ------------------------------------------------------------------------
@pytest.mark.parametrize("alg", ["dense", "oktopk"])
def test_nonfinite_on_one_rank_makes_out_nan_everywhere(alg):
    res = run_steps(alg, 3, 1500, 8, 0.02, mixed(3), nonfinite={4: 1}, **_opts(alg))
    assert res.unchanged[4]
    assert all(not bool(torch.isfinite(o).any()) for o in res.outs[4])
    assert_conservation(res)
    assert_bitwise_agreement(res)


def _raise_body(comm):
    sar = SparseAllreduce(1000, comm=comm, density=0.02, algorithm="oktopk",
                          check_finite="raise", **BE)
    g = torch.randn(1000)
    sar(g)
    before = sar.residual.clone()
    if comm.rank == 2:
        g[5] = float("inf")
    try:
        sar(g)
    except FloatingPointError as e:
        return "raised", str(e), torch.equal(before, sar.residual)
    return "no", "", False


def test_check_finite_raise_on_every_rank():
    for status, msg, same in LocalCluster(3).run(_raise_body):
        assert status == "raised" and "non-finite" in msg and same


# -- bad input ------------------------------------------------------------------------------
def test_bad_input_errors():
    for d in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="density"):
            SparseAllreduce(100, density=d, algorithm="oktopk", **BE)
    with pytest.raises(ValueError, match="unknown algorithm"):
        SparseAllreduce(100, algorithm="nope")
    with pytest.raises(TypeError, match="unknown option"):
        SparseAllreduce(100, algorithm="oktopk", not_an_option=3)
    sar = SparseAllreduce(100, density=0.1, algorithm="oktopk", **BE)
    with pytest.raises(ValueError, match=r"99.*100|100.*99"):
        sar(torch.zeros(99))
    with pytest.raises(TypeError, match="dtype"):
        sar(torch.zeros(100, dtype=torch.int32))
    with pytest.raises(TypeError):
        sar([0.0] * 100)
    with pytest.raises(ValueError, match="requires_grad"):
        SparseAllreduce([torch.zeros(3)], algorithm="dense")


def _numel_body(comm):
    try:
        SparseAllreduce(100 + (comm.rank == 1), comm=comm, algorithm="oktopk", **BE)
    except ValueError as e:
        return str(e)
    return None


def test_numel_differing_across_ranks_raises_everywhere():
    msgs = LocalCluster(3).run(_numel_body)
    assert all(m is not None and "differ" in m and "101" in m for m in msgs)


# -- state ------------------------------------------------------------------------------------
def _state_body(comm, steps, cut):
    fn = mixed(9)
    opts = dict(momentum=0.9, **BE)
    a, outs, b, outs2 = continued_from_save(
        lambda: SparseAllreduce(2000, comm=comm, density=0.02, **opts),
        lambda sar, t: sar(fn(comm.rank, t, 2000)), steps, cut)
    # nested in a model's state_dict too
    holder = torch.nn.Module()
    holder.sar = b
    sd = holder.state_dict()
    return (all(torch.equal(x, y) for x, y in zip(outs[cut:], outs2)),
            torch.equal(a.residual, b.residual), b.step_count, list(sd))


def test_state_dict_round_trip():
    for same_out, same_res, step, keys in LocalCluster(2).run(_state_body, 20, 7):
        assert same_out and same_res and step == 20
        assert keys == ["sar._extra_state"]


# -- checkpoints of the parameter front: bit for bit -----------------------------------------------
def _train_body(comm, mode, steps, cut):
    """``steps`` steps in one go, and ``cut`` steps + save (model, optimizer, reducer) + load into
    fresh objects + the rest: the weights must be equal bit for bit."""
    def make():
        m = _model(5)
        opt = (torch.optim.AdamW(m.parameters(), lr=0.01) if mode == "updates"
               else torch.optim.SGD(m.parameters(), lr=0.1))
        sar = SparseAllreduce(m.parameters(), comm=comm, density=0.05, algorithm="oktopk", **BE)
        return m, opt, sar

    def run(m, opt, sar, first, last):
        toy_calls(comm.rank, m, opt, sar, first, last,
                  reduce=None if mode == "updates" else _gradients_then_step)

    whole, resumed, _ = whole_and_resumed(make, run, steps, cut)
    return all(torch.equal(p, q) for p, q in zip(whole[0].parameters(), resumed[0].parameters()))


def _gradients_then_step(sar, opt):
    sar.reduce_gradients()
    opt.step()


@pytest.mark.parametrize("mode", ["gradients", "updates"])
def test_parameter_front_resumes_bit_for_bit(mode):
    assert all(LocalCluster(3).run(_train_body, mode, 10, 4))


def test_reduce_updates_takes_the_scaler_step():
    """With a GradScaler the update is unscaled (the residual is in the weights' units), and a
    rank whose gradient is not finite skips its optimizer step."""
    def body(comm):
        m = _model(6)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        sar = SparseAllreduce(m.parameters(), comm=comm, density=1.0, algorithm="dense")
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(comm.rank))
        ref = [p.detach() - 0.1 * torch.autograd.grad(m(x).pow(2).mean(), p)[0]
               for p in m.parameters()]
        scaler.scale(m(x).pow(2).mean()).backward()
        sar.reduce_updates(opt, scaler=scaler)
        scaler.update()
        return [p.detach().clone() for p in m.parameters()], ref
    res = LocalCluster(2).run(body)
    for w, _ in res:
        for a, b in zip(w, [(x + y) / 2 for x, y in zip(res[0][1], res[1][1])]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_param_slices_name_each_parameters_part_of_the_flat_gradient():
    from oktopk_triton import SparseAllreduce
    from oktopk_triton.comm import LocalCluster
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    sar = SparseAllreduce(model.parameters(), comm=LocalCluster(1).communicator(0), density=0.5,
                          algorithm="oktopk")
    sl = sar.param_slices()
    assert [s.param for s in sl] == list(model.parameters())
    assert [(s.offset, s.numel) for s in sl] == [(0, 12), (12, 4), (16, 8), (24, 2)]
    assert sl[-1].offset + sl[-1].numel == sar.numel
    assert SparseAllreduce(8, comm=LocalCluster(1).communicator(0), density=0.5,
                           algorithm="oktopk").param_slices() == []


def _held_bytes(obj, skip, seen=None, found=None):
    """Bytes of the tensor storages reachable from ``obj``'s attributes, each storage once,
    leaving out the storages in ``skip`` (the parameters' and gradients')."""
    seen, found = (set(), {}) if seen is None else (seen, found)
    if id(obj) in seen:
        return found
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        if st.data_ptr() not in skip:
            found[st.data_ptr()] = st.nbytes()
    elif isinstance(obj, dict):
        for v in obj.values():
            _held_bytes(v, skip, seen, found)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _held_bytes(v, skip, seen, found)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type) \
            and not type(obj).__module__.startswith("torch."):      # not the user's model
        for v in vars(obj).values():
            _held_bytes(v, skip, seen, found)
    return found


def _state_per_element(comm, alg, H):
    m = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.Linear(128, 256))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sar = SparseAllreduce(m.parameters(), comm=comm, density=0.01, algorithm=alg,
                          **({"sync_every": H} if H else {}))
    for _ in range(4):
        opt.zero_grad(set_to_none=False)
        m(torch.randn(8, 256)).pow(2).mean().backward()
        if H:
            sar.reduce_updates(opt)
        else:
            sar.reduce_gradients()
            opt.step()
    skip = {t.untyped_storage().data_ptr() for p in m.parameters() for t in (p, p.grad)}
    return sum(_held_bytes(sar, skip).values()), sar.numel


@pytest.mark.parametrize("H", [None, 2])
@pytest.mark.parametrize("alg", ("dense",) + tuple(SPARSE_ALGORITHMS))
def test_state_held_per_element(alg, H):
    """What usage.md promises a user sizing memory: after steady steps a SparseAllreduce holds
    its fp32 residual (4 bytes an element), local steps add the anchor (4 more), Ok-Topk adds
    its threshold sample (65,536 int32 positions at most, fixed) and under a byte an element of
    staging; nothing else of n."""
    held, n = LocalCluster(2).run(_state_per_element, alg, H)[0]
    got = (held - (4 * min(65536, n) if alg == "oktopk" else 0)) / n
    base = 4.0 + (4.0 if H else 0.0)
    assert base <= got <= base + (1.0 if alg == "oktopk" else 0.05), got

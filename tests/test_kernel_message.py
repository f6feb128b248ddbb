"""kernels/sample.py and kernels/message.py: the rank threshold from the sample and the reduce
rows' message as a few launches, against the chains of torch ops they replaced (transcribed
here as ``_old_*``, the Ok-Topk step's code before the cut), bit for bit, for the torch
reference and the Triton path (interpreter on CPU); edge cases: empty rows, every row full,
true counts past the staging capacity, P = 1, odd P, an all-zero or non-finite sample, a
non-finite step, the bf16 wire with an odd and an even cap_r, more than one program a row."""

import pytest
import torch
from kernel_cases import DEV, gen, needs_triton
from oktopk_triton.kernels import _dispatch
from oktopk_triton.kernels import message as M
from oktopk_triton.kernels import sample as S
from oktopk_triton.kernels.selection import Selection

BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]
H = 2


# -- the code before the cut (the specification) ------------------------------------------------
def _old_sample(grad, residual, idx, velocity, momentum, sk, th_rows, cap, nonfinite):
    P = th_rows.numel()
    th_rows = th_rows.clone()
    g = grad.reshape(-1).index_select(0, idx).float()
    if velocity is not None:
        g = velocity.index_select(0, idx) * momentum + g
    acc = (residual.index_select(0, idx) + g).abs()
    acc = acc.nan_to_num(0.0, 0.0, 0.0)
    x = torch.topk(acc, sk, sorted=False).values.min()
    x = torch.where(x > 0, x, th_rows.min())
    th = torch.maximum(x.expand(P), cap).contiguous()
    if nonfinite is not None:
        th = torch.where(nonfinite > 0, th_rows, th)
    th_rows.copy_(th)
    return th_rows


def _old_select(stg, cr, bf16):
    P, cs = stg.indices.shape
    msg = torch.full((P, H + cr + ((cr + 1) // 2 if bf16 else cr)), 777, dtype=torch.int32,
                     device=DEV)
    wire_vals = torch.zeros(P, 2 * ((cr + 1) // 2), dtype=torch.bfloat16, device=DEV)
    slots_s = torch.arange(cs, dtype=torch.int32, device=DEV)
    slots_r = torch.arange(cr, dtype=torch.int32, device=DEV).reshape(1, -1)
    counts = stg.counts.reshape(P, 1)
    staged = slots_s < counts
    mag = torch.where(staged, stg.values.abs(), torch.full((), -1.0, device=DEV))
    pos = torch.topk(mag, cr, dim=1, sorted=False).indices
    pos = torch.where(counts > cr, pos, slots_r)
    msg[:, 0] = stg.counts.clamp(max=cr)
    msg[:, 1] = stg.nonfinite
    torch.gather(stg.indices, 1, pos, out=msg[:, H:H + cr])
    vals = stg.values.gather(1, pos)
    if bf16:
        wire_vals[:, :cr] = vals
        msg[:, H + cr:] = wire_vals.view(torch.int32)
    else:
        msg[:, H + cr:] = vals.view(torch.int32)
    return msg, vals


# -- the new pipeline, as the Ok-Topk step runs it ----------------------------------------------
def _new_sample(grad, residual, idx, velocity, momentum, sk, th_rows, cap, nonfinite, be):
    th_rows = th_rows.clone()
    mags = S.sample_magnitudes(grad.reshape(-1), residual, idx, velocity=velocity,
                               momentum=momentum, backend=be)
    top = torch.topk(mags, sk, sorted=False).values
    S.sample_threshold(top, th_rows, cap, nonfinite, backend=be)
    return th_rows


def _new_select(stg, cr, bf16, be):
    P = stg.indices.shape[0]
    msg = torch.full((P, H + cr + ((cr + 1) // 2 if bf16 else cr)), 777, dtype=torch.int32,
                     device=DEV)
    mag = M.staged_magnitudes(stg, backend=be)
    pos = torch.topk(mag, cr, dim=1, sorted=False).indices
    vals = M.pack_rows(msg, stg, pos, bf16=bf16, backend=be)
    return msg, vals


def _bits(t):
    return t.contiguous().view(torch.int32)


# -- cases -------------------------------------------------------------------------------------
def _sample_case(n, m, P, seed=0, grad_dtype=torch.float32, velocity=False, zero=False,
                 nonfinite_entries=False):
    g = gen(seed)
    grad = (torch.randn(n, generator=g) * 1e-3).to(grad_dtype)
    residual = torch.randn(n, generator=g) * 1e-3
    vel = torch.randn(n, generator=g) * 1e-3 if velocity else None
    if zero:
        grad.zero_()
        residual.zero_()
        if vel is not None:
            vel.zero_()
    idx = torch.randperm(n, generator=g)[:m].sort().values.to(torch.int32)
    if nonfinite_entries:
        residual[idx[:3].long()] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    th_rows = torch.rand(P, generator=g) * 1e-3 + 1e-5
    cap = torch.rand(P, generator=g) * 2e-3
    cap[0] = 0.0                                   # a row whose floor is below the sample's
    return tuple(None if t is None else t.to(DEV)
                 for t in (grad, residual, idx, vel, th_rows, cap))


def _stage(P, cs, counts, seed=0):
    """Staging rows with stale contents past each count (garbage from earlier steps), ties."""
    g = gen(seed)
    idx = torch.randint(0, 1 << 20, (P, cs), generator=g, dtype=torch.int32)
    vals = torch.randn(P, cs, generator=g)
    vals[:, ::7] = vals[:, 3:4]                   # ties inside each row
    vals[:, 1] = -vals[:, 2]                      # ties of |v| across signs
    cnt = torch.tensor(counts, dtype=torch.int32)
    nf = torch.randint(0, 2, (P,), generator=g, dtype=torch.int32)
    return Selection(idx.to(DEV), vals.to(DEV), cnt.to(DEV), nf.to(DEV))


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("P,velocity,grad_dtype,nf,sk", [
    (4, False, torch.float32, None, 30),
    (4, True, torch.float32, 0, 30),
    (3, True, torch.bfloat16, 1, 7),             # odd P, bf16 grad, a non-finite step: kept
    (1, False, torch.float16, 0, 1),             # P = 1, a one-element top-k
    (4, False, torch.float32, None, 400),        # every sampled entry in the top-k
])
def test_sample_threshold_matches_old_ops(be, P, velocity, grad_dtype, nf, sk):
    n, m = 5000, 400
    grad, res, idx, vel, th, cap = _sample_case(n, m, P, seed=P + sk, grad_dtype=grad_dtype,
                                                velocity=velocity, nonfinite_entries=True)
    nonfinite = None if nf is None else torch.tensor(nf, dtype=torch.int32, device=DEV)
    old = _old_sample(grad, res, idx, vel, 0.9, sk, th, cap, nonfinite)
    new = _new_sample(grad, res, idx, vel, 0.9, sk, th, cap, nonfinite, be)
    assert torch.equal(_bits(new), _bits(old))
    if nf == 1:
        assert torch.equal(new, th)
    else:
        assert not torch.equal(new, th)


@pytest.mark.parametrize("be", BACKENDS)
def test_sample_threshold_all_zero_sample_keeps_the_old_minimum(be):
    grad, res, idx, vel, th, cap = _sample_case(3000, 200, 4, seed=5, zero=True)
    cap.zero_()
    new = _new_sample(grad, res, idx, vel, 0.9, 10, th, cap, None, be)
    assert torch.equal(_bits(new), _bits(_old_sample(grad, res, idx, vel, 0.9, 10, th, cap,
                                                     None)))
    assert torch.equal(new, th.min().expand(4))


@pytest.mark.parametrize("be", BACKENDS)
def test_sample_magnitudes_bitwise_and_non_finite_as_zero(be):
    grad, res, idx, vel, _, _ = _sample_case(4000, 2500, 2, seed=9, velocity=True,
                                             nonfinite_entries=True)   # 3 programs
    for v in (None, vel):
        ref = S.sample_magnitudes(grad, res, idx, velocity=v, momentum=0.7, backend="torch")
        got = S.sample_magnitudes(grad, res, idx, velocity=v, momentum=0.7, backend=be)
        assert torch.equal(_bits(got), _bits(ref))
        assert torch.isfinite(got).all() and (got[:3] == 0).all() and (got >= 0).all()


@pytest.mark.parametrize("be", BACKENDS)
def test_sample_threshold_many_values_and_rows(be):
    """K and P past one block: the single program loops over both."""
    g = gen(3)
    top = (torch.rand(2600, generator=g) + 0.5).to(DEV)
    top[2345] = 0.25                                    # the minimum, in the last block
    th = (torch.rand(1100, generator=g) * 0.1).to(DEV)
    cap = (torch.rand(1100, generator=g) * 0.5).to(DEV)
    got, ref = th.clone(), th.clone()
    S.sample_threshold(top, got, cap, backend=be)
    S.sample_threshold(top, ref, cap, backend="torch")
    assert torch.equal(_bits(got), _bits(ref))
    assert torch.equal(got, torch.maximum(torch.full_like(cap, 0.25), cap))


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("P,cs,cr,counts", [
    (4, 40, 10, [0, 5, 10, 25]),        # empty row, fewer, exactly cap_r, more (top-k)
    (3, 40, 11, [40, 12, 99]),          # odd P and cap_r; all staged; true count > cap_s
    (1, 17, 16, [3]),                   # P = 1
    (1, 17, 16, [17]),
    (2, 3000, 1500, [2999, 700]),       # more than one program a row (odd word count: no)
    (2, 3000, 1501, [2999, 1501]),      # odd cap_r past one program
])
def test_select_message_matches_old_ops(be, bf16, P, cs, cr, counts):
    stg = _stage(P, cs, counts, seed=cs + cr)
    old_msg, old_vals = _old_select(stg, cr, bf16)
    new_msg, new_vals = _new_select(stg, cr, bf16, be)
    assert torch.equal(new_msg, old_msg)
    assert torch.equal(_bits(new_vals), _bits(old_vals))
    assert new_vals.is_contiguous() and new_vals.shape == (P, cr)


@pytest.mark.parametrize("be", BACKENDS)
def test_staged_magnitudes_marks_unstaged_slots(be):
    stg = _stage(3, 50, [0, 20, 80], seed=1)
    mag = M.staged_magnitudes(stg, backend=be)
    ref = M.staged_magnitudes(stg, backend="torch")
    assert torch.equal(_bits(mag), _bits(ref))
    assert (mag[0] == -1).all() and (mag[1, 20:] == -1).all() and (mag[2] >= 0).all()
    assert torch.equal(mag[1, :20], stg.values[1, :20].abs())


def test_each_function_records_one_launch():
    grad, res, idx, _, th, cap = _sample_case(1000, 100, 4)
    stg = _stage(2, 8, [3, 9])
    before = _dispatch.counters()["launches"]
    mags = S.sample_magnitudes(grad, res, idx)
    S.sample_threshold(mags[:5].contiguous(), th, cap)
    mag = M.staged_magnitudes(stg)
    msg = torch.zeros(2, H + 8, dtype=torch.int32, device=DEV)
    M.pack_rows(msg, stg, torch.topk(mag, 4, dim=1).indices)
    assert _dispatch.counters()["launches"] - before == 4


def test_argument_errors():
    grad, res, idx, vel, th, cap = _sample_case(1000, 100, 4)
    with pytest.raises(ValueError, match="residual must be a contiguous 1-dim float32 tensor "
                                         "of 1000"):
        S.sample_magnitudes(grad, res[:-1], idx)
    with pytest.raises(ValueError, match="idx must be a contiguous 1-dim int32"):
        S.sample_magnitudes(grad, res, idx.long())
    with pytest.raises(ValueError, match="velocity must be"):
        S.sample_magnitudes(grad, res, idx, velocity=res.double())
    with pytest.raises(ValueError, match="grad must be"):
        S.sample_magnitudes(grad.reshape(10, 100), res, idx)
    with pytest.raises(ValueError, match="top must hold at least one value"):
        S.sample_threshold(torch.empty(0, device=DEV), th, cap)
    with pytest.raises(ValueError, match="cap must be a contiguous 1-dim float32 tensor of 4"):
        S.sample_threshold(th, th, cap[:3])
    with pytest.raises(ValueError, match="nonfinite must be a one-element int32"):
        S.sample_threshold(th, th, cap, torch.zeros(1, device=DEV))
    stg = _stage(2, 8, [3, 9])
    with pytest.raises(ValueError, match="stage must be a Selection"):
        M.staged_magnitudes(tuple(stg))
    with pytest.raises(ValueError, match="stage.counts must be a contiguous int32 \\[2\\]"):
        M.staged_magnitudes(stg._replace(counts=stg.counts.long()))
    with pytest.raises(ValueError, match="stage.indices int32 and stage.values fp32"):
        M.staged_magnitudes(stg._replace(values=stg.values[:, :4]))
    pos = torch.zeros(2, 4, dtype=torch.int64, device=DEV)
    msg = torch.zeros(2, H + 8, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="pos must be a contiguous int64 \\[2, cap_r\\]"):
        M.pack_rows(msg, stg, pos.int())
    with pytest.raises(ValueError, match="cap_r \\(pos.shape\\[1\\]\\) must be in \\[1, cap_s"):
        M.pack_rows(msg, stg, torch.zeros(2, 9, dtype=torch.int64, device=DEV))
    with pytest.raises(ValueError,
                       match="msg must be an int32 \\[2, 8\\] tensor .*\\(bf16 values\\)"):
        M.pack_rows(msg, stg, pos, bf16=True)
    with pytest.raises(ValueError, match="msg must be an int32 \\[2, 10\\]"):
        M.pack_rows(msg.float(), stg, pos)


def test_compile_variants_name_every_kernel_argument():
    """The compile check's signatures list the kernels' arguments in order (a missing or
    misspelled one would only fail in a process without the interpreter)."""
    variants = list(S.compile_variants()) + list(M.compile_variants())
    assert len({v[0] for v in variants}) == len(variants) == 13
    seen = set()
    for name, fn, sig, consts, div16, warps, options in variants:
        assert list(sig) == list(fn.arg_names), name
        assert options == ({"enable_fp_fusion": False} if "magnitudes grad" in name else {})
        assert set(consts) <= set(sig) and all(sig[c] == "constexpr" for c in consts)
        assert all(0 <= i < len(sig) and sig[list(sig)[i]].startswith("*") for i in div16)
        seen.add(fn.fn.__name__ if hasattr(fn, "fn") else fn.__name__)
    assert seen == {"_sample_magnitudes_kernel", "_sample_threshold_kernel",
                    "_staged_magnitudes_kernel", "_pack_rows_kernel"}


@pytest.mark.skipif(not _dispatch.INTERPRET, reason="records launches of CPU tensors")
def test_compile_variants_cover_the_launches(monkeypatch):
    """Every launch the public functions make, in each mode, is covered by a variant of the
    sm_90 compile check (same argument types, mode constexprs, num_warps, fp fusion)."""
    from test_kernel_dispatch import _assert_covered, _record_launches
    variants = list(S.compile_variants()) + list(M.compile_variants())
    log = _record_launches(monkeypatch, [
        (S, "_sample_magnitudes_kernel"), (S, "_sample_threshold_kernel"),
        (M, "_staged_magnitudes_kernel"), (M, "_pack_rows_kernel")])
    grad, res, idx, vel, th, cap = _sample_case(3000, 200, 4, velocity=True)
    for g, v in ((grad, None), (grad, vel), (grad.bfloat16(), None), (grad.half(), vel)):
        S.sample_magnitudes(g, res, idx, velocity=v, momentum=0.9, backend="triton")
    for nf in (None, torch.zeros((), dtype=torch.int32)):
        S.sample_threshold(th, th.clone(), cap, nf, backend="triton")
    stg = _stage(3, 40, [3, 50, 12])
    M.staged_magnitudes(stg, backend="triton")
    pos = torch.zeros(3, 11, dtype=torch.int64)
    for bf16 in (False, True):
        msg = torch.zeros(3, H + 11 + (6 if bf16 else 11), dtype=torch.int32)
        M.pack_rows(msg, stg, pos, bf16=bf16, backend="triton")
    assert len(log) == 9
    assert _assert_covered(log, variants) == {
        "_sample_magnitudes_kernel", "_sample_threshold_kernel", "_staged_magnitudes_kernel",
        "_pack_rows_kernel"}

"""kernels/region.py: clear_sent (zero what was delivered in the residual and the velocity)
against its reference."""

import oktopk_triton.kernels as K
import pytest
import torch
from kernel_cases import BACKENDS, DEV, gen, needs_triton, region_layout, same_bits
from oktopk_triton.kernels import clear_sent


# ----------------------------------------------------------------------------------------------
# clear_sent
# ----------------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("P", [1, 3, 8])
def test_clear_sent_matches_sets(P):
    n = 4000
    offsets = region_layout(n, P, seed=P)
    g = gen(P)
    cap_s, cap_g = 64, 40
    sent_idx = torch.zeros(P, cap_s, dtype=torch.int32)
    glob_idx = torch.full((P, cap_g), 2 ** 30, dtype=torch.int32)   # padding past the count
    sent_cnt = torch.zeros(P, dtype=torch.int32)
    glob_cnt = torch.zeros(P, dtype=torch.int32)
    want = torch.ones(n)
    for j in range(P):
        size = int(offsets[j + 1] - offsets[j])
        if size == 0:
            continue
        s = torch.randperm(size, generator=g)[:cap_s]
        sent_cnt[j] = s.numel() + (5 if j % 2 else 0)         # past the capacity on odd rows
        sent_idx[j, :s.numel()] = s.to(torch.int32)
        gl = torch.cat([s[: s.numel() // 2], torch.randperm(size, generator=g)[:cap_g]]).unique()
        gl = gl[torch.randperm(gl.numel(), generator=g)][:cap_g].sort().values
        glob_cnt[j] = gl.numel() + (3 if j % 3 == 0 else 0)
        glob_idx[j, :gl.numel()] = gl.to(torch.int32)
        for v in set(s.tolist()) & set(gl.tolist()):
            want[int(offsets[j]) + v] = 0
    if P > 1:                      # a sent entry past the global count must not be cleared
        glob_cnt[P - 1] = min(int(glob_cnt[P - 1]), cap_g)
    for be in ("torch", "triton"):
        r = torch.ones(n, device=DEV)
        clear_sent(r, sent_idx.to(DEV), sent_cnt.to(DEV), offsets, glob_idx.to(DEV),
                   glob_cnt.to(DEV), backend=be)
        assert torch.equal(r.cpu(), want), be


@needs_triton
def test_clear_sent_respects_counts():
    offsets = torch.tensor([0, 10], dtype=torch.int64, device=DEV)
    r0 = torch.arange(1, 11, dtype=torch.float32, device=DEV)
    sent = torch.tensor([[1, 4, 7]], dtype=torch.int32, device=DEV)
    glob = torch.tensor([[1, 4, 7, 8]], dtype=torch.int32, device=DEV)
    for be in ("torch", "triton"):
        r = r0.clone()
        clear_sent(r, sent, torch.tensor([2], dtype=torch.int32, device=DEV), offsets, glob,
                   torch.tensor([2], dtype=torch.int32, device=DEV), backend=be)
        assert r.tolist() == [1, 0, 3, 4, 0, 6, 7, 8, 9, 10], be   # only 1 and 4: 7 past counts


@needs_triton
def test_clear_sent_keeps_bf16_rounding_and_zeroes_velocity():
    """keep_bf16_rounding: a delivered entry keeps r - bf16(r) (what a bf16 wire dropped);
    the velocity is zeroed there; everything else is untouched, in both backends."""
    n = 3000
    offsets = torch.tensor([0, 1000, 3000], dtype=torch.int64, device=DEV)
    r0 = (torch.randn(n, generator=gen(9)) * 3).to(DEV)
    sent = torch.tensor([[5, 17, 600, 999], [0, 44, 1999, 7]], dtype=torch.int32, device=DEV)
    cnt = torch.tensor([4, 3], dtype=torch.int32, device=DEV)          # [1, 3] = 7 not counted
    glob = torch.tensor([[5, 600, 998], [0, 7, 1999]], dtype=torch.int32, device=DEV)
    gcnt = torch.tensor([3, 3], dtype=torch.int32, device=DEV)
    hit = torch.tensor([5, 600, 1000, 2999])
    res = {}
    for be in ("torch", "triton"):
        r, v = r0.clone(), torch.ones(n, device=DEV)
        clear_sent(r, sent, cnt, offsets, glob, gcnt, velocity=v, keep_bf16_rounding=True,
                   backend=be)
        res[be] = (r.cpu(), v.cpu())
    r0 = r0.cpu()
    want = r0.clone()
    want[hit] = r0[hit] - r0[hit].to(torch.bfloat16).float()
    vwant = torch.ones(n)
    vwant[hit] = 0
    for be in res:
        assert torch.equal(res[be][0], want), be
        assert torch.equal(res[be][1], vwant), be
    assert bool((want[hit] != 0).any())


# ----------------------------------------------------------------------------------------------
# clear_sent with a velocity
# ----------------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("P", [1, 3, 5])
def test_clear_sent_with_velocity(P):
    """residual and velocity are zeroed at the same positions (sent ∩ the first global_counts of
    the global row); everything else is bitwise unchanged; without a velocity only the residual
    changes."""
    n = 3001
    g = gen(P)
    offsets = region_layout(n, P, seed=P).cpu()
    cap_s, cap_g = 40, 30
    sent = torch.zeros(P, cap_s, dtype=torch.int32)
    glob = torch.zeros(P, cap_g, dtype=torch.int32)
    sent_counts = torch.zeros(P, dtype=torch.int32)
    glob_counts = torch.zeros(P, dtype=torch.int32)
    want = torch.zeros(n, dtype=torch.bool)
    for j in range(P):
        a, b = int(offsets[j]), int(offsets[j + 1])
        L = b - a
        if L == 0:
            continue
        s_idx = torch.randperm(L, generator=g)[:cap_s]
        g_idx = torch.cat([s_idx[: len(s_idx) // 2], torch.randperm(L, generator=g)[:cap_g]])
        g_idx = g_idx.unique()[:cap_g].sort().values
        sent[j, :len(s_idx)] = s_idx.to(torch.int32)
        glob[j, :len(g_idx)] = g_idx.to(torch.int32)
        sent_counts[j] = min(len(s_idx), cap_s - 3)              # the last few sent are stale
        glob_counts[j] = len(g_idx) + (5 if j % 2 else 0)          # past capacity: clamped
        valid_g = set(g_idx.tolist()[:min(int(glob_counts[j]), cap_g)])
        for i in s_idx.tolist()[:int(sent_counts[j])]:
            if i in valid_g:
                want[a + i] = True
    assert want.any()
    r0 = torch.randn(n, generator=g) + 3.0          # nonzero everywhere
    u0 = torch.randn(n, generator=g) + 3.0
    args = [t.to(DEV) for t in (sent, sent_counts, offsets, glob, glob_counts)]
    for be in BACKENDS:
        r, u = r0.clone().to(DEV), u0.clone().to(DEV)
        K.clear_sent(r, *args, velocity=u, backend=be)
        r, u = r.cpu(), u.cpu()
        assert torch.equal(r == 0, want) and torch.equal(u == 0, want), be
        assert same_bits(r[~want], r0[~want]) and same_bits(u[~want], u0[~want]), be
        r = r0.clone().to(DEV)
        K.clear_sent(r, *args, backend=be)
        assert torch.equal(r.cpu() == 0, want), be

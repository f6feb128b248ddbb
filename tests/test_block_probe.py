"""tools/research/block_probe.py: the idealised block exchanges it trains with keep the step
contract (conservation, identical outputs), deliver whole blocks within the budget, and at one
density cost the same q2 bits at every block size."""
import re

import pytest
import torch

from oktopk_triton.comm.local import LocalCluster

from tools.research import block_probe as bp

pytestmark = pytest.mark.research

N = 1000


def test_blocks_cost_the_budget_in_q2_bits():
    assert bp.blocks_for(0.016, 100_000, 1) == 1600
    for B in (4, 8, 16):
        bits = bp.blocks_for(0.016, 100_000, B) * (16 + 2 * B)
        assert abs(bits - 1600 * 18) <= 16 + 2 * B
    assert bp.blocks_for(0.9, 10, 8) == 2          # never more blocks than n holds


def _steps(comm, exchange, block, **kw):
    alg = bp.BlockProbe(N, comm, 0.05, block=block, exchange=exchange, **kw)
    g = torch.Generator().manual_seed(comm.rank)
    rows = []
    for _ in range(3):
        grad = torch.randn(N, generator=g) * torch.linspace(0.1, 2, N)
        acc = alg.residual + grad
        out = alg(grad).clone()
        rows.append((acc, out, alg.residual.clone()))
    return rows


@pytest.mark.parametrize("exchange", ["sum", "union", "partial", "fill", "recheck", "watch"])
@pytest.mark.parametrize("block", [1, 7])
def test_probe_keeps_the_contract_and_delivers_whole_blocks(exchange, block):
    P = 3
    res = LocalCluster(P, timeout=60).run(_steps, exchange, block)
    budget = bp.blocks_for(0.05, N, block)
    for s in range(3):
        accs = torch.stack([r[s][0] for r in res])
        out = res[0][s][1]
        resid = torch.stack([r[s][2] for r in res])
        assert all(torch.equal(r[s][1], out) for r in res)
        torch.testing.assert_close(accs.sum(0), P * out + resid.sum(0), rtol=0, atol=1e-5)
        pad = torch.zeros(-(-N // block) * block)
        pad[:N] = (out != 0).float()
        hit = pad.view(-1, block).sum(1)
        assert int((hit > 0).sum()) <= budget * (P if exchange == "union" else 1)
        if exchange != "union":
            assert int((hit > 0).sum()) == budget
            if block == 1 and exchange == "sum":    # the exact global top-k of the sum
                top = accs.sum(0).abs().topk(budget).indices
                assert torch.equal((out != 0).nonzero().view(-1), top.sort().values)
        if exchange in ("fill", "recheck", "watch"):   # every part of a delivered entry: none owed
            assert not bool(((out != 0) & (resid != 0).any(0)).any())
        if exchange == "partial":   # a delivered entry some rank did not take stays owed
            assert bool(((out != 0) & (resid != 0).any(0)).any())
        full = hit[:N // block]
        assert bool(((full == 0) | (full == block)).all())     # whole blocks only


@pytest.mark.parametrize("block", [1, 7])
def test_recheck_spans_fill_to_the_whole_sum(block):
    """``candidates=1`` delivers what ``fill`` does; candidates covering n, what ``sum`` does;
    two candidates a block, a choice by the whole sums that ``fill`` does not make."""
    P = 3
    outs = {}
    for name, ex, kw in (("fill", "fill", {}), ("sum", "sum", {}),
                         ("c1", "recheck", {"candidates": 1}),
                         ("call", "recheck", {"candidates": 1e9}),
                         ("c2", "recheck", {"candidates": 2})):
        res = LocalCluster(P, timeout=60).run(_steps, ex, block, **kw)
        outs[name] = [res[0][s][1] for s in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(outs["c1"], outs["fill"]))
    assert all(torch.equal(a, b) for a, b in zip(outs["call"], outs["sum"]))
    assert not torch.equal(outs["c2"][0] != 0, outs["fill"][0] != 0)


def _watch_steps(comm, watch):
    """Three syncs of ``exchange="watch"``, then what the third one watched and delivered."""
    alg = bp.BlockProbe(N, comm, 0.05, exchange="watch", watch=watch)
    g = torch.Generator().manual_seed(comm.rank)
    outs = []
    for _ in range(3):
        outs.append(alg(torch.randn(N, generator=g) * torch.linspace(0.1, 2, N)).clone())
    return outs, int(alg.stats["watched"]), int(alg.stats["watched_delivered"])


def test_watch_starts_as_fill_then_watches_what_it_delivered():
    """The first sync has nothing to watch, so it delivers what ``fill`` delivers; the third
    watches the union of the last ``watch`` syncs' deliveries."""
    P = 3
    fill = LocalCluster(P, timeout=60).run(_steps, "fill", 1)
    for watch in (1, 2):
        res = LocalCluster(P, timeout=60).run(_watch_steps, watch)
        outs, watched, kept = res[0]
        assert torch.equal(outs[0], fill[0][0][1])
        last = [(o != 0) for o in outs[2 - watch:2]]
        union = last[0] if watch == 1 else last[0] | last[1]
        assert watched == int(union.sum())
        assert 0 < kept <= min(watched, int((outs[2] != 0).sum()))


def test_probe_refuses_a_bad_option():
    def build(comm):
        bp.BlockProbe(N, comm, 0.05, block=0)
    with pytest.raises(Exception, match="block must be an int >= 1"):
        LocalCluster(1, timeout=10).run(build)

    def build_c(comm):
        bp.BlockProbe(N, comm, 0.05, exchange="recheck", candidates=0.5)
    with pytest.raises(Exception, match="candidates must be a number >= 1, got 0.5"):
        LocalCluster(1, timeout=10).run(build_c)

    def build_b(comm):
        bp.BlockProbe(N, comm, 0.05, exchange="fill", consistency=1.0)
    with pytest.raises(Exception, match=r"consistency must be a number in \[0, 1\), got 1.0"):
        LocalCluster(1, timeout=10).run(build_b)

    for ex, kw in (("sum", {"consistency": 0.9}), ("watch", {"consistency": 0.5}),
                   ("partial", {"diagnose": 5})):
        def build_x(comm, ex=ex, kw=kw):
            bp.BlockProbe(N, comm, 0.05, exchange=ex, **kw)
        with pytest.raises(Exception, match=f"needs fill; got exchange='{ex}'"):
            LocalCluster(1, timeout=10).run(build_x)

    def build_w(comm):
        bp.BlockProbe(N, comm, 0.05, exchange="watch", watch=0)
    with pytest.raises(Exception, match="watch must be an int >= 1, got 0"):
        LocalCluster(1, timeout=10).run(build_w)


def test_consistency_changes_only_what_a_rank_takes():
    """``consistency=0`` is ``fill``; 0.9 ranks by ``|acc|·|EMA(sign(grad))|`` (the first sync's
    EMA is the signs themselves, so its choice is ``fill``'s), a different choice later, with
    conservation and nothing owed at a delivered entry as before. ``union`` takes it too."""
    P = 3
    fill = LocalCluster(P, timeout=60).run(_steps, "fill", 1)
    same = LocalCluster(P, timeout=60).run(_steps, "fill", 1, consistency=0.0)
    cons = LocalCluster(P, timeout=60).run(_steps, "fill", 1, consistency=0.9)
    assert all(torch.equal(a[s][1], b[s][1]) for a, b in zip(fill, same) for s in range(3))
    assert torch.equal(cons[0][0][1], fill[0][0][1])
    assert not torch.equal(cons[0][2][1] != 0, fill[0][2][1] != 0)
    for s in range(3):
        accs = torch.stack([r[s][0] for r in cons])
        resid = torch.stack([r[s][2] for r in cons])
        out = cons[0][s][1]
        torch.testing.assert_close(accs.sum(0), P * out + resid.sum(0), rtol=0, atol=1e-5)
        assert not bool(((out != 0) & (resid != 0).any(0)).any())
    union = LocalCluster(P, timeout=60).run(_steps, "union", 1)
    cunion = LocalCluster(P, timeout=60).run(_steps, "union", 1, consistency=0.9)
    assert not torch.equal(union[0][2][1] != 0, cunion[0][2][1] != 0)


def test_diagnose_reports_without_changing_the_exchange(capsys):
    """``diagnose`` only reads: ``fill`` delivers the same bits with it, and rank 0 prints the
    shares, each within [0, 1]."""
    P = 3
    plain = LocalCluster(P, timeout=60).run(_steps, "fill", 1)
    seen = LocalCluster(P, timeout=60).run(_steps, "fill", 1, diagnose=3)
    assert all(torch.equal(a[s][1], b[s][1]) for a, b in zip(plain, seen) for s in range(3))
    line = [ln for ln in capsys.readouterr().out.splitlines() if "diagnose sync 3" in ln]
    assert len(line) == 1
    shares = [float(x) for x in re.findall(r"\d+\.\d+|nan", line[0].split(":", 1)[1])]
    assert len(shares) == 6 and all(0 <= x <= 1 for x in shares[:5])

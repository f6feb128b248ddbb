"""tools/research/volume_at_scale.py at small P and n: the bytes each rank receives per sync of
the local steps, counted from the messages it gets, equal the schedule's formula on every rank
(Ok-Topk and TopkA, odd P too); TopkA's match the closed form of its allgather; what the ranks
receive adds up to what they send; the JSON record carries the project's header."""
import json

import pytest
import torch

from oktopk_triton.bench.records import HEADER_KEYS
from oktopk_triton.comm.base import ring_allreduce_bytes
from oktopk_triton.comm.local import LocalCluster

from tools.research import volume_at_scale as vas

pytestmark = pytest.mark.research


@pytest.mark.parametrize("P", [2, 3, 5])
@pytest.mark.parametrize("alg", ["oktopk", "topka"])
def test_measured_received_bytes_equal_the_formula(alg, P):
    n, d = 1024, 0.05
    r = vas.measure(alg, P, n, d, H=2, syncs=2)
    assert r["matches_formula"] and r["received_per_sync"] == r["received_formula"] > 0
    assert r["received_sum"] == r["sent_sum"]           # every byte sent is received somewhere
    if alg == "topka":      # an allgather of k (int32 index, fp32 value) pairs + the 4-byte flag
        assert r["received_per_sync"] == (P - 1) * 8 * r["k"] + ring_allreduce_bytes(4, P)
        assert r["k"] <= r["delivered"] <= P * r["k"]   # the union of the ranks' top-k
    else:
        assert r["delivered"] <= r["k"]


def _counter_body(comm):
    vas.count_received(comm)
    P, me = comm.world_size, comm.rank
    comm.allgather(torch.empty(P * 3), torch.ones(3))                    # (P-1)*12
    comm.alltoall(torch.empty(2 * P), torch.ones(2 * P))                 # (P-1)*8
    comm.broadcast(torch.ones(5), root=0)                                # 20 off the root
    comm.send_recv([((me + 1) % P, torch.ones(7))], [((me - 1) % P, torch.empty(7))])  # 28
    comm.allreduce(torch.ones(10))                                       # ring: 2(P-1)/P*40
    return comm.bytes_received


def test_counter_counts_each_primitive():
    P = 3
    got = LocalCluster(P).run(_counter_body)
    base = (P - 1) * 12 + (P - 1) * 8 + 28 + ring_allreduce_bytes(40, P)
    assert got == [base] + [base + 20] * (P - 1)


def test_tool_writes_a_record_and_the_table(tmp_path, capsys):
    out = tmp_path / "v.json"
    rc = vas.main(["--world-sizes", "2", "4", "--numel", "2048", "--densities", "0.05",
                   "--sync-every", "2", "--syncs", "2", "--json", str(out), "--markdown"])
    assert rc == 0
    rec = json.loads(out.read_text())
    assert set(HEADER_KEYS) <= set(rec) and rec["benchmark"] == "volume-at-scale"
    assert [row["P"] for row in rec["rows"]] == [2, 4]
    for row in rec["rows"]:
        assert row["ratio"] == pytest.approx(row["oktopk"]["received_per_sync"]
                                             / row["topka"]["received_per_sync"])
        assert row["oktopk_equal_output"]["k"] >= row["topka"]["delivered"] - 1
    # TopkA's volume grows with P at a fixed k, Ok-Topk's stays about flat: the ratio falls
    assert rec["rows"][1]["ratio"] < rec["rows"][0]["ratio"]
    text = capsys.readouterr().out
    assert "| density | P |" in text and "Ok-Topk / TopkA" in text

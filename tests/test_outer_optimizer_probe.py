"""tools/research/outer_optimizer.py: each variant runs on 3 thread ranks and prints its final
losses as one JSON line; the replicas agree (the outer step is applied alike on every rank)."""
import json

import pytest

from tools.research import outer_optimizer as probe

pytestmark = pytest.mark.research


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch):
    from oktopk_triton.kernels import _dispatch
    monkeypatch.setattr(_dispatch, "INTERPRET", False)      # the kernels' torch references


def test_every_variant_runs_and_prints_one_line(capsys):
    assert probe.main(["--variants", ",".join(probe.VARIANTS), "--seeds", "0",
                       "--syncs", "1"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["variant"] for x in lines] == list(probe.VARIANTS)
    assert all(len(x["final"]) == 1 and x["final"][0] > 0 and x["bytes"] > 0 for x in lines)


def test_the_ranks_end_alike():
    from oktopk_triton.comm.local import LocalCluster
    res = LocalCluster(3).run(probe.run, probe.VARIANTS["sparse-nest-after-m05"], 0, 2)
    assert res[0]["losses"] == res[1]["losses"] == res[2]["losses"]

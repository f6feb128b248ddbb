"""The launch budget (docs/research/launch-budget.md): a steady call of each row below issues at
most what oktopk_triton/bench/launch_budget.json records (dispatches, kernel-launching ops,
collectives, host reads, full-length passes), traced on CPU by ``oktopk-bench launches``; and the
counter's rules themselves."""
import json

import pytest
import torch

import oktopk_triton.kernels as K
from oktopk_triton import cli
from oktopk_triton.bench import launches as L
from oktopk_triton.comm.local import SingleCommunicator

ROWS = [("oktopk", "fp32", "gradients"), ("oktopk", "compact", "gradients"),
        ("oktopk", "fp32", "local"), ("oktopk", "fp32", "sync"), ("oktopk", "fp32", "updates"),
        ("dense", "fp32", "gradients"), ("topka", "fp32", "gradients")]


def _budget_n():
    with open(L.BUDGET_FILE) as f:
        return json.load(f)["n"]


@pytest.mark.parametrize("algorithm,wire,mode", ROWS)
def test_steady_call_within_its_budget(algorithm, wire, mode):
    budget = L.load_budget()
    key = L.row_key(algorithm, wire, mode)
    assert key in budget, f"{key} has no recorded budget"
    row = {"algorithm": algorithm, "wire": wire, "mode": mode,
           **L.count_step(algorithm, wire, mode, n=_budget_n())}
    assert L.over_budget(row, budget) == [], row["glue_ops"]
    assert row["host_reads"] == 0          # a steady step never waits for the host


@pytest.mark.parametrize("wire,launches", [("q2", 12), ("fp32", 4)])
def test_complete_sums_adds_its_kernels_and_two_collectives(wire, launches):
    """Ok-Topk's ``complete_sums`` (kernels/completion.py): q2, two encodes of 5 launches, the
    owner's sum and the add; fp32, one launch each; no glue op, no host read, no pass over n."""
    base = L.count_step("oktopk", wire, "gradients", n=_budget_n())
    full = L.count_step("oktopk", wire, "gradients", n=_budget_n(), complete_sums=True,
                        momentum=0.9)
    plain = L.count_step("oktopk", wire, "gradients", n=_budget_n(), momentum=0.9)
    assert full["launches"] - plain["launches"] == launches, full["glue_ops"]
    assert full["glue"] == plain["glue"] == base["glue"], full["glue_ops"]
    assert full["collectives"] - plain["collectives"] == 2
    assert full["host_reads"] == 0 and full["full_passes"] == plain["full_passes"]


@pytest.mark.parametrize("wire", ["q2", "fp32"])
def test_consistency_adds_no_launch_and_no_pass(wire):
    """Ok-Topk's ``consistency``: the sign EMA is updated in the select pass and its weight rides
    in the staged and sampled magnitudes: no launch, no pass over n, no glue op, no collective
    and no host read more (a launch of its own was one pass more)."""
    plain = L.count_step("oktopk", wire, "gradients", n=_budget_n(), momentum=0.9)
    cons = L.count_step("oktopk", wire, "gradients", n=_budget_n(), momentum=0.9,
                        consistency=0.9)
    print(f"\n{wire}: launches {plain['launches']} -> {cons['launches']}, passes "
          f"{plain['full_passes']} -> {cons['full_passes']}")
    assert cons["launches"] == plain["launches"], cons["glue_ops"]
    assert cons["glue"] == plain["glue"], cons["glue_ops"]
    assert cons["collectives"] == plain["collectives"]
    assert cons["host_reads"] == 0 and cons["full_passes"] == plain["full_passes"]


def test_the_goals_met_stay_met_in_the_budget():
    """docs/research/launch-budget.md: a steady Ok-Topk step dispatches at most 150 ops and a
    non-sync local-steps call at most the optimizer's ops + 5, each read from the recorded
    budget."""
    b = L.load_budget()
    assert b["oktopk/fp32/gradients"]["dispatches"] <= 150
    assert b["oktopk/fp32/local"]["launches"] <= b["oktopk/fp32/optimizer"]["launches"] + 5
    assert all(v["host_reads"] == 0 for v in b.values())


def test_counter_rules():
    """Views, empty allocations and profiler ranges (the optimizers' ``record_function``) are
    dispatches but no launch; a kernel's reference ops are its recorded launches, not glue; a
    collective and a host read are counted as such."""
    n = 64
    comm = SingleCommunicator()
    x = torch.randn(n)
    flag = torch.zeros((), dtype=torch.int32)

    def call():
        y = x.view(8, 8)                   # view: dispatch, no launch
        torch.empty(n)                     # allocation: dispatch, no launch
        with torch.autograd.profiler.record_function("step"):   # a host-side range: no launch
            pass
        z = y + 1                          # launch, full pass (n elements)
        z[:2].sum()                        # slice (view) + sum (launch)
        K.fill_if(x, flag, 0.0)            # kernel: 1 launch, its ops not glue
        comm.allreduce(z)                  # collective
        int(z[0, 0].item() > 0)            # host read
    c = L.trace_call(call, n, comm)
    assert c["glue"] == 2 and c["kernel"] == 1 and c["launches"] == 3
    assert c["collectives"] == 1 and c["host_reads"] == 1
    assert c["full_passes"] == 1
    assert c["dispatches"] >= 6


def test_over_budget_names_the_column():
    row = {"algorithm": "oktopk", "wire": "fp32", "mode": "gradients", "dispatches": 10 ** 6,
           "launches": 0, "collectives": 0, "host_reads": 0, "full_passes": 0}
    over = L.over_budget(row, L.load_budget())
    assert len(over) == 1 and over[0].startswith("dispatches 1000000 >")


def test_cli_writes_the_table(tmp_path, capsys):
    path = tmp_path / "rows.json"
    assert cli.main(["launches", "--algorithms", "dense", "--modes", "gradients", "optimizer",
                     "--n", "4096", "--json", str(path)]) == 0
    assert "| dense | fp32 | gradients |" in capsys.readouterr().out
    rows = json.loads(path.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["gradients", "optimizer"]
    assert rows[0]["collectives"] == 2       # dense: the non-finite flag's allreduce, the data's
    assert rows[1]["collectives"] == 0 and rows[1]["launches"] > 0   # the optimizer alone


def test_cli_traces_with_an_option(tmp_path, capsys):
    """``--option`` reaches the algorithm (complete_sums: two more collectives), is recorded in
    the JSON, and a refused option or one with --check is a one-line exit 2."""
    path = tmp_path / "rows.json"
    assert cli.main(["launches", "--algorithms", "oktopk", "--modes", "gradients",
                     "--wire-formats", "q2", "--n", "4096", "--option", "complete_sums=true",
                     "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["options"] == {"complete_sums": True}
    assert data["rows"][0]["collectives"] == 5
    for argv, match in ((["--option", "complete_sums=1"], "complete_sums must be True or False"),
                        (["--option", "complete_sums=true", "--check"], "budgets are recorded")):
        with pytest.raises(SystemExit) as e:
            cli.main(["launches", "--algorithms", "oktopk", "--n", "4096", *argv])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert match in err[-1]


def test_interpreted_needs_the_interpreter(monkeypatch, capsys):
    monkeypatch.setattr(L._dispatch, "INTERPRET", False)
    with pytest.raises(SystemExit) as e:
        cli.main(["launches", "--interpreted", "--algorithms", "dense"])
    assert e.value.code == 2
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err

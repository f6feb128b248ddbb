"""``oktopk-bench faults`` without a cluster: the bytes arithmetic, the table, the refusals and the
PNG on canned replica results, and the command line's parsing (the demo itself is ``make
faults``)."""
import pytest

from oktopk_triton import cli
from oktopk_triton.bench import faults


def _rec(P, committed=True, nbytes=100, err=1e-8, healed=False):
    return {"step": None, "P": P, "rank": 0, "committed": committed, "healed": healed,
            "bytes": nbytes, "relative_error": err if committed else None, "error": None}


def _result(mode="sparse", H=4, history=None, loss=0.5, heals=0, local_steps=16):
    history = history if history is not None else [_rec(4) for _ in range(4)]
    syncs = sum(h["committed"] for h in history)
    return {"config": {"mode": mode, "sync_every": H}, "history": history,
            "evals": [[0, 2.3], [syncs, loss]], "eval_steps": [1, local_steps],
            "bytes": sum(h["bytes"] for h in history), "heals": heals,
            "local_steps": local_steps, "step": syncs}


def test_dense_bytes_are_a_ring_allreduce_of_the_fp32_parameters():
    assert faults.dense_sync_bytes(1000, 4) == 2 * 3 * 4000 // 4
    assert faults.dense_sync_bytes(1000, 3) == 2 * 2 * 4000 // 3
    assert faults.dense_sync_bytes(1000, 1) == 0


def test_same_bytes_interval_gives_dense_at_least_the_sparse_bytes():
    n, steps = 1000, 512
    per_sync = faults.dense_sync_bytes(n, 4)            # 6000 B at P = 4
    h = faults.same_bytes_interval(steps, n, per_sync / 50, [4] * 8)
    assert h == 32                                       # largest 2^k <= 50 with 512 / (4h) whole
    assert per_sync / h >= per_sync / 50
    # the P of each committed sync weighs in: a quarter at P = 3 makes a sync cheaper
    mixed = faults.same_bytes_interval(steps, n, 4750 / 40, [3, 4, 4, 4])
    assert mixed == 32 and steps % (4 * mixed) == 0
    assert faults.same_bytes_interval(steps, n, 0.0, []) == 4


def test_summary_row_and_table():
    ok = [_result(loss=0.25), _result(loss=0.25), None,
          _result(loss=0.25, heals=1, local_steps=8)]
    row = faults.summarize("sparse+fault", ok, 12.5, reference=0.2)
    assert row["final_loss"] == 0.25 and row["syncs"] == 4 and row["heals"] == 1
    assert row["vs_fault_free_pct"] == pytest.approx(25.0)
    assert row["bytes_per_step"] == pytest.approx(400 / 16)       # the healed one left out
    assert row["max_conservation_error"] == pytest.approx(1e-8)
    dense = faults.summarize("dense-H4+fault", [_result(
        "dense", history=[_rec(4, err=None), _rec(4, committed=False), _rec(3, err=None)])],
        3.0)
    assert dense["max_conservation_error"] is None and dense["rolled_back"] == 1
    text = faults.format_table([row, dense])
    lines = text.splitlines()
    assert lines[0].split(" | ")[0].strip() == "run" and "max cons. err" in lines[0]
    assert "+25.00%" in text and "1.0e-08" in text and "—" in text and "12.5" in text


def test_a_run_that_is_not_conserved_or_whose_replicas_differ_fails():
    with pytest.raises(RuntimeError, match="not conserved"):
        faults.summarize("x", [_result(history=[_rec(4, err=2e-6)])], 1.0)
    with pytest.raises(RuntimeError, match="not audited"):
        faults.summarize("x", [_result(history=[_rec(4, err=None)])], 1.0)
    with pytest.raises(RuntimeError, match="different test losses"):
        faults.summarize("x", [_result(loss=0.2), _result(loss=0.3)], 1.0)


def test_the_png_is_written(tmp_path):
    rows = []
    for name, H in (("sparse", 4), ("sparse+fault", 4), ("dense-same-bytes+fault", 8),
                    ("dense-H4+fault", 4)):
        res = _result(H=H)
        rows.append({"run": name, "sync_every": H, "final_loss": 0.25,
                     "curve": faults.curve(res)})
    assert rows[0]["curve"]["sync_steps"] == [4, 8, 12, 16]
    assert rows[0]["curve"]["bytes"] == [100, 200, 300, 400]
    path = faults.plot(rows, str(tmp_path / "f.png"), 4, 8, "canned")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_command_line(tmp_path):
    p = cli.build_parser("faults")
    done = tmp_path / "faults"            # a folder an earlier run left: written into again
    done.mkdir()
    assert p.parse_args(["faults", "--out", str(done)]).out == str(done)
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        p.parse_args(["faults", "--out", str(tmp_path / "file")])
    args = p.parse_args(["faults", "--out", "somewhere", "--steps", "256", "--density", "0.1"])
    assert args.out == "somewhere" and args.steps == 256 and args.density == 0.1
    assert args.wire_format == "fp32"
    assert p.parse_args(["faults", "--wire-format", "q2"]).wire_format == "q2"
    assert args.sync_every == faults.DEFAULTS["sync_every"] and args._module is faults
    assert faults.check_args(args) == ""
    assert "--steps (100)" in faults.check_args(p.parse_args(["faults", "--steps", "100"]))
    with pytest.raises(SystemExit):
        p.parse_args(["faults", "--density", "2"])
    assert cli.SUBCOMMANDS["faults"][0] == "faults"
